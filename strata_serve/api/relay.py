"""The path every request takes to the engine: read, checked, through the FIFO, relayed back.

One relay for every API the engine speaks (:func:`handler`); what differs between them
is declared by each :class:`~strata_serve.api.registry.Api`: its schema, its checks, and
its :class:`~strata_serve.api.formats.ApiFormat` (where the engine's numbers are, how a
stream ends, the error shape).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import logging
import os
import time
from typing import Any
from collections.abc import Awaitable, Callable, Iterator

from aiohttp import HttpVersion11, web

from strata_serve.api.bodies import read_json
from strata_serve.api.errors import APIError
from strata_serve.api.formats import ApiFormat, StreamSeen
from strata_serve.api.app_state import SERVICE, TENANT
from strata_serve.api.client_writes import ClientWrites, let_the_client_read
from strata_serve.api.registry import Api
from strata_serve.config import EngineSettings
from strata_serve.engine.base import ContextOverflow, Engine, EngineUnavailable, JSONAnswer
from strata_serve.hook_types import KeyRefused, Outcome, StrataRequest, Timings
from strata_serve.fifo import QueueFull, ShuttingDown
from strata_serve.service import Service

log = logging.getLogger("strata_serve.api")

#: How long a client told "queue full" should wait before trying again.
RETRY_AFTER_S = 5


def service_of(request: web.Request) -> Service:
    return request.app[SERVICE]


def handler(api: Api) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    """The handler of an API's path: the body read and checked as the API declares, then
    relayed through the FIFO (an API with a route name) or asked outside it."""

    async def handle(request: web.Request) -> web.StreamResponse:
        began = time.perf_counter()
        body = await read_json(request, api) if api.schema is not None else None
        if body is not None and api.prepare is not None:
            body = api.prepare(body)
        if body is not None and api.check is not None:
            await api.check(request, body)
        if api.route is None:
            return await direct(request, api.method, api.engine_path, body)
        assert body is not None, f"{api.path}: an API whose requests run in a slot has a schema"
        return await relay(request, api, body, began)

    handle.__name__ = handle.__qualname__ = f"{api.route or api.engine_path.strip('/')}_handler"
    return handle


@contextlib.contextmanager
def service_errors(service: Service) -> Iterator[None]:
    """Turn the service's refusals into errors (shaped for the route by the middleware)."""
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
        # When a restart is planned, say when to come back (at least a second, as HTTP counts).
        headers = {"Retry-After": str(max(1, math.ceil(exc.retry_after)))} if exc.retry_after else None
        raise APIError(exc.status, str(exc), code="engine_unavailable", headers=headers) from None


#: An engine's "not supported" (501: embeddings without ``--embeddings``, infill on a model
#: without fill-in-the-middle tokens) is told as the client's 400: asking again will not help.
_NOT_SUPPORTED = 501


def engine_answer(status: int, body: Any, engine: EngineSettings | None = None,
                  read_overflow: Callable[[dict[str, Any]], ContextOverflow | None] | None = None) -> web.Response:
    """The engine's answer as ours; an error is raised as :class:`APIError` for the route's shape.

    The engine's own 4xx error object keeps its fields (its numeric ``code``, its type,
    the token counts of a context overflow) in the OpenAI shape. A context overflow (as
    the backend's ``read_overflow`` reads it) is told in words a user can act on
    (:func:`context_overflow`), given the ``engine``'s settings.
    """
    if status < 400:
        if isinstance(body, JSONAnswer):  # the engine's own bytes: no second encoding
            return web.Response(body=body.raw, status=status, content_type="application/json", charset="utf-8")
        return web.json_response(body, status=status)
    error = body.get("error") if isinstance(body, dict) else None
    if not isinstance(error, dict):
        raise APIError(status if status < 500 else 502, f"the engine answered HTTP {status}: {str(body)[:300]}")
    message = str(error.get("message") or f"HTTP {status}")
    if status == _NOT_SUPPORTED:
        raise APIError(400, f"the engine does not serve this: {message}", code="not_supported")
    if status >= 500:
        raise APIError(502, f"the engine failed: {message}")
    extra = {k: v for k, v in error.items() if k not in ("message", "type", "param", "code")}
    overflow = read_overflow(error) if read_overflow is not None else None
    if overflow is not None:
        message = context_overflow(overflow, str(error.get("message") or ""), engine)
    raise APIError(status, message, param=error.get("param"), code=error.get("code"),
                   type_=error.get("type") or "invalid_request_error", extra=extra)


