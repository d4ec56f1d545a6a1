"""system_prompt_key: the system prompt and the first user message name the conversation.

The built-in key hashes the first user message alone, so a client that edits its
system prompt keeps the old key, and the new conversation would be parked over the
old one. This key hashes both, so an edited system prompt starts a new conversation.

The system prompt is every ``system`` or ``developer`` message before the first user
message; on Anthropic's Messages API, its top-level ``system``; on the Responses API,
``instructions`` and the system and developer items before the first user one. Without
one the plugin defers, so the built-in key (the same hash of the first user message)
still names those conversations, and their files stay valid. Images and files in the
first user message count, as in the built-in key.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import strata_serve
from strata_serve import StrataRequest, opening

NAME = "system_prompt_key"
#: The plugin's name when registered by hand (tests); the entry point gives the same.
strata_name = NAME


@strata_serve.hookimpl
def conversation_key(request: StrataRequest) -> str | None:
    start = opening(request)
    if start is None or (start.user is None and not start.media) or not any(start.system):
        return None
    # JSON keeps the parts apart: ("ab", "c") and ("a", "bc") must not hash alike.
    framed_parts: dict[str, Any] = {"system": start.system, "user": start.user}
    if start.media:  # text-only openings keep the key they always had
        framed_parts["media"] = start.media
    framed = json.dumps(framed_parts, ensure_ascii=False)
    return hashlib.sha1(framed.encode("utf-8")).hexdigest()[:16]
