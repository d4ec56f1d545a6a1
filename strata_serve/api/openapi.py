"""``GET /openapi.json``: the API described from the same pydantic models that validate it."""

from __future__ import annotations

from typing import Any
from collections.abc import Iterable

from aiohttp import web
from pydantic import BaseModel

from strata_serve import __version__
from strata_serve.api.app_state import APIS, SERVICE
from strata_serve.api.anthropic import AnthropicErrorResponse
from strata_serve.api.openai import MODEL_PATH, MODELS
from strata_serve.api.errors import OPENAI_ERRORS, ErrorResponse
from strata_serve.api.builtin import builtin
from strata_serve.api.registry import Apis
from strata_serve.api.schemas import SlotFile

__all__ = ["AnthropicErrorResponse", "ErrorResponse", "build", "openapi"]

_ERRORS = {"400", "401", "403", "404", "405", "408", "409", "413", "415", "502", "503"}


def _json(ref: str) -> dict[str, Any]:
    return {"content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{ref}"}}}}


def _operation(summary: str, body: str | None = None, ok: str = "the engine's answer",
               params: list[dict[str, Any]] | None = None, error: str = "ErrorResponse") -> dict[str, Any]:
    operation: dict[str, Any] = {
        "summary": summary,
        "responses": {"200": {"description": ok}} | {
            code: {"description": "error", **_json(error)} for code in sorted(_ERRORS)
        },
    }
    if body:
        operation["requestBody"] = {"required": True, **_json(body)}
    if params:
        operation["parameters"] = params
    return operation


def _core_paths(slots: int) -> dict[str, Any]:
    """The core's own routes: health, the slots by hand, this document."""
    action = [{"name": "action", "in": "query", "required": True,
               "schema": {"type": "string", "enum": ["save", "restore", "erase"]}}]
    slot_id = [{"name": "slot_id", "in": "path", "required": True,
                "schema": {"type": "string", "enum": [str(n) for n in range(max(1, slots))]}}]
    return {
        "/health": {"get": _operation("200 when the engine answers", ok="healthy")},
        "/slots": {"get": _operation("The engine's slots")},
        "/slots/{slot_id}": {"post": _operation("Save, restore or erase a slot's state (body for save/restore)",
                                                "SlotFile", params=action + slot_id)},
        "/openapi.json": {"get": _operation("This document", ok="the OpenAPI document")},
    }


def build(extra_paths: Iterable[tuple[str, str]] = (), served: frozenset[str] | None = None,
          slots: int = 1, apis: Apis | None = None) -> dict[str, Any]:
    """The OpenAPI 3.1 document of ``apis`` (the built-in ones unless given) and the core's
    routes; ``extra_paths`` are plugin routes as ``(method, path)``; ``served``: the engine's
    paths the backend serves (None: all); ``slots``: the engine's."""
    apis = apis if apis is not None else builtin()
    described = [api for api in apis if served is None or api.engine_path in served]
    models: list[type[BaseModel]] = [api.schema for api in apis if api.schema is not None]
    models += [SlotFile, ErrorResponse, *(api.errors.model for api in apis if api.errors is not OPENAI_ERRORS)]
    schemas: dict[str, Any] = {}
    for model in dict.fromkeys(models):
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
        schemas.update(schema.pop("$defs", {}))
        schemas[model.__name__] = schema
    paths: dict[str, Any] = {}
    for api in described:
        body = api.schema.__name__ if api.schema is not None else None
        paths.setdefault(api.path, {})[api.method.lower()] = _operation(api.summary, body,
                                                                        error=api.errors.model.__name__)
        if api is MODELS:
            model_id = [{"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}]
            paths[MODEL_PATH] = {"get": _operation("One of the engine's models, by its id", ok="the model",
                                                   params=model_id)}
    paths.update(_core_paths(slots))
    for method, path in extra_paths:
        paths.setdefault(path, {})[method.lower()] = _operation("Added by a plugin", ok="the plugin's answer")
    return {
        "openapi": "3.1.0",
        "info": {"title": "strata-serve", "version": __version__},
        "paths": paths,
        "components": {
            "schemas": schemas,
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
    }


async def openapi(request: web.Request) -> web.Response:
    apis = request.app[APIS]
    known = {api.path for api in apis} | set(_core_paths(1)) | {MODEL_PATH}
    extra = sorted(
        (route.method, route.resource.canonical)
        for route in request.app.router.routes()
        if route.resource is not None and route.resource.canonical not in known and route.method != "HEAD"
    )
    engine = request.app[SERVICE].engine
    return web.json_response(build(extra, served=getattr(engine, "routes", None), slots=engine.info.parallel,
                                   apis=apis))
