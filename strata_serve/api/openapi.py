"""``GET /openapi.json``: the API described from the same pydantic models that validate it."""

from __future__ import annotations

from typing import Any, Literal

from aiohttp import web
from pydantic import BaseModel

from strata_serve import __version__
from strata_serve.api.app_state import SERVICE
from strata_serve.engine.base import ENGINE_ROUTES
from strata_serve.api.schemas import (AnthropicCountTokensRequest, AnthropicMessagesRequest, ApplyTemplateRequest,
                                      ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                      EmbeddingsRequest, InfillRequest, ResponsesRequest, SlotFile,
                                      TokenizeRequest)


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | int | None


class ErrorResponse(BaseModel):
    """The OpenAI error shape every failure is answered in."""

    error: ErrorDetail


class AnthropicErrorDetail(BaseModel):
    type: str
    message: str


class AnthropicErrorResponse(BaseModel):
    """Anthropic's error shape, in which every failure under ``/v1/messages`` is answered."""

    type: Literal["error"]
    error: AnthropicErrorDetail


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


def build(extra_paths: list[tuple[str, str]] = (), served: frozenset[str] | None = None,
          slots: int = 1) -> dict[str, Any]:
    """The OpenAPI 3.1 document; ``extra_paths`` are plugin routes as ``(method, path)``;
    ``served``: the engine routes the backend serves (None: all); ``slots``: the engine's."""
    models = [ChatCompletionRequest, CompletionRequest, ResponsesRequest, EmbeddingsRequest,
              AnthropicMessagesRequest, AnthropicCountTokensRequest, InfillRequest, TokenizeRequest,
              DetokenizeRequest, ApplyTemplateRequest, SlotFile, ErrorResponse, AnthropicErrorResponse]
    schemas: dict[str, Any] = {}
    for model in models:
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
        schemas.update(schema.pop("$defs", {}))
        schemas[model.__name__] = schema
    action = [{"name": "action", "in": "query", "required": True,
               "schema": {"type": "string", "enum": ["save", "restore", "erase"]}}]
    slot_id = [{"name": "slot_id", "in": "path", "required": True,
                "schema": {"type": "string", "enum": [str(n) for n in range(max(1, slots))]}}]
    paths: dict[str, Any] = {
        "/v1/chat/completions": {"post": _operation("Chat completion (stream with SSE or not)",
                                                    "ChatCompletionRequest")},
        "/v1/completions": {"post": _operation("Text completion", "CompletionRequest")},
        "/v1/responses": {"post": _operation("OpenAI Responses API (stream with SSE or not)", "ResponsesRequest")},
        "/v1/embeddings": {"post": _operation("Embeddings (the engine started with --embeddings)",
                                              "EmbeddingsRequest")},
        "/v1/messages": {"post": _operation("Anthropic Messages API (stream with SSE or not)",
                                            "AnthropicMessagesRequest", error="AnthropicErrorResponse")},
        "/v1/messages/count_tokens": {"post": _operation("Anthropic token count (touches no slot)",
                                                         "AnthropicCountTokensRequest",
                                                         error="AnthropicErrorResponse")},
        "/infill": {"post": _operation("Code infill (fill in the middle; stream with SSE or not)", "InfillRequest")},
        "/tokenize": {"post": _operation("Text to token ids (touches no slot)", "TokenizeRequest")},
        "/detokenize": {"post": _operation("Token ids to text (touches no slot)", "DetokenizeRequest")},
        "/apply-template": {"post": _operation("The prompt the chat template makes (touches no slot)",
                                               "ApplyTemplateRequest")},
        "/props": {"get": _operation("The engine's properties")},
        "/v1/models": {"get": _operation("The engine's models")},
        "/health": {"get": _operation("200 when the engine answers", ok="healthy")},
        "/slots": {"get": _operation("The engine's slots")},
        "/slots/{slot_id}": {"post": _operation("Save, restore or erase a slot's state (body for save/restore)",
                                                "SlotFile", params=action + slot_id)},
        "/openapi.json": {"get": _operation("This document", ok="the OpenAPI document")},
    }
    if served is not None:  # a backend's routes: the others answer 404 not_supported
        paths = {path: value for path, value in paths.items() if path not in ENGINE_ROUTES or path in served}
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
    built_in = set(build()["paths"])
    extra = sorted(
        (route.method, route.resource.canonical)
        for route in request.app.router.routes()
        if route.resource is not None and route.resource.canonical not in built_in and route.method != "HEAD"
    )
    engine = request.app[SERVICE].engine
    return web.json_response(build(extra, served=getattr(engine, "routes", None), slots=engine.info.parallel))
