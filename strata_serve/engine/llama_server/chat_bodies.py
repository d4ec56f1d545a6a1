"""Anthropic Messages and OpenAI Responses bodies as the chat-completions body llama-server
turns each into before it renders its chat template.

llama-server makes both conversions in C++ (``server_chat_convert_anthropic_to_oai`` and
``server_chat_convert_responses_to_chatcmpl``, ``tools/server/server-chat.cpp``) and shows
neither result. What follows is a copy of the two, read from the engine version this
backend builds, field by field and in the engine's order. A copy can drift from a newer
engine: the backend checks what it makes against the engine's own count of the original
body's tokens (:data:`COUNT_PATHS`), and a difference means "not tokenized here", never a
wrong prompt.

Where the engine would refuse the body, :class:`NotConverted` is raised: the request itself
is then refused by the engine, and nothing needs its tokens.
"""

from __future__ import annotations

import json
from typing import Any

#: Paths whose body is converted, and the engine's route that counts its tokens.
COUNT_PATHS = {
    "/v1/messages": "/v1/messages/count_tokens",
    "/v1/responses": "/v1/responses/input_tokens",
    "/responses": "/responses/input_tokens",
}

#: Claude Code's first system line carries a stamp that changes at every request; the engine
#: overwrites it with ``f`` so that the prompt's prefix stays the same.
BILLING_PREFIX = "x-anthropic-billing-header:"
STAMP_LENGTH = 5


class NotConverted(ValueError):
    """The engine refuses this body (it raises where this is raised)."""


def _value(obj: Any, key: str, default: Any) -> Any:
    """The engine's ``json_value``: ``obj[key]`` when present, not null and of the default's
    type; else the default (a null default takes any value)."""
    if not isinstance(obj, dict) or obj.get(key) is None:
        return default
    value = obj[key]
    if default is None:
        return value
    if isinstance(default, str):
        return value if isinstance(value, str) else default
    if isinstance(default, dict):
        return value if isinstance(value, dict) else default
    if isinstance(default, int):
        return int(value) if isinstance(value, (int, float)) else default
    return value


