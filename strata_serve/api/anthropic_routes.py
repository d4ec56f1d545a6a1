"""Anthropic's Messages API: ``/v1/messages`` and ``/v1/messages/count_tokens``.

Errors on these paths are answered in Anthropic's shape (see :mod:`strata_serve.api.errors`).
"""

from __future__ import annotations

from aiohttp import web

from strata_serve.api.formats import ANTHROPIC
from strata_serve.api.relay import direct, read_json, relay
from strata_serve.api.schemas import AnthropicCountTokensRequest, AnthropicMessagesRequest

routes = web.RouteTableDef()


@routes.post("/v1/messages")
async def messages(request: web.Request) -> web.StreamResponse:
    body = await read_json(request, AnthropicMessagesRequest)
    return await relay(request, "messages", "/v1/messages", body, api=ANTHROPIC)


@routes.post("/v1/messages/count_tokens")
async def count_tokens(request: web.Request) -> web.Response:
    # The engine renders the prompt and counts it, touching no slot: outside the FIFO.
    body = await read_json(request, AnthropicCountTokensRequest)
    return await direct(request, "POST", "/v1/messages/count_tokens", body)
