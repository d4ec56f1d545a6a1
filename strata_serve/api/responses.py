"""OpenAI's Responses API: ``/v1/responses``.

Its ``instructions`` are the system prompt and its ``input`` (a string, or items) the
conversation. A ``prompt_cache_key`` (Codex CLI sends its conversation's id there) says
which requests share a prompt: the built-in keying names the conversation by it.
"""

from __future__ import annotations

import hashlib
from typing import Any

from strata_serve.api.checks import ENGINE_MEDIA
from strata_serve.api.conversation import Opening, opening_of, system_first
from strata_serve.api.formats import RESPONSES
from strata_serve.api.registry import Api
from strata_serve.api.schemas import ResponsesRequest


def responses_opening(body: dict[str, Any]) -> Opening:
    instructions = body.get("instructions")
    parts = [instructions] if isinstance(instructions, str) and instructions else []
    given = body.get("input")
    if isinstance(given, str):
        return Opening(parts, given or None)
    return opening_of(given if isinstance(given, list) else [], parts)


def cache_key(body: dict[str, Any]) -> str | None:
    """The key a ``prompt_cache_key`` gives: that name's hash."""
    name = body.get("prompt_cache_key")
    if not isinstance(name, str) or not name:
        return None
    return hashlib.sha1(f"prompt_cache_key:{name}".encode("utf-8")).hexdigest()[:16]


def responses_units(body: dict[str, Any]) -> list[Any]:
    units = system_first(body, ("instructions",))
    given = body.get("input")
    if isinstance(given, list):
        return units + given
    return units + [given] if isinstance(given, str) else units


RESPONSES_API = Api("/v1/responses", "OpenAI Responses API (stream with SSE or not)", schema=ResponsesRequest,
                    route="responses", format=RESPONSES, opening=responses_opening, given_key=cache_key,
                    prompt_units=responses_units, media=ENGINE_MEDIA)

APIS = (RESPONSES_API,)