def _dump(value: Any) -> str:
    """The engine's ``dump()``: compact, in the order the body gave, UTF-8 kept."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def normalized_billing(text: str) -> str:
    """``text`` with the stamp of a Claude Code billing line (``cch=xxxxx;``) made ``fffff``."""
    if not text.startswith(BILLING_PREFIX):
        return text
    at = text.find("cch=", len(BILLING_PREFIX))
    if at < 0:
        return text
    start = at + 4
    if start + STAMP_LENGTH < len(text) and text[start + STAMP_LENGTH] == ";":
        return text[:start] + "f" * STAMP_LENGTH + text[start + STAMP_LENGTH:]
    return text


# -- Anthropic Messages ------------------------------------------------------------------


def _anthropic_system(system: Any) -> str:
    if isinstance(system, str):
        return normalized_billing(system)
    if isinstance(system, list):
        return "".join(normalized_billing(_value(block, "text", "")) for block in system
                       if _value(block, "type", "") == "text")
    return ""


def _image_url(source: Any) -> str | None:
    kind = _value(source, "type", "")
    if kind == "base64":
        media = _value(source, "media_type", "image/jpeg")
        return f"data:{media};base64,{_value(source, 'data', '')}"
    if kind == "url":
        url: str = _value(source, "url", "")
        return url
    return None


def _tool_result(block: Any) -> dict[str, Any]:
    call = _value(block, "tool_use_id", "")
    content = _value(block, "content", None)
    if isinstance(content, str):
        return {"role": "tool", "tool_call_id": call, "content": content}
    if not isinstance(content, list):
        return {"role": "tool", "tool_call_id": call, "content": ""}
    text, parts, images = "", [], False
    for part in content:
        kind = _value(part, "type", "")
        if kind == "text":
            piece = _value(part, "text", "")
            text += piece
            parts.append({"type": "text", "text": piece})
        elif kind == "image":
            images = True
            url = _image_url(_value(part, "source", {}))
            if url is not None:
                parts.append({"type": "image_url", "image_url": {"url": url}})
    return {"role": "tool", "tool_call_id": call, "content": parts if images else text}


def _anthropic_message(message: Any) -> list[Any]:
    """One Anthropic message as the chat messages it becomes (none, one, or one and its tools' results)."""
    role = _value(message, "role", "")
    if not isinstance(message, dict) or "content" not in message:
        return [] if role == "assistant" else [message]
    content = message["content"]
    if not isinstance(content, list):
        return [message]
    converted: list[Any] = []
    calls: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    reasoning = ""
    for block in content:
        kind = _value(block, "type", "")
        if kind == "text":
            converted.append(block)
        elif kind == "thinking":
            reasoning += _value(block, "thinking", "")
        elif kind == "image":
            url = _image_url(_value(block, "source", {}))
            if url is not None:
                converted.append({"type": "image_url", "image_url": {"url": url}})
        elif kind == "tool_use":
            arguments = _value(block, "input", None)
            calls.append({"id": _value(block, "id", ""), "type": "function",
                          "function": {"name": _value(block, "name", ""),
                                       "arguments": _dump({} if arguments is None else arguments)}})
        elif kind == "tool_result":
            results.append(_tool_result(block))
    out: list[Any] = []
    if converted or calls or reasoning:
        new: dict[str, Any] = {"role": role, "content": converted if converted else ""}
        if calls:
            new["tool_calls"] = calls
        if reasoning:
            new["reasoning_content"] = reasoning
        out.append(new)
    return out + results


def anthropic_as_chat(body: dict[str, Any]) -> dict[str, Any]:
    """The chat body llama-server makes of an Anthropic Messages body."""
    messages: list[Any] = []
    system = _value(body, "system", None)
    if system is not None:
        messages.append({"role": "system", "content": _anthropic_system(system)})
    if "messages" not in body:
        raise NotConverted("'messages' is required")
    if isinstance(body["messages"], list):
        for message in body["messages"]:
            messages.extend(_anthropic_message(message))
    chat: dict[str, Any] = {"messages": messages}
    tools = body.get("tools")
    if isinstance(tools, list):
        chat["tools"] = [{"type": "function", "function": {
            "name": _value(tool, "name", ""), "description": _value(tool, "description", ""),
            "parameters": tool["input_schema"] if isinstance(tool, dict) and "input_schema" in tool else {}}}
            for tool in tools]
    choice = body.get("tool_choice")
    if isinstance(choice, dict):
        kind = _value(choice, "type", "")
        if kind == "auto":
            chat["tool_choice"] = "auto"
        elif kind in ("any", "tool"):
            chat["tool_choice"] = "required"
    if "stop_sequences" in body:
        chat["stop"] = body["stop_sequences"]
    chat["max_tokens"] = body["max_tokens"] if "max_tokens" in body else 4096
    for key in ("temperature", "top_p", "top_k", "stream", "chat_template_kwargs"):
        if key in body:
            chat[key] = body[key]
    if "thinking" in body:
        thinking = _value(body, "thinking", {})
        if _value(thinking, "type", "") == "enabled":
            chat["thinking_budget_tokens"] = _value(thinking, "budget_tokens", 10000)
    if "metadata" in body:
        user = _value(_value(body, "metadata", {}), "user_id", "")
        if user:
            chat["__metadata_user_id"] = user
    return chat


# -- OpenAI Responses ----------------------------------------------------------------------


def _is_str(item: Any, key: str) -> bool:
    return isinstance(item, dict) and isinstance(item.get(key), str)


def _is_list(item: Any, key: str) -> bool:
    return isinstance(item, dict) and isinstance(item.get(key), list)


def _input_message(item: dict[str, Any]) -> dict[str, Any]:
    content: list[dict[str, Any]] = []
    for part in item["content"]:
        kind = _value(part, "type", "")
        if kind == "input_text":
            if not isinstance(part, dict) or "text" not in part:
                raise NotConverted("'Input text' requires 'text'")
            content.append({"text": part["text"], "type": "text"})
        elif kind == "input_image":
            if not isinstance(part, dict) or "image_url" not in part:
                raise NotConverted("'image_url' is required")
            content.append({"image_url": {"url": part["image_url"]}, "type": "image_url"})
        else:
            raise NotConverted(f"input content of type {kind!r}")
    item = {k: v for k, v in item.items() if k not in ("type", "status")}
    item["content"] = content
    return item


def _output_content(item: dict[str, Any]) -> list[dict[str, Any]]:
    content = item.get("content")
    if isinstance(content, str):
        return [{"text": content, "type": "text"}]
    out: list[dict[str, Any]] = []
    if isinstance(content, list):
        for part in content:
            kind = _value(part, "type", "")
            if kind in ("output_text", "input_text"):
                if not _is_str(part, "text"):
                    raise NotConverted("'Output text' requires 'text'")
                out.append({"text": part["text"], "type": "text"})
            elif kind == "refusal":
                if not _is_str(part, "refusal"):
                    raise NotConverted("'Refusal' requires 'refusal'")
                out.append({"refusal": part["refusal"], "type": "refusal"})
            else:
                raise NotConverted(f"output content of type {kind!r}")
    return out


def _tool_output(item: dict[str, Any]) -> dict[str, Any]:
    output = item["output"]
    if isinstance(output, str):
        return {"content": output, "role": "tool", "tool_call_id": item["call_id"]}
    outputs = []
    for part in output:
        if not isinstance(part, dict) or "type" not in part:
            raise NotConverted("output of a tool call without 'type'")
        part = dict(part)
        if part["type"] == "input_text":
            part["type"] = "text"
        elif part["type"] == "input_image":
            if "image_url" not in part:
                raise NotConverted("'image_url' is required")
            part["type"] = "image_url"
            part["image_url"] = {"url": part["image_url"]}
        else:
            raise NotConverted("output of a tool call that is neither text nor image")
        outputs.append(part)
    return {"content": outputs, "role": "tool", "tool_call_id": item["call_id"]}


def _list_in(message: dict[str, Any], key: str) -> list[Any]:
    """``message[key]``, made an empty list first where it is not a list (as the engine does
    before merging into the assistant message before an item)."""
    if not isinstance(message.get(key), list):
        message[key] = []
    found: list[Any] = message[key]
    return found


def _responses_item(messages: list[dict[str, Any]], item: Any) -> None:
    """Add one input item to ``messages``, merged into the assistant message before it where
    the engine merges it."""
    merge = bool(messages) and messages[-1].get("role", "") == "assistant"
    if _is_str(item, "content"):
        item = {**item, "content": [{"text": item["content"], "type": "input_text"}]}
    if _is_list(item, "content") and _is_str(item, "role") and item["role"] in ("user", "system", "developer"):
        messages.append(_input_message(item))
    elif _is_str(item, "role") and item["role"] == "assistant" and _is_str(item, "type") and item["type"] == "message":
        content = _output_content(item)
        if merge:
            _list_in(messages[-1], "content").extend(content)
        else:
            message = {k: v for k, v in item.items() if k not in ("status", "type")}
            message["content"] = content
            messages.append(message)
    elif (all(_is_str(item, key) for key in ("arguments", "call_id", "name", "type"))
          and item["type"] == "function_call"):
        call = {"function": {"arguments": item["arguments"], "name": item["name"]},
                "id": item["call_id"], "type": "function"}
        if merge:
            _list_in(messages[-1], "tool_calls").append(call)
        else:
            messages.append({"role": "assistant", "tool_calls": [call]})
    elif (_is_str(item, "call_id") and (_is_str(item, "output") or _is_list(item, "output"))
          and _is_str(item, "type") and item["type"] == "function_call_output"):
        messages.append(_tool_output(item))
    elif _is_list(item, "summary") and _is_str(item, "type") and item["type"] == "reasoning":
        content = item.get("content")
        if not isinstance(content, list) or not content or not _is_str(content[0], "text"):
            raise NotConverted("a reasoning item without its text")
        if merge:
            messages[-1]["reasoning_content"] = content[0]["text"]
        else:
            messages.append({"role": "assistant", "content": [], "reasoning_content": content[0]["text"]})
    else:
        raise NotConverted("an input item of no known type")


def responses_as_chat(body: dict[str, Any]) -> dict[str, Any]:
    """The chat body llama-server makes of an OpenAI Responses body."""
    if "input" not in body:
        raise NotConverted("'input' is required")
    if _value(body, "previous_response_id", ""):
        raise NotConverted("'previous_response_id' is not supported")
    given = body["input"]
    chat = {k: v for k, v in body.items() if k != "input"}
    messages: list[dict[str, Any]] = []
    if "instructions" in body:
        messages.append({"role": "system", "content": _value(body, "instructions", "")})
        del chat["instructions"]
    if isinstance(given, str):
        messages.append({"role": "user", "content": given})
    elif isinstance(given, list):
        for item in given:
            _responses_item(messages, item)
    else:
        raise NotConverted("'input' must be a string or a list of items")
    chat["messages"] = messages
    if "tools" in body:
        if not isinstance(body["tools"], list):
            raise NotConverted("'tools' must be a list")
        tools = []
        for tool in body["tools"]:
            if _value(tool, "type", "") != "function":
                continue  # no chat equivalent: the engine skips it with a warning
            function = {k: v for k, v in tool.items() if k != "type"}
            function.setdefault("strict", True)
            tools.append({"type": "function", "function": function})
        del chat["tools"]
        if tools:
            chat["tools"] = tools
    if "max_output_tokens" in body:
        del chat["max_output_tokens"]
        chat["max_tokens"] = body["max_output_tokens"]
    if "reasoning" in body:
        reasoning = body["reasoning"]
        if isinstance(reasoning, dict) and "effort" in reasoning:
            chat["reasoning_effort"] = reasoning["effort"]
        del chat["reasoning"]
    return chat
