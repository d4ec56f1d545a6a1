"""What a conversation is made of, whatever API it came through: how it opens (:class:`Opening`).

Each API declares how its conversation opens and its prompt's units
(:class:`~strata_serve.api.registry.Api`: ``opening`` and ``prompt_units``); plugins ask
through :func:`strata_serve.opening` and :func:`strata_serve.prompt_units` with the
request (:mod:`strata_serve.api.prompts`). The helpers here read what the built-in APIs
share: messages with a role, content as text or as a list of typed parts.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

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


def text_key(text: str, media: Sequence[str] = ()) -> str:
    """The key of an opening message: the sha1 of its text, framed with its media when it has some."""
    if media:
        text = json.dumps({"user": text, "media": list(media)}, ensure_ascii=False)
    return hashlib.sha1(text.encode("utf-8")).hexdigest()[:16]


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


def opening_of(messages: list[Any], system: list[str]) -> Opening:
    """The opening of a list of messages (or Responses items), after the system prompt's ``system`` parts."""
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


def system_first(body: dict[str, Any], fields: tuple[str, ...]) -> list[Any]:
    """The prompt units a body's system prompt makes, one per field present (``{field: value}``)."""
    return [{name: body[name]} for name in fields if name in body]
