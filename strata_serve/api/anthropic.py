"""Anthropic's Messages API: ``/v1/messages`` and ``/v1/messages/count_tokens``.

Errors on these paths, and beneath them, are answered in Anthropic's shape (its format's
:data:`ANTHROPIC_ERRORS`). The top-level ``system`` is the
system prompt; counting tokens renders the prompt and touches no slot, so it is
answered outside the FIFO.

Claude Code opens its system prompt with a billing line for Anthropic's servers
(``x-anthropic-billing-header: cc_version=2.1.197.0df; cc_entrypoint=cli;``) whose
fingerprint follows the first user message, and in some versions a nonce (``cch=``)
that changes with every request. It means nothing to a local model, and as the
prompt's first tokens it would end the engine's reuse of everything after it: a
Claude Code conversation restored after its compaction reused 55 of its 3,036 tokens.
Such lines are left out of the system prompt before the engine sees it.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel

from strata_serve.api.checks import ENGINE_MEDIA
from strata_serve.api.conversation import Opening, message_text, opening_of, system_first
from strata_serve.api.errors import APIError, ErrorShape
from strata_serve.api.formats import ApiFormat, StreamSeen
from strata_serve.api.registry import Api
from strata_serve.api.schemas import AnthropicCountTokensRequest, AnthropicMessagesRequest
from strata_serve.engine.results import Timings, token_count

#: Anthropic's error types (its SDK picks the exception class by status; the type names it).
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


class AnthropicErrorDetail(BaseModel):
    type: str
    message: str


class AnthropicErrorResponse(BaseModel):
    """Anthropic's error shape, in which every failure under ``/v1/messages`` is answered."""

    type: Literal["error"]
    error: AnthropicErrorDetail


def _anthropic_body(error: APIError) -> dict[str, Any]:
    kind = _ANTHROPIC_TYPES.get(error.status, "api_error" if error.status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": error.message}}


ANTHROPIC_ERRORS = ErrorShape("anthropic", _anthropic_body, AnthropicErrorResponse)


class AnthropicFormat(ApiFormat):
    """Anthropic's Messages API.

    The engine sends no numbers of its own here, only ``usage``: ``input_tokens`` (read anew),
    ``cache_read_input_tokens`` (reused) and ``output_tokens``. A stream gives the first
    two in ``message_start`` and the last in ``message_delta``, and ends with
    ``message_stop``.
    """

    name = "anthropic"
    errors = ANTHROPIC_ERRORS
    markers = (b'"usage"', b'"message_stop"', b'"error"')

    def timings_from_usage(self, usage: Any) -> Timings | None:
        """None until ``output_tokens`` is known: a stream cut after ``message_start``
        has the prompt's counts only, and the engine went on generating meanwhile."""
        if not isinstance(usage, dict):
            return None
        prompt, reused = token_count(usage.get("input_tokens")), token_count(usage.get("cache_read_input_tokens"))
        predicted = token_count(usage.get("output_tokens"))
        if (prompt is None and reused is None) or predicted is None:
            return None
        return Timings(reused=reused or 0, prefilled=prompt or 0, generated=predicted)

    def read_event(self, event: dict[str, Any], seen: StreamSeen) -> None:
        kind = event.get("type")
        seen.read_numbers(event)
        usage = event.get("usage")
        if kind == "message_start" and isinstance(event.get("message"), dict):
            usage = event["message"].get("usage")
            if isinstance(usage, dict):  # its output count (0) is not the answer's: message_delta's is
                usage = {name: value for name, value in usage.items() if name != "output_tokens"}
        if isinstance(usage, dict):
            seen.usage = {**(seen.usage or {}), **usage}  # message_delta adds output_tokens
        if kind == "message_stop":
            seen.finished = seen.ended = True  # its last event: no [DONE] follows
        elif kind == "error":
            seen.error = str(event.get("error"))

    done_markers = ()

    def done(self, data: bytes, seen: StreamSeen) -> bool:
        return False

    def stream_error(self, message: str, kind: str) -> bytes:
        kind = "overloaded_error" if kind == "service_unavailable" else "api_error"
        event = {"type": "error", "error": {"type": kind, "message": message}}
        return b"event: error\ndata: " + json.dumps(event).encode() + b"\n\n"


ANTHROPIC = AnthropicFormat()


def messages_opening(body: dict[str, Any]) -> Opening:
    system = body.get("system")
    return opening_of(body.get("messages") or [], [message_text(system)] if system else [])


def messages_units(body: dict[str, Any]) -> list[Any]:
    messages = body.get("messages")
    return system_first(body, ("system",)) + (list(messages) if isinstance(messages, list) else [])


#: How Claude Code's billing line begins.
BILLING_LINE = "x-anthropic-billing-header:"


def _without_billing(text: str) -> str:
    if BILLING_LINE not in text:
        return text
    return "\n".join(line for line in text.split("\n") if not line.startswith(BILLING_LINE))


def without_billing_lines(body: dict[str, Any]) -> dict[str, Any]:
    """``body`` with the billing lines left out of its ``system`` (a block left empty goes)."""
    system = body.get("system")
    if isinstance(system, str):
        body["system"] = _without_billing(system)
    elif isinstance(system, list):
        kept = []
        for block in system:
            if isinstance(block, dict) and block.get("type") == "text" and isinstance(block.get("text"), str):
                text = _without_billing(block["text"])
                if not text and block["text"]:
                    continue
                block = {**block, "text": text}
            kept.append(block)
        if kept:
            body["system"] = kept
        else:
            del body["system"]
    return body


MESSAGES = Api("/v1/messages", "Anthropic Messages API (stream with SSE or not)", schema=AnthropicMessagesRequest,
               route="messages", format=ANTHROPIC, opening=messages_opening, prompt_units=messages_units,
               media=ENGINE_MEDIA, prepare=without_billing_lines, generation_limit=("max_tokens",))
COUNT_TOKENS = Api("/v1/messages/count_tokens", "Anthropic token count (touches no slot)",
                   schema=AnthropicCountTokensRequest, format=ANTHROPIC, media=ENGINE_MEDIA,
                   prepare=without_billing_lines)

APIS = (MESSAGES, COUNT_TOKENS)