def context_overflow(overflow: ContextOverflow, message: str, engine: EngineSettings | None) -> str:
    """What to tell a client whose request does not fit the context: both sizes, and how to
    serve one that holds it (an agent's first request is 20,000-40,000 tokens). ``message``:
    the engine's own."""
    n_prompt, n_ctx = overflow.prompt_tokens, overflow.context_tokens
    if n_prompt is None or n_ctx is None:
        return f"{message or 'the request exceeds the context size'}: serve a model with a larger context"
    parallel = engine.parallel if engine is not None else 1
    # A power of two above the request (room left for the answer), at least 32k, per slot.
    needed = max(32768, 1 << n_prompt.bit_length()) * parallel
    per_slot = f" per slot, {parallel} slots" if parallel > 1 else ""
    # The engine's own words stay: Claude Code recognises them ("Prompt is too long"). Short:
    # Claude Code shows about 350 characters of it, its own words first.
    held = f"{n_ctx:,} tokens{per_slot}"
    if engine is not None and not engine.url and engine.ctx_size // parallel > n_ctx:
        # The engine keeps to the context the model was trained for, whatever -c asks.
        held += f", the model's own; --ctx-size asked for {engine.ctx_size:,}"
    said = f"the request ({n_prompt:,} tokens) exceeds the available context size ({held})"
    if engine is not None and engine.url:
        return f"{said}: restart the engine at {engine.url} with a larger context (llama-server -c {needed})"
    return (f"{said}: serve a model made for {n_prompt:,} tokens or more, e.g. "
            f"`make serve MODEL=model.gguf CTX_SIZE={needed}` or "
            f"`strata-serve run --model model.gguf --ctx-size {needed}`")


async def direct(request: web.Request, method: str, path: str, body: Any = None) -> web.Response:
    """Ask the engine outside the FIFO, for routes that touch no slot.

    Tokenizing, applying the chat template, counting tokens and reading ``/props`` are
    answered by the engine from its vocabulary and settings, beside whatever runs in
    the slot: nothing is evicted, nothing needs saving. Sent through the FIFO, they
    would wait behind a long prefill for an answer that takes a millisecond, and the
    plugins' ``pre_request`` would take them for a switch (auto-sessions parks the held
    conversation before any request without a conversation key).
    """
    service = service_of(request)
    status, answer = await ask_directly(request, method, path, body)
    return engine_answer(status, answer, service.settings.engine, service.engine.read_overflow)


async def ask_directly(request: web.Request, method: str, path: str, body: Any = None) -> tuple[int, Any]:
    """The engine's status and answer to ``method path``, asked outside the FIFO once it is
    up (:func:`direct`); the service's refusals raised as errors."""
    service = service_of(request)
    with service_errors(service):
        await service.engine.wait_ready()
        return await service.engine.request(method, path, json=body, op=path.strip("/"))


