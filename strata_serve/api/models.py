"""``GET /v1/models/{model}``: one model of the engine's list, by its id (the OpenAI SDKs'
``models.retrieve``). The engine has no such route: its list is asked, outside the FIFO."""

from __future__ import annotations

from aiohttp import web

from strata_serve.api.errors import APIError
from strata_serve.api.openai import MODELS
from strata_serve.api.relay import ask_directly, engine_answer


async def retrieve_model(request: web.Request) -> web.Response:
    """One entry of the engine's model list, as OpenAI answers ``GET /v1/models/{model}``;
    404 ``model_not_found`` when no entry has that id."""
    wanted = request.match_info["model"]
    status, listed = await ask_directly(request, "GET", MODELS.engine_path)
    if status >= 400:
        return engine_answer(status, listed)  # raises the engine's refusal
    models = listed.get("data") if isinstance(listed, dict) else None
    for model in models if isinstance(models, list) else []:
        if isinstance(model, dict) and model.get("id") == wanted:
            return web.json_response(model)
    raise APIError(404, f"the model {wanted!r} does not exist: GET {MODELS.path} lists what this server serves",
                   param="model", code="model_not_found")
