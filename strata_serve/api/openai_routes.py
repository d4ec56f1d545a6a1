"""The OpenAI routes: chat, completions, the Responses API, embeddings and the model list."""

from __future__ import annotations

from aiohttp import web

from strata_serve.api.formats import RESPONSES
from strata_serve.api.relay import direct, read_json, relay
from strata_serve.api.schemas import (ChatCompletionRequest, CompletionRequest, EmbeddingsRequest,
                                      ResponsesRequest)

routes = web.RouteTableDef()


@routes.post("/v1/chat/completions")
async def chat_completions(request: web.Request) -> web.StreamResponse:
    body = await read_json(request, ChatCompletionRequest)
    return await relay(request, "chat", "/v1/chat/completions", body)


@routes.post("/v1/completions")
async def completions(request: web.Request) -> web.StreamResponse:
    body = await read_json(request, CompletionRequest)
    return await relay(request, "completion", "/v1/completions", body)


@routes.get("/v1/models")
async def models(request: web.Request) -> web.Response:
    return await direct(request, "GET", "/v1/models")


@routes.post("/v1/responses")
async def responses(request: web.Request) -> web.StreamResponse:
    body = await read_json(request, ResponsesRequest)
    return await relay(request, "responses", "/v1/responses", body, api=RESPONSES)


@routes.post("/v1/embeddings")
async def embeddings(request: web.Request) -> web.StreamResponse:
    # Through the FIFO: the engine computes embeddings in the slot, over what it held
    # (auto-sessions parks that first). Never keyed: no conversation is left in the slot.
    body = await read_json(request, EmbeddingsRequest)
    return await relay(request, "embeddings", "/v1/embeddings", body, keyed=False)