async def relay(request: web.Request, api: Api, body: dict[str, Any], began: float | None = None) -> web.StreamResponse:
    """Send one request on ``api`` through the FIFO to the engine and hand back its answer.

    An API whose requests hold no conversation (``keyed=False``: embeddings) asks no
    keying plugin, so none can name one the slot will not hold afterwards. ``began``: when
    the handler began reading the body (``time.perf_counter()``), for the ``read`` span.
    """
    service = service_of(request)
    strata_request = StrataRequest(
        route=api.route or "",
        body=body,
        headers=request.headers,
        stream=bool(body.get("stream")),
        tenant=request.get(TENANT),
        api=api,
    )
    timeline = strata_request.timeline
    key_began = time.perf_counter()
    if began is not None:
        timeline.add("read", (key_began - began) * 1000)
    if api.keyed:
        try:
            strata_request.conversation_key = service.conversation_key(strata_request)
        except KeyRefused as exc:
            raise APIError(400, str(exc), param=exc.param, code="invalid_conversation_key") from None
        timeline.add("key", (time.perf_counter() - key_began) * 1000)
    answer: web.StreamResponse | None = None
    #: The outcome the send is filling in, once it began.
    sending: Outcome | None = None

    async def send(outcome: Outcome) -> None:
        nonlocal answer, sending
        sending = outcome
        sent = time.perf_counter()
        try:
            if strata_request.stream:
                answer = await _relay_stream(request, service, api, strata_request, outcome)
            else:
                answer = await _relay_json(service, api, strata_request.body, outcome)
        finally:
            # The engine's answer as the relay waited for it: a plain one in its Server-Timing,
            # a stream's (its headers gone by then) in GET /stats alone.
            timeline.add("engine", (time.perf_counter() - sent) * 1000)

    async def deliver() -> None:
        # A plain answer leaves as soon as it is complete: the client does not wait for
        # the plugins' post_request steps (a stream's has left by then already).
        if strata_request.stream or answer is None:
            return
        answer.headers.update(state_headers(strata_request))
        with contextlib.suppress(ConnectionError):
            await answer.prepare(request)
            await answer.write_eof()
            let_the_client_read()

    writes = ClientWrites(request)
    try:
        with service_errors(service):
            await service.process(strata_request, send, deliver)
    except asyncio.CancelledError:
        writes.restore()
        # Cut by a stop before its answer began (queued, or waiting on the engine): it gets
        # the stop's answer, not a connection closed without one. A stream already answering
        # was ended with an error event in it.
        if not service.closing or (strata_request.stream and sending is not None and sending.http_status == 200):
            raise
        task = asyncio.current_task()
        if task is not None:
            task.uncancel()
        raise APIError(503, "the server is shutting down", code="shutting_down") from None
    except BaseException:
        writes.restore()
        raise
    assert answer is not None
    if service.fifo.holders:
        # The turn went on to the next request: it reaches the engine before this one's
        # own last steps (aiohttp's end of the response), which the engine does not wait for.
        await asyncio.sleep(0)
    # The turn has ended: what the client has not read yet leaves now, for a bounded time.
    await writes.drained(service.settings.server.client_write_timeout_s, strata_request.id)
    return answer


def answer_timings(engine: Engine, api_format: ApiFormat, numbers: Any, usage: Any) -> Timings | None:
    """What an answer cost: the backend reads the engine's own numbers; without them, the
    API's ``usage`` says what it can."""
    timings = engine.read_timings(numbers) if numbers is not None else None
    return timings if timings is not None else api_format.timings_from_usage(usage)


def state_headers(request: StrataRequest) -> dict[str, str]:
    """What strata did for this request, for the client to see without reading logs: the
    core's word on where its state came from (``request.state_source``, final once answered)."""
    # A stream's headers leave before the service learns which slot the engine chose
    # for a request it could not place itself: then no slot is named.
    slot = {"X-Strata-Slot": str(request.slot)} if request.pinned or not request.stream else {}
    # Where its time went outside the engine, as far as known now (a stream's: before its answer).
    timing = request.timeline.server_timing()
    if timing:
        slot["Server-Timing"] = timing
    if request.conversation_key is None:
        return {"X-Strata-State": "unkeyed", **slot}
    return {
        "X-Strata-Conversation": request.conversation_key,
        "X-Strata-State": request.state_source or "engine",
        "X-Strata-Restored-Tokens": str(request.restored_tokens),
        **slot,
    }


