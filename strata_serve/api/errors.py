"""Every error leaves the server in the shape of the API its route speaks.

Each API's format names its :class:`ErrorShape`: OpenAI's
(``{"error": {"message", "type", "param", "code"}}``, :data:`OPENAI_ERRORS`) for most,
Anthropic's on ``/v1/messages`` and beneath it, since Anthropic's clients read that one
(:mod:`strata_serve.api.anthropic`), a plugin's own on its API's paths. Handlers and
middlewares raise :class:`APIError`; the error middleware, the outermost, renders it in
the shape of the request's path (the server's registry of APIs, given to it, says which), so a refusal
made before any handler ran (a missing key, a web page's origin, a body that is not
JSON) is shaped the same way as one made by the handler.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any
from collections.abc import Callable

from aiohttp import web, web_protocol, web_server
from pydantic import BaseModel, ValidationError

log = logging.getLogger("strata_serve.api")

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    409: "conflict_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    502: "engine_error",
    503: "service_unavailable",
}


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | int | None


class ErrorResponse(BaseModel):
    """The OpenAI error shape every failure is answered in."""

    error: ErrorDetail


@dataclass(frozen=True)
class ErrorShape:
    """How an API tells a client of an error: the body it answers, and that body's schema.

    An API's format names its shape (``ApiFormat.errors``); every error on the API's
    paths, and on unknown paths beneath them, is answered in it.
    """

    #: What the shape is called (``openai``, ``anthropic``, a plugin's own).
    name: str
    #: The JSON body telling an :class:`APIError` (its ``status``, ``message``, ``param``,
    #: ``code``, ``type_``, ``extra``).
    body: Callable[[APIError], dict[str, Any]]
    #: The pydantic model of that body, for ``/openapi.json``.
    model: type[BaseModel]


def _openai_body(error: APIError) -> dict[str, Any]:
    kind = error.type_ or _TYPES.get(error.status, "server_error" if error.status >= 500 else "invalid_request_error")
    return {"error": {**(error.extra or {}), "message": error.message, "type": kind, "param": error.param,
                      "code": error.code}}


OPENAI_ERRORS = ErrorShape("openai", _openai_body, ErrorResponse)


def error_response(
    status: int,
    message: str,
    *,
    param: str | None = None,
    code: Any = None,
    headers: dict[str, str] | None = None,
    shape: ErrorShape = OPENAI_ERRORS,
) -> web.Response:
    return APIError(status, message, param=param, code=code, headers=headers).response(shape)


def validation_error(exc: ValidationError) -> APIError:
    first = exc.errors()[0]
    param = ".".join(str(p) for p in first["loc"]) or None
    problems = "; ".join(
        f"{'.'.join(str(p) for p in err['loc']) or 'body'}: {err['msg'].removeprefix('Value error, ')}"
        for err in exc.errors()[:5]
    )
    return APIError(400, f"invalid request: {problems}", param=param, code="invalid_value")


def validation_error_response(exc: ValidationError, shape: ErrorShape = OPENAI_ERRORS) -> web.Response:
    return validation_error(exc).response(shape)


class APIError(Exception):
    """Raised by handlers (and middlewares) to answer with an error in the route's shape.

    ``type_`` and ``extra`` carry what an engine said of its own error (its type, its
    numbers), kept in the OpenAI shape.
    """

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: Any = None, headers: dict[str, str] | None = None,
                 type_: str | None = None, extra: dict[str, Any] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers
        self.type_, self.extra = type_, extra

    def body(self, shape: ErrorShape = OPENAI_ERRORS) -> dict[str, Any]:
        return shape.body(self)

    def response(self, shape: ErrorShape = OPENAI_ERRORS) -> web.Response:
        return web.json_response(self.body(shape), status=self.status, headers=self.headers)


def error_middleware(shape_at: Callable[[str], ErrorShape]) -> Any:
    """The outermost middleware: every error leaves in the shape of the API at its path
    (``shape_at``: the server's registry's ``Apis.errors_at``)."""

    @web.middleware
    async def shaped(request: web.Request, handler: Any) -> web.StreamResponse:
        shape = shape_at(request.path)
        try:
            return await handler(request)
        except APIError as exc:
            return exc.response(shape)
        except ValidationError as exc:
            return validation_error_response(exc, shape)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            message = {
                404: f"no route {request.method} {request.path}",
                405: f"method {request.method} is not allowed on {request.path}",
                413: "request body too large",
            }.get(exc.status, exc.reason)
            headers = {k: v for k, v in exc.headers.items() if k.lower() == "allow"}
            return error_response(exc.status, message, headers=headers or None, shape=shape)
        except Exception:
            log.exception("[strata] unexpected error answering %s %s", request.method, request.path)
            return error_response(500, "internal error; see the server log", code="internal_error", shape=shape)

    return shaped


# -- bytes that are not an HTTP request --------------------------------------------------


def aiohttp_reason(exc: BaseException | None, fallback: str | None = None) -> str:
    """aiohttp's reason for an error in one line: its parser's message spans several, the
    first a bare status ("400, message:"), and its ``message`` holds the reason alone."""
    said = getattr(exc, "message", None) or fallback or (str(exc) if exc is not None else "") or "bad request"
    said = " ".join(str(said).split())
    return said if len(said) <= 300 else said[:297] + "..."


class _ShapedErrorHandler(web_protocol.RequestHandler):
    """aiohttp's connection handler, its own refusals (a header with a control character,
    headers past 8 KB, both ``Content-Length`` and ``Transfer-Encoding``) in the OpenAI
    error shape instead of plain text. They come before any route or middleware: there is
    no request, no path, to choose another shape by."""

    __slots__ = ()

    def handle_error(self, request: Any, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        response = super().handle_error(request, status, exc, message)  # logs it; raises if sent
        if status >= 500:
            return response
        shaped = error_response(status, f"malformed HTTP request: {aiohttp_reason(exc, message)}",
                                code="malformed_http")
        shaped.force_close()
        return shaped


class _ShapedErrorServer(web_server.Server):
    def __call__(self) -> web_protocol.RequestHandler:
        handler = super().__call__()
        if type(handler) is web_protocol.RequestHandler:
            handler.__class__ = _ShapedErrorHandler
        return handler


def shape_protocol_errors(app: web.Application) -> None:
    """Give ``app``'s server (whichever runner makes it: ``strata-serve run``'s, a test's)
    connection handlers that refuse malformed HTTP in the OpenAI shape. An aiohttp whose
    server is not the one known here keeps its plain-text refusals."""
    make = app._make_handler

    def make_handler(**kwargs: Any) -> web_server.Server:
        server = make(**kwargs)
        if type(server) is web_server.Server:
            server.__class__ = _ShapedErrorServer
        return server

    app._make_handler = make_handler  # type: ignore[method-assign]
