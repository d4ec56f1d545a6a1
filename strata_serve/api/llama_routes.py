"""The engine's own routes: ``/infill``, ``/tokenize``, ``/detokenize``, ``/apply-template``, ``/props``.

``/infill`` generates in the slot, so it goes through the FIFO like a chat; the others
read the model's vocabulary and settings only and are answered outside it
(:func:`~strata_serve.api.relay.direct` says why).
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from strata_serve.api.errors import APIError
from strata_serve.api.formats import LLAMA
from strata_serve.api.relay import direct, read_json, relay, service_errors, service_of
from strata_serve.api.schemas import (ApplyTemplateRequest, DetokenizeRequest, InfillRequest,
                                      TokenizeRequest)

routes = web.RouteTableDef()


@routes.post("/infill")
async def infill(request: web.Request) -> web.StreamResponse:
    body = await read_json(request, InfillRequest)
    return await relay(request, "infill", "/infill", body, api=LLAMA)


@routes.post("/tokenize")
async def tokenize(request: web.Request) -> web.Response:
    return await direct(request, "POST", "/tokenize", await read_json(request, TokenizeRequest))


@routes.post("/detokenize")
async def detokenize(request: web.Request) -> web.Response:
    body = await read_json(request, DetokenizeRequest)
    tokens = body.get("tokens") or []
    if tokens:
        # The engine looks each id up unchecked and answers an unknown one with a 500.
        n_vocab = await _vocabulary_size(request)
        if n_vocab is not None:
            for n, token in enumerate(tokens):
                if token >= n_vocab:
                    raise APIError(400, f"tokens.{n}: {token} is not a token id of this model "
                                   f"(its vocabulary has {n_vocab})", param=f"tokens.{n}", code="invalid_value")
    return await direct(request, "POST", "/detokenize", body)


@routes.post("/apply-template")
async def apply_template(request: web.Request) -> web.Response:
    return await direct(request, "POST", "/apply-template", await read_json(request, ApplyTemplateRequest))


@routes.get("/props")
async def props(request: web.Request) -> web.Response:
    # GET only: POST /props changes the engine's settings for every client.
    return await direct(request, "GET", "/props")


async def _vocabulary_size(request: web.Request) -> int | None:
    """The model's vocabulary size, from the engine's model list (None: it does not say)."""
    service = service_of(request)
    with service_errors(service):
        status, answer = await service.engine.request("GET", "/v1/models", op="models")
    models: Any = answer.get("data") if status == 200 and isinstance(answer, dict) else None
    if isinstance(models, list) and models and isinstance(models[0], dict):
        meta = models[0].get("meta")
        if isinstance(meta, dict) and isinstance(meta.get("n_vocab"), int):
            return meta["n_vocab"]
    return None