async def _relay_json(service: Service, api: Api, body: dict[str, Any], outcome: Outcome) -> web.StreamResponse:
    api_format = api.format
    status, answer = await service.engine.request("POST", api.engine_path, json=body, op="completion")
    outcome.http_status = status
    service.answer_began()
    if isinstance(answer, dict) and 200 <= status < 300:
        usage = api_format.usage(answer)
        numbers = api_format.engine_numbers(answer, service.engine.numbers_key)
        outcome.timings = answer_timings(service.engine, api_format, numbers, usage)
        outcome.usage = usage if isinstance(usage, dict) else None
    if 200 <= status < 300:
        outcome.status = "ok"
        outcome.error = None
    else:
        outcome.status = "error"
        outcome.error = f"engine answered HTTP {status}"
    return engine_answer(status, answer, service.settings.engine, service.engine.read_overflow)


async def _end_with_error(response: web.StreamResponse, message: str, kind: str, api_format: ApiFormat) -> None:
    await response.write(api_format.stream_error(message, kind))
    await response.write_eof()


class _Passing:
    """A stream's bytes passed on as they come: from the thread that reads them, where the
    backend reads in one (``forward``: no turn of the event loop per chunk), written to the
    client's socket there; else, and once a client cannot take a chunk at once or is gone,
    a chunk at a time, each write waiting for the client. The bytes after the event that
    ends the stream (``tail``) leave with the stream's end, in one write (a system call
    costs as much as a short answer's Python)."""

    def __init__(self, request: web.Request, response: web.StreamResponse, seen: StreamSeen) -> None:
        self.request, self.response, self.seen, self.tail = request, response, seen, b""
        #: The stream's last event passed whole: the client's stream ends now, without
        #: waiting for the engine to close its connection (llama-server closes it after a
        #: stream, a little later: that wait was most of what a streamed 1-token request added).
        self.complete = False

    def _ends_here(self) -> bool:
        self.complete = self.seen.ended and self.tail.endswith(b"\n\n")
        return self.complete

    async def run(self, upstream: Any) -> None:
        """Until the engine's answer ends (the stream's end is then the caller's to write)."""
        forward = getattr(upstream, "forward", None)
        transport = self.request.transport
        # Written past aiohttp in HTTP/1.1's chunked framing, in the clear: an HTTP/1.0
        # client's answer is the bare bytes up to the connection's close, so it goes the plain way.
        if (forward is None or transport is None or transport.is_closing()
                or self.request.version < HttpVersion11 or transport.get_extra_info("sslcontext") is not None
                or transport.get_extra_info("socket") is None):
            await self._one_by_one(b"", upstream)
            return
        seen = self.seen
        # Awaited here: the client has had its head since the engine's status was known.
        first = await anext(upstream.chunks(), b"")
        if not first:
            return
        seen.feed(first)
        if seen.finished:  # the end came at once: the few bytes left go the plain way
            self.tail = first
            if not self._ends_here():
                await self._one_by_one(b"", upstream)
            return
        await self.response.write(first)
        if transport.is_closing() or transport.get_write_buffer_size():
            await self._one_by_one(b"", upstream)  # a client slow from the start: each write waits for it
            return
        client = _ClientSocket(transport)
        feed, send = seen.feed, client.send

        def take(chunk: bytes) -> bool:  # in the backend's thread: touches no event loop
            feed(chunk)
            out = b"%x\r\n%b\r\n" % (len(self.tail), self.tail) if self.tail else b""  # HTTP's chunked framing
            self.tail = b""
            if seen.finished:
                self.tail = chunk
                stop = self._ends_here()
            else:
                out += b"%x\r\n%b\r\n" % (len(chunk), chunk)
                stop = False
            return (bool(out) and not send(out)) or stop

        try:
            ended = await forward(take)
        finally:
            client.close()
            if client.unsent and not transport.is_closing():
                transport.write(client.unsent)  # before anything else (a stop's error event too)
        if not (ended or self.complete):
            await self._one_by_one(b"", upstream)

    async def _one_by_one(self, first: bytes, upstream: Any) -> None:
        feed, write, chunks = self.seen.feed, self.response.write, upstream.chunks()
        chunk: bytes | None = first or await anext(chunks, None)
        while chunk is not None:
            feed(chunk)
            if self.tail:
                await write(self.tail)
                self.tail = b""
            if self.seen.finished:
                self.tail = chunk
                if self._ends_here():
                    return
            else:
                await write(chunk)
            chunk = await anext(chunks, None)


