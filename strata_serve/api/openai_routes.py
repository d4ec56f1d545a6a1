"""``/v1/chat/completions``, ``/v1/completions`` and ``/v1/models``, relayed to the engine."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import re
from typing import Any, Iterator

from aiohttp import web
from aiohttp.web_protocol import RequestPayloadError
from pydantic import BaseModel

from strata_serve.api.errors import APIError
from strata_serve.api.keys import SERVICE, TENANT
from strata_serve.engine.base import EngineUnavailable
from strata_serve.exchange import KeyRefused, Outcome, StrataRequest
from strata_serve.service import QueueFull, Service, ShuttingDown
from strata_serve.slot_state import state_source

log = logging.getLogger("strata_serve.api")
routes = web.RouteTableDef()

#: How long a client told "queue full" should wait before trying again.
RETRY_AFTER_S = 5


def service_of(request: web.Request) -> Service:
    return request.app[SERVICE]


async def read_json(request: web.Request, model: type[BaseModel]) -> dict[str, Any]:
    """The body as a dict, checked against ``model`` (raises errors the middleware shapes)."""
    timeout = service_of(request).settings.server.read_timeout_s
    try:
        raw = await asyncio.wait_for(request.read(), timeout)  # 413 past server.max_body_mib
    except asyncio.TimeoutError:
        raise APIError(408, f"the request body did not arrive within {timeout:g} s", code="read_timeout") from None
    except RequestPayloadError as exc:  # e.g. Content-Encoding: gzip over bytes that are not gzip
        raise APIError(400, f"the request body could not be read: {exc.__cause__ or exc}",
                       code="unreadable_body") from None
    if not raw:
        raise APIError(400, "the request body is empty; a JSON object is expected")
    try:
        body = json.loads(raw, parse_constant=_not_json, parse_float=_finite_float)
    except RecursionError:
        raise APIError(400, f"the request body is nested more than {MAX_JSON_DEPTH} levels deep",
                       code="too_deeply_nested") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise APIError(400, f"the request body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    check_json_value(body)
    model.model_validate(body)
    return body


def _not_json(word: str) -> Any:
    # Python's parser takes NaN and Infinity, which JSON (and the engine) does not.
    raise ValueError(f"{word} is not a JSON value")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e999: valid JSON text, but no number a float holds
        raise ValueError(f"the number {text[:40]} is out of range")
    return value


#: Deepest nesting of arrays and objects accepted in a request body. Python's own
#: parser stops near 1,000 levels (a RecursionError); whatever handles the body later
#: (validation, the relay's encoder, the engine's parser) recurses too.
MAX_JSON_DEPTH = 100


def check_json_value(value: Any) -> None:
    """Refuse what parsed as JSON yet cannot be handled safely: deep nesting, lone surrogates.

    JSON's ``\\ud800`` escapes can make strings that are not Unicode text; encoding
    them (to hash a key, to name a file, to log) would fail far from here.

    :raises APIError: 400 naming the problem.
    """
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, str):
            if not item.isascii() and _SURROGATE.search(item):
                raise APIError(400, "the request body holds a lone UTF-16 surrogate (a \\ud800-\\udfff escape "
                               "outside a pair), which is not text", code="invalid_unicode")
            continue
        if isinstance(item, dict):
            children = [*item.keys(), *item.values()]
        elif isinstance(item, list):
            children = item
        else:
            continue
        if depth > MAX_JSON_DEPTH:
            raise APIError(400, f"the request body is nested more than {MAX_JSON_DEPTH} levels deep",
                           code="too_deeply_nested")
        stack.extend((child, depth + 1) for child in children)


_SURROGATE = re.compile("[\ud800-\udfff]")


@routes.post("/v1/chat/completions")
async def chat_completions(request: web.Request) -> web.StreamResponse:
    from strata_serve.api.schemas import ChatCompletionRequest

    body = await read_json(request, ChatCompletionRequest)
    return await relay(request, "chat", "/v1/chat/completions", body)


@routes.post("/v1/completions")
async def completions(request: web.Request) -> web.StreamResponse:
    from strata_serve.api.schemas import CompletionRequest

    body = await read_json(request, CompletionRequest)
    return await relay(request, "completion", "/v1/completions", body)


@routes.get("/v1/models")
async def models(request: web.Request) -> web.Response:
    service = service_of(request)
    try:
        await service.engine.wait_ready()
        status, body = await service.engine.request("GET", "/v1/models", op="models")
    except EngineUnavailable as exc:
        raise APIError(exc.status, str(exc)) from None
    return engine_answer(status, body)


@contextlib.contextmanager
def service_errors(service: Service) -> Iterator[None]:
    """Turn the service's refusals into OpenAI-shaped errors."""
    try:
        yield
    except QueueFull:
        raise APIError(
            503,
            f"the server is busy: {service.settings.server.queue_limit} requests are already waiting",
            code="queue_full",
            headers={"Retry-After": str(RETRY_AFTER_S)},
        ) from None
    except ShuttingDown:
        raise APIError(503, "the server is shutting down", code="shutting_down") from None
    except EngineUnavailable as exc:
        raise APIError(exc.status, str(exc), code="engine_unavailable") from None


def engine_answer(status: int, body: Any) -> web.Response:
    """The engine's answer as ours; a non-JSON or odd error body is put in the OpenAI shape."""
    if status >= 400 and not (isinstance(body, dict) and isinstance(body.get("error"), dict)):
        raise APIError(status if status < 500 else 502, f"the engine answered HTTP {status}: {str(body)[:300]}")
    if status >= 500:
        message = body["error"].get("message") or f"HTTP {status}"
        raise APIError(502, f"the engine failed: {message}")
    if status >= 400:
        # The engine's own error object, completed to the OpenAI shape.
        body = {"error": {"param": None, "code": None, **body["error"]}}
        body["error"].setdefault("type", "invalid_request_error")
    return web.json_response(body, status=status)


