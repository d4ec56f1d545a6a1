"""Every error leaves the server in the shape of the API its route speaks.

OpenAI's shape (``{"error": {"message", "type", "param", "code"}}``) everywhere but
under ``/v1/messages``, which answers in Anthropic's
(``{"type": "error", "error": {"type", "message"}}``), since Anthropic's clients read
that one. Handlers and middlewares raise :class:`APIError`; the error middleware, the
outermost, renders it in the shape of the request's path, so a refusal made before any
handler ran (a missing key, a web page's origin, a body that is not JSON) is shaped the
same way as one made by the handler.
"""

from __future__ import annotations

import logging
from typing import Any, Literal

from aiohttp import web
from pydantic import ValidationError

log = logging.getLogger("strata_serve.api")

ErrorShape = Literal["openai", "anthropic"]

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
#: Path prefixes whose errors take another shape than OpenAI's.
_SHAPES: tuple[tuple[str, ErrorShape], ...] = (("/v1/messages", "anthropic"),)


def shape_of(path: str) -> ErrorShape:
    """The error shape of the API served at ``path`` (unknown paths under a prefix too)."""
    for prefix, shape in _SHAPES:
        if path == prefix or path.startswith(prefix + "/"):
            return shape
    return "openai"


def error_body(status: int, message: str, *, param: str | None = None, code: Any = None,
               type_: str | None = None, extra: dict[str, Any] | None = None,
               shape: ErrorShape = "openai") -> dict[str, Any]:
    if shape == "anthropic":
        kind = _ANTHROPIC_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
        return {"type": "error", "error": {"type": kind, "message": message}}
    kind = type_ or _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {**(extra or {}), "message": message, "type": kind, "param": param, "code": code}}


def error_response(
    status: int,
    message: str,
    *,
    param: str | None = None,
    code: Any = None,
    headers: dict[str, str] | None = None,
    shape: ErrorShape = "openai",
) -> web.Response:
    body = error_body(status, message, param=param, code=code, shape=shape)
    return web.json_response(body, status=status, headers=headers)


def validation_error(exc: ValidationError) -> APIError:
    first = exc.errors()[0]
    param = ".".join(str(p) for p in first["loc"]) or None
    problems = "; ".join(
        f"{'.'.join(str(p) for p in err['loc']) or 'body'}: {err['msg'].removeprefix('Value error, ')}"
        for err in exc.errors()[:5]
    )
    return APIError(400, f"invalid request: {problems}", param=param, code="invalid_value")


def validation_error_response(exc: ValidationError, shape: ErrorShape = "openai") -> web.Response:
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

    def body(self, shape: ErrorShape = "openai") -> dict[str, Any]:
        return error_body(self.status, self.message, param=self.param, code=self.code, type_=self.type_,
                          extra=self.extra, shape=shape)

    def response(self, shape: ErrorShape = "openai") -> web.Response:
        return web.json_response(self.body(shape), status=self.status, headers=self.headers)


@web.middleware
async def error_middleware(request: web.Request, handler: Any) -> web.StreamResponse:
    shape = shape_of(request.path)
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
