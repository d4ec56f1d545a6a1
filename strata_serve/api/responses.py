"""OpenAI's Responses API: ``/v1/responses``.

Its ``instructions`` are the system prompt and its ``input`` (a string, or items) the
conversation. A ``prompt_cache_key`` (Codex CLI sends its conversation's id there) says
which requests share a prompt: the built-in keying names the conversation by it.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from strata_serve.api.checks import ENGINE_MEDIA
from strata_serve.api.conversation import Opening, opening_of, system_first
from strata_serve.api.formats import ApiFormat, StreamSeen
from strata_serve.api.registry import Api
from strata_serve.api.schemas import ResponsesRequest
from strata_serve.engine.results import Timings, token_count


class ResponsesFormat(ApiFormat):
    """OpenAI's Responses API.

    A plain answer has only ``usage`` (``input_tokens`` counts the reused ones too, as
    ``input_tokens_details.cached_tokens``); a stream's ``response.completed`` event
    carries the engine's own numbers besides.
    """

    name = "responses"
    markers = (b'"response.completed"', b'"response.incomplete"', b'"response.failed"', b'"error"')

    def timings_from_usage(self, usage: Any) -> Timings | None:
        if not isinstance(usage, dict) or token_count(usage.get("input_tokens")) is None:
            return None
        details = usage.get("input_tokens_details")
        reused = token_count(details.get("cached_tokens")) if isinstance(details, dict) else None
        reused = min(reused or 0, usage["input_tokens"])
        return Timings(reused=reused, prefilled=usage["input_tokens"] - reused,
                       generated=token_count(usage.get("output_tokens")) or 0)

    def read_event(self, event: dict[str, Any], seen: StreamSeen) -> None:
        kind = event.get("type")
        seen.read_numbers(event)
        response = event.get("response")
        if isinstance(response, dict) and isinstance(response.get("usage"), dict):
            seen.usage = response["usage"]
        if kind in ("response.completed", "response.incomplete"):
            seen.finished = True
        elif kind in ("response.failed", "error"):
            seen.error = str(event.get("error") or event.get("message") or event)

    def done(self, data: bytes, seen: StreamSeen) -> bool:
        return data == b"[DONE]"

    def stream_error(self, message: str, kind: str) -> bytes:
        event = {"type": "error", "code": kind, "message": message, "param": None}
        return b"event: error\ndata: " + json.dumps(event).encode() + b"\n\n"


RESPONSES = ResponsesFormat()


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
    return hashlib.sha1(f"prompt_cache_key:{name}".encode()).hexdigest()[:16]


def responses_units(body: dict[str, Any]) -> list[Any]:
    units = system_first(body, ("instructions",))
    given = body.get("input")
    if isinstance(given, list):
        return units + given
    return units + [given] if isinstance(given, str) else units


RESPONSES_API = Api("/v1/responses", "OpenAI Responses API (stream with SSE or not)", schema=ResponsesRequest,
                    route="responses", format=RESPONSES, opening=responses_opening, given_key=cache_key,
                    prompt_units=responses_units, media=ENGINE_MEDIA,
                    generation_limit=("max_output_tokens", "n_predict"))

APIS = (RESPONSES_API,)