class _ClientSocket:
    """The client's connection, written from another thread while the event loop writes
    nothing to it (its write buffer empty). A write the socket cannot take whole at once, or
    at all (the client gone), is left (``unsent``) to the event loop, which writes it or
    finds the client gone, as it decides for every stream (aiohttp cancels the handler of a
    connection lost). The thread stops writing once the event loop saw the client leave
    (its transport closing: a flag, read here). Its own descriptor (a duplicate): the event
    loop closes the connection's once the client left."""

    def __init__(self, transport: asyncio.BaseTransport) -> None:
        self._fd = os.dup(transport.get_extra_info("socket").fileno())
        self._closing = transport.is_closing
        self.unsent = b""

    def send(self, data: bytes) -> bool:
        """Whether ``data`` left whole (the socket never blocks: it is the event loop's)."""
        if self._closing():  # the client left: the engine's work stops now, not a write later
            self.unsent = data
            return False
        try:
            sent = os.write(self._fd, data)
        except BlockingIOError:
            sent = 0
        except OSError:
            sent = 0  # gone: the event loop finds out, and cuts the request as for any stream
        if sent < len(data):
            self.unsent = data[sent:]
            return False
        return True

    def close(self) -> None:
        os.close(self._fd)


async def _relay_stream(
    request: web.Request, service: Service, api: Api, strata_request: StrataRequest, outcome: Outcome,
) -> web.StreamResponse:
    api_format = api.format
    async with service.engine.stream(api.engine_path, strata_request.body) as upstream:
        outcome.http_status = upstream.status
        service.answer_began()  # the engine has this request: the next in line may follow it there
        if upstream.status != 200:
            answer = await upstream.body()
            outcome.error = f"engine answered HTTP {upstream.status}"
            return engine_answer(upstream.status, answer, service.settings.engine, service.engine.read_overflow)
        response = web.StreamResponse(
            status=200,
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                     **state_headers(strata_request)},
        )
        await response.prepare(request)
        seen = StreamSeen(api_format, service.engine.numbers_key)
        passing = _Passing(request, response, seen)
        try:
            await passing.run(upstream)
            await response.write_eof(passing.tail)
            let_the_client_read()
        except EngineUnavailable as exc:
            # Headers are gone already: tell the client in the stream itself.
            outcome.error = str(exc)
            with contextlib.suppress(ConnectionError):
                if passing.tail:
                    await response.write(passing.tail)
                await _end_with_error(response, str(exc), "engine_error", api_format)
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
                    if passing.tail:
                        await response.write(passing.tail)
                    await _end_with_error(response, outcome.error, "service_unavailable", api_format)
            raise
        finally:
            # Whatever the client did, what the engine said it did is known: the slot's
            # picture needs it (a stream closed after its last event ran to the end).
            outcome.timings = answer_timings(service.engine, api_format, seen.timings, seen.usage)
            outcome.usage = seen.usage
        if seen.finished and seen.error is None:
            outcome.status, outcome.error = "ok", None
        else:
            outcome.error = seen.error or "the engine ended the stream early"
        return response
