"""A request's prompt as one text, the way llama-server renders it before tokenizing."""

from __future__ import annotations

from typing import Any
from collections.abc import Awaitable, Callable

from strata_serve.engine.llama_server.answers import error_message
from strata_serve.engine.llama_server.chat_bodies import NotConverted, anthropic_as_chat, responses_as_chat
from strata_serve.engine.results import EngineError

#: Paths whose prompt is a chat's messages, rendered by the engine's chat template.
CHAT_PATHS = frozenset({"/v1/chat/completions", "/chat/completions"})
#: Paths whose body llama-server converts to a chat before rendering it (chat_bodies.py).
CONVERTED = {"/v1/messages": anthropic_as_chat, "/v1/responses": responses_as_chat, "/responses": responses_as_chat}
#: Paths whose prompt is given as text.
TEXT_PATHS = frozenset({"/v1/completions", "/completions", "/completion"})

Call = Callable[..., Awaitable[tuple[int, Any]]]


def _has_media(messages: list[Any]) -> bool:
    """Whether a message carries anything but text (its tokens are not the text's)."""
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list) and any(not isinstance(part, dict) or part.get("type") != "text"
                                             for part in content):
            return True
    return False


async def prompt_text(path: str, body: dict[str, Any], call: Call) -> str | None:
    """The text llama-server tokenizes for ``body`` sent to ``path``: a chat rendered by
    ``/apply-template`` (the very parsing ``/v1/chat/completions`` does), an Anthropic or
    Responses body converted to its chat first (as the engine converts it), a completion's
    prompt as given; None for media, a prompt that is not one text, a body the engine would
    refuse, and other paths.

    :raises EngineError: the engine refused to render the chat.
    """
    convert = CONVERTED.get(path)
    if convert is not None:
        try:
            body = convert(body)
        except NotConverted:
            return None
        path = "/v1/chat/completions"
    if path in CHAT_PATHS:
        messages = body.get("messages")
        if not isinstance(messages, list) or _has_media(messages):
            return None
        status, answer = await call("POST", "/apply-template", body, op="apply_template")
        prompt = answer.get("prompt") if status == 200 and isinstance(answer, dict) else None
        if not isinstance(prompt, str):
            raise EngineError(op="apply_template", message=error_message(answer), status=status, body=answer)
        return prompt
    if path in TEXT_PATHS:
        prompt = body.get("prompt")
        return prompt if isinstance(prompt, str) else None
    return None
