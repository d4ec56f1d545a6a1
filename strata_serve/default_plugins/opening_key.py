"""The default conversation key: the first user message names the conversation.

A heuristic: clients that keep their opening message fixed (chat UIs, most agents)
get one key per conversation. Plugins that know better register their own
``conversation_key`` and win, since this one runs last.

Every API that holds a conversation is understood (:func:`opening`): OpenAI chat
(``messages``), Anthropic's Messages API (top-level ``system``, content blocks) and the
Responses API (``instructions``, and ``input`` as a string or as items). Images, audio
and files in the first user message count too: two conversations that open with the
same words and different pictures get different keys. A first user message of text
alone keeps the key it always had (the sha1 of its text), so existing session files
stay valid.

Other routes:

- ``responses`` with a ``prompt_cache_key`` (Codex CLI sends its conversation's id
  there): the key is that name's hash, since the client said which requests share a
  prompt;
- ``infill``: one conversation, ``infill``. An editor's completions are many small
  requests over the same files; keyed, auto-sessions parks the editor's state when a
  chat takes the slot and brings it back for the next completion (when it is worth a
  file), where unkeyed requests would have it read anew each time;
- ``completion`` (a bare prompt) is not keyed; ``embeddings`` never is (the core does
  not ask: no conversation is left in the slot).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

import strata_serve
from strata_serve.hook_types import StrataRequest

#: The key every ``/infill`` request gets from this plugin.
INFILL_KEY = "infill"
SYSTEM_ROLES = frozenset({"system", "developer"})
#: Content parts whose text is the message's text, in any of the APIs.
_TEXT_PARTS = frozenset({"text", "input_text", "output_text"})


@dataclass
class Opening:
    """How a conversation opens, whatever API it came through."""

    #: The system prompt's parts: system (and developer) messages before the first user
    #: message, Anthropic's ``system``, the Responses API's ``instructions``.
    system: list[str] = field(default_factory=list)
    #: The first user message's text; None without a user message.
    user: str | None = None
    #: A digest of each image, audio clip or file in the first user message, in order.
    media: list[str] = field(default_factory=list)


def message_text(content: Any) -> str:
    """The text of a message's ``content``: a string, or the text parts (blocks) of a list."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            part.get("text", "")
            for part in content
            if isinstance(part, dict) and part.get("type") in _TEXT_PARTS and isinstance(part.get("text"), str)
        )
    return ""


def _media_identity(part: dict[str, Any]) -> Any:
    """What names the medium in a content part (its bytes or its address), or None for text."""
    kind = part.get("type")
    if kind == "image_url":  # OpenAI chat: {"image_url": {"url": ...}}
        image = part.get("image_url")
        return image.get("url") if isinstance(image, dict) else image
    if kind == "input_audio":
        return part.get("input_audio")
    if kind in ("image", "document"):  # Anthropic: {"source": {"type": "base64", "data": ...}}
        return part.get("source")
    if kind in ("input_image", "input_file", "file"):  # Responses; chat's "file" part
        return {k: v for k, v in part.items() if k not in ("type", "detail", "cache_control")}
    return None


def message_media(content: Any) -> list[str]:
    """A digest of each image, audio clip or file in a message's content parts."""
    if not isinstance(content, list):
        return []
    digests = []
    for part in content:
        if isinstance(part, dict):
            identity = _media_identity(part)
            if identity is not None:
                data = json.dumps(identity, sort_keys=True, ensure_ascii=False)
                digests.append(hashlib.sha1(data.encode("utf-8")).hexdigest()[:16])
    return digests


def _opening_of(messages: list[Any], system: list[str]) -> Opening:
    for message in messages:
        if not isinstance(message, dict) or message.get("type") not in (None, "message"):
            continue  # Responses' tool calls and outputs, reasoning items
        role = message.get("role")
        if role == "user":
            content = message.get("content")
            return Opening(system, message_text(content) or None, message_media(content))
        if role in SYSTEM_ROLES:
            system.append(message_text(message.get("content")))
    return Opening(system)


def opening(route: str, body: dict[str, Any]) -> Opening | None:
    """How the conversation of a request on ``route`` opens; None for routes without one."""
    if route == "chat":
        return _opening_of(body.get("messages") or [], [])
    if route == "messages":
        system = body.get("system")
        parts = [message_text(system)] if system else []
        return _opening_of(body.get("messages") or [], parts)
    if route == "responses":
        instructions = body.get("instructions")
        parts = [instructions] if isinstance(instructions, str) and instructions else []
        given = body.get("input")
        if isinstance(given, str):
            return Opening(parts, given or None)
        return _opening_of(given if isinstance(given, list) else [], parts)
    return None


def text_key(text: str, media: list[str] = ()) -> str:
    """The key of an opening message: the sha1 of its text, framed with its media when it has some."""
    if media:
        text = json.dumps({"user": text, "media": list(media)}, ensure_ascii=False)
    return hashlib.sha1(text.encode("utf-8")).hexdigest()[:16]


@strata_serve.hookimpl(trylast=True)
def conversation_key(request: StrataRequest) -> str | None:
    if request.route == "infill":
        return INFILL_KEY
    cache_key = request.body.get("prompt_cache_key")
    if request.route == "responses" and isinstance(cache_key, str) and cache_key:
        return hashlib.sha1(f"prompt_cache_key:{cache_key}".encode("utf-8")).hexdigest()[:16]
    start = opening(request.route, request.body)
    if start is None or (start.user is None and not start.media):
        return None
    return text_key(start.user or "", start.media)