async def relay(request: web.Request, route: str, path: str, body: dict[str, Any]) -> web.StreamResponse:
    """Send one request through the FIFO to the engine and hand back its answer."""
    service = service_of(request)
    sreq = StrataRequest(
        route=route,  # type: ignore[arg-type]
        body=body,
        headers=request.headers,
        stream=bool(body.get("stream")),
        tenant=request.get(TENANT),
    )
    try:
        sreq.conversation_key = service.conversation_key(sreq)
    except KeyRefused as exc:
        raise APIError(400, str(exc), param=exc.param, code="invalid_conversation_key") from None
    answer: web.StreamResponse | None = None

    async def send(outcome: Outcome) -> None:
        nonlocal answer
        if sreq.stream:
            answer = await _relay_stream(request, service, path, sreq.body, outcome, sreq)
        else:
            answer = await _relay_json(service, path, sreq.body, outcome)
            answer.headers.update(state_headers(sreq, outcome.timings))

    with service_errors(service):
        await service.process(sreq, send)
    assert answer is not None
    return answer


def state_headers(sreq: StrataRequest, timings: dict[str, Any] | None) -> dict[str, str]:
    """What strata did for this request, for the client to see without reading logs."""
    if sreq.conversation_key is None:
        return {"X-Strata-State": "unkeyed"}
    return {
        "X-Strata-Conversation": sreq.conversation_key,
        "X-Strata-State": state_source(sreq, timings),
        "X-Strata-Restored-Tokens": str(sreq.restored_tokens),
    }


async def _relay_json(service: Service, path: str, body: dict[str, Any], outcome: Outcome) -> web.StreamResponse:
    status, answer = await service.engine.request("POST", path, json=body, op="completion")
    outcome.http_status = status
    if isinstance(answer, dict):
        outcome.timings = answer.get("timings")
        outcome.usage = answer.get("usage")
    if 200 <= status < 300:
        outcome.status = "ok"
        outcome.error = None
    else:
        outcome.status = "error"
        outcome.error = f"engine answered HTTP {status}"
    return engine_answer(status, answer)


async def _end_with_error(response: web.StreamResponse, message: str, kind: str) -> None:
    event = {"error": {"message": message, "type": kind, "param": None, "code": None}}
    await response.write(b"data: " + json.dumps(event).encode() + b"\n\n")
    await response.write_eof()


class _SSEWatcher:
    """Reads the engine's SSE bytes as they pass, for ``timings``, ``usage`` and the end."""

    _MARKERS = (b'"timings"', b'"usage"', b'"error"', b'"finish_reason":"', b'"finish_reason": "')

    def __init__(self) -> None:
        self._buffer = b""
        self.timings: dict[str, Any] | None = None
        self.usage: dict[str, Any] | None = None
        self.finished = False
        self.error: str | None = None

    def feed(self, chunk: bytes) -> None:
        self._buffer += chunk
        *lines, self._buffer = self._buffer.split(b"\n")
        for line in lines:
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                self.finished = True
                continue
            if not any(marker in data for marker in self._MARKERS):
                continue  # a plain token: nothing to learn, and parsing each one costs speed
            try:
                event = json.loads(data)
            except ValueError:
                continue
            if not isinstance(event, dict):
                continue
            if isinstance(event.get("timings"), dict):
                self.timings = event["timings"]
            if isinstance(event.get("usage"), dict):
                self.usage = event["usage"]
            if "error" in event:
                self.error = str(event["error"])
            for choice in event.get("choices") or []:
                if isinstance(choice, dict) and choice.get("finish_reason"):
                    self.finished = True


async def _relay_stream(
    request: web.Request, service: Service, path: str, body: dict[str, Any], outcome: Outcome,
    sreq: StrataRequest,
) -> web.StreamResponse:
    async with service.engine.stream(path, body) as upstream:
        outcome.http_status = upstream.status
        if upstream.status != 200:
            answer = await upstream.body()
            outcome.error = f"engine answered HTTP {upstream.status}"
            return engine_answer(upstream.status, answer)
        response = web.StreamResponse(
            status=200,
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                     **state_headers(sreq, None)},
        )
        await response.prepare(request)
        watcher = _SSEWatcher()
        try:
            async for chunk in upstream.chunks():
                watcher.feed(chunk)
                await response.write(chunk)
            await response.write_eof()
        except EngineUnavailable as exc:
            # Headers are gone already: tell the client in the stream itself.
            outcome.error = str(exc)
            with contextlib.suppress(ConnectionError):
                await _end_with_error(response, str(exc), "engine_error")
            return response
        except ConnectionError:
            # The client closed its end (often right after the last event): leaving now
            # drops the engine's connection, which stops its work if any is left.
            outcome.status, outcome.error = "cancelled", "the client went away"
            return response
        except asyncio.CancelledError:
            if service.closing:
                # Cut at the end of the shutdown grace: end the stream properly, saying why.
                outcome.error = "cut: the server is shutting down"
                with contextlib.suppress(ConnectionError, RuntimeError):
                    await _end_with_error(response, outcome.error, "service_unavailable")
            raise
        finally:
            # Whatever the client did, what the engine said it did is known: the slot's
            # picture needs it (a stream closed after its last event ran to the end).
            outcome.timings, outcome.usage = watcher.timings, watcher.usage
        if watcher.finished and watcher.error is None:
            outcome.status, outcome.error = "ok", None
        else:
            outcome.error = watcher.error or "the engine ended the stream early"
        return response
