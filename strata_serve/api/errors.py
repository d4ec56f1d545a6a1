"""Every error leaves the server in the OpenAI error shape."""

from __future__ import annotations

import logging
from typing import Any

from aiohttp import web
from pydantic import ValidationError

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


def error_response(
    status: int,
    message: str,
    *,
    param: str | None = None,
    code: str | None = None,
    headers: dict[str, str] | None = None,
) -> web.Response:
    body = {
        "error": {
            "message": message,
            "type": _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error"),
            "param": param,
            "code": code,
        }
    }
    return web.json_response(body, status=status, headers=headers)


def validation_error_response(exc: ValidationError) -> web.Response:
    first = exc.errors()[0]
    param = ".".join(str(p) for p in first["loc"]) or None
    problems = "; ".join(
        f"{'.'.join(str(p) for p in err['loc']) or 'body'}: {err['msg'].removeprefix('Value error, ')}"
        for err in exc.errors()[:5]
    )
    return error_response(400, f"invalid request: {problems}", param=param, code="invalid_value")


class APIError(Exception):
    """Raised by handlers to answer with an OpenAI-shaped error."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers

    def response(self) -> web.Response:
        return error_response(self.status, self.message, param=self.param, code=self.code,
                              headers=self.headers)


@web.middleware
async def error_middleware(request: web.Request, handler: Any) -> web.StreamResponse:
    try:
        return await handler(request)
    except APIError as exc:
        return exc.response()
    except ValidationError as exc:
        return validation_error_response(exc)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        message = {
            404: f"no route {request.method} {request.path}",
            405: f"method {request.method} is not allowed on {request.path}",
            413: "request body too large",
        }.get(exc.status, exc.reason)
        headers = {k: v for k, v in exc.headers.items() if k.lower() == "allow"}
        return error_response(exc.status, message, headers=headers or None)
    except Exception:
        log.exception("[strata] unexpected error answering %s %s", request.method, request.path)
        return error_response(500, "internal error; see the server log", code="internal_error")
