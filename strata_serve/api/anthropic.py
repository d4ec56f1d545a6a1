"""Anthropic's Messages API: ``/v1/messages`` and ``/v1/messages/count_tokens``.

Errors on these paths, and beneath them, are answered in Anthropic's shape (its format's
:data:`~strata_serve.api.errors.ANTHROPIC_ERRORS`). The top-level ``system`` is the
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

from typing import Any

from strata_serve.api.checks import ENGINE_MEDIA
from strata_serve.api.conversation import Opening, message_text, opening_of, system_first
from strata_serve.api.formats import ANTHROPIC
from strata_serve.api.registry import Api
from strata_serve.api.schemas import AnthropicCountTokensRequest, AnthropicMessagesRequest


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
               media=ENGINE_MEDIA, prepare=without_billing_lines)
COUNT_TOKENS = Api("/v1/messages/count_tokens", "Anthropic token count (touches no slot)",
                   schema=AnthropicCountTokensRequest, format=ANTHROPIC, media=ENGINE_MEDIA,
                   prepare=without_billing_lines)

APIS = (MESSAGES, COUNT_TOKENS)
