"""system_prompt_key: the system prompt and the first user message name the conversation.

The built-in key hashes the first user message alone, so a client that edits its
system prompt keeps the old key, and the new conversation would be parked over the
old one. This key hashes both, so an edited system prompt starts a new conversation.

The system prompt is every ``system`` or ``developer`` message before the first user
message. Without one the plugin defers, so the built-in key (the same hash of the
first user message) still names those conversations, and their files stay valid.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import strata_serve
from strata_serve import message_text
from strata_serve import StrataRequest

NAME = "system_prompt_key"
#: The plugin's name when registered by hand (tests); the entry point gives the same.
strata_name = NAME

SYSTEM_ROLES = frozenset({"system", "developer"})


def opening(messages: list[Any]) -> tuple[list[str], str | None]:
    """The system prompt's parts and the first user message's text (None without one)."""
    system = []
    for message in messages:
        if not isinstance(message, dict):
            continue
        if message.get("role") == "user":
            return system, message_text(message.get("content")) or None
        if message.get("role") in SYSTEM_ROLES:
            system.append(message_text(message.get("content")))
    return system, None


@strata_serve.hookimpl
def conversation_key(request: StrataRequest) -> str | None:
    if request.route != "chat":
        return None
    system, user = opening(request.body.get("messages") or [])
    if user is None or not any(system):
        return None
    # JSON keeps the parts apart: ("ab", "c") and ("a", "bc") must not hash alike.
    framed = json.dumps({"system": system, "user": user}, ensure_ascii=False)
    return hashlib.sha1(framed.encode("utf-8")).hexdigest()[:16]
