"""Anthropic's Messages API: ``/v1/messages`` and ``/v1/messages/count_tokens``.

Errors on these paths are answered in Anthropic's shape (see :mod:`strata_serve.api.errors`).

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

from aiohttp import web

from strata_serve.api.formats import ANTHROPIC
from strata_serve.api.relay import direct, read_json, relay
from strata_serve.api.schemas import AnthropicCountTokensRequest, AnthropicMessagesRequest

routes = web.RouteTableDef()


@routes.post("/v1/messages")
async def messages(request: web.Request) -> web.StreamResponse:
    body = without_billing_lines(await read_json(request, AnthropicMessagesRequest))
    return await relay(request, "messages", "/v1/messages", body, api=ANTHROPIC)


@routes.post("/v1/messages/count_tokens")
async def count_tokens(request: web.Request) -> web.Response:
    # The engine renders the prompt and counts it, touching no slot: outside the FIFO.
    body = without_billing_lines(await read_json(request, AnthropicCountTokensRequest))
    return await direct(request, "POST", "/v1/messages/count_tokens", body)


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
