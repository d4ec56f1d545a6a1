"""The default conversation key: the first user message names the conversation.

A heuristic: clients that keep their opening message fixed (chat UIs, most agents)
get one key per conversation. Plugins that know better register their own
``conversation_key`` and win, since this one runs last.
"""

from __future__ import annotations

import hashlib
from typing import Any

import strata_serve
from strata_serve.exchange import StrataRequest


def message_text(content: Any) -> str:
    """The text of a message's ``content``: a string, or the text parts of a list."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            part.get("text", "")
            for part in content
            if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)
        )
    return ""


def first_user_text(body: dict[str, Any]) -> str | None:
    for message in body.get("messages") or []:
        if isinstance(message, dict) and message.get("role") == "user":
            return message_text(message.get("content")) or None
    return None


@strata_serve.hookimpl(trylast=True)
def conversation_key(request: StrataRequest) -> str | None:
    if request.route != "chat":
        return None
    text = first_user_text(request.body)
    if text is None:
        return None
    return hashlib.sha1(text.encode("utf-8")).hexdigest()[:16]
