"""Calls to llama-server over HTTP, with one policy for when a call is sent again."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import http.client
import json as json_module
from typing import Any, Protocol, TypeVar
from collections.abc import AsyncIterator, Awaitable, Callable

import aiohttp
from pydantic import SecretStr

from strata_serve.engine.base import EngineUnavailable, JSONAnswer
from strata_serve.engine.llama_server.kept import KEEP_IDLE_S, KeptConnections
from strata_serve.engine.llama_server.process import exited
from strata_serve.engine.llama_server.state import EngineState
from strata_serve.engine.llama_server.stream import (STREAM_ERRORS, NotConnected, Opened, StreamOpener,
                                                     StreamReply, open_stream, request_body)

RESTARTED_DURING_CALL = "the engine was restarted during the call, which it never received; try again"
#: How long an idle connection to the engine is kept for the next call. llama-server closes
#: one after 5 s idle (it says ``Keep-Alive: timeout=5``); giving it up well before that,
#: we never send on a connection the engine is closing at that moment.
KEEPALIVE_S = KEEP_IDLE_S
#: The most streams read at once, each in a thread of its own (far above the engine's slots).
STREAM_THREADS = 64

Process = asyncio.subprocess.Process


class Answer(Protocol):
    """An answer whose head is read: what the policy for sending again looks at."""

    status: int

    def close(self) -> None: ...


#: A call's connection failed before it was made, or closed before any answer, or was lost:
#: aiohttp's errors and those of the plain calls and streams read here (``kept.py``, ``stream.py``),
#: each told apart by :meth:`EngineClient._send`.
NOT_CONNECTED = (aiohttp.ClientConnectorError, NotConnected)
DROPPED = (aiohttp.ServerDisconnectedError, http.client.RemoteDisconnected)
LOST = (TimeoutError, aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, *STREAM_ERRORS)

A = TypeVar("A", bound=Answer)


class EngineClient:
    """The HTTP side of one llama-server: its session, its calls, and when to send one again.

    ``current()`` names the process calls go to now (None when attached: an engine
    strata-serve did not start is known by its URL alone).
    """

    def __init__(self, url: str, state: EngineState, current: Callable[[], Process | None], *,
                 managed: bool, restart_on_crash: bool):
        self.url = url
        self.state = state
        self.current = current
        self.managed = managed
        self.restart_on_crash = restart_on_crash
        self.session: aiohttp.ClientSession | None = None
        #: Where streams are read, each on a connection of its own (``stream.py``).
        self._streams: concurrent.futures.ThreadPoolExecutor | None = None
        #: The streams open now: closing the client wakes their threads (none is left
        #: blocked on an engine that says nothing, which would hold the process's exit).
        self._open_streams: set[StreamReply] = set()
        self._headers: dict[str, str] = {}
        self._read_timeout: float | None = None
        #: Plain calls on kept connections read on the loop (:mod:`~strata_serve.engine.llama_server.kept`);
        #: None for an ``https://`` engine, whose calls go through aiohttp.
        self._kept: KeptConnections | None = None

    def open(self, api_key: SecretStr | None, request_timeout_s: float) -> None:
        headers = {}
        if api_key is not None:
            headers["Authorization"] = f"Bearer {api_key.get_secret_value()}"
        self._headers, self._read_timeout = headers, request_timeout_s
        self._streams = concurrent.futures.ThreadPoolExecutor(STREAM_THREADS, thread_name_prefix="strata-stream")
        if self.url.startswith("http://"):
            self._kept = KeptConnections(self.url, headers, request_timeout_s)
        self.session = aiohttp.ClientSession(
            # Connections are kept for the next call (a connect per call was the largest
            # part of what the layer added to a request). A stream has one of its own (stream.py).
            connector=aiohttp.TCPConnector(keepalive_timeout=KEEPALIVE_S),
            headers=headers,
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=request_timeout_s),
        )

    async def close(self) -> None:
        if self._kept is not None:
            self._kept.close()
        if self.session is not None:
            await self.session.close()
        for reply in list(self._open_streams):
            reply.close()
        if self._streams is not None:
            self._streams.shutdown(wait=False, cancel_futures=True)

    async def health(self) -> bool:
        assert self.session is not None
        try:
            async with self.session.get(self.url + "/health", timeout=aiohttp.ClientTimeout(total=2)) as resp:
                return resp.status == 200
        except (TimeoutError, aiohttp.ClientError, OSError):
            return False

    async def request(self, method: str, path: str, json: Any = None, *, resend: bool = True) -> tuple[int, Any]:
        """One call; ``(status, body)`` with the body parsed as JSON when it is JSON.

        Sent again as :meth:`_send` says. Slot operations pass ``resend=False``: the
        engine that comes back holds nothing, so saving it under the old name would be a lie.

        :raises EngineUnavailable: when the engine cannot be reached.
        """
        kept = self._kept
        if kept is not None:
            body = None if json is None else request_body(json)
            answer, proc = await self._send(lambda: kept.call(method, path, body), resend)
            if answer.content_type == "application/json":
                return answer.status, json_answer(answer.body)
            return answer.status, answer.body.decode("utf-8", "replace")
        assert self.session is not None
        session = self.session
        resp, proc = await self._send(lambda: session.request(method, self.url + path, json=json), resend)
        try:
            async with resp:
                if resp.content_type == "application/json":
                    return resp.status, json_answer(await resp.read())
                return resp.status, await resp.text()
        except LOST as exc:
            raise await self.gone(exc, proc) from exc

    @contextlib.asynccontextmanager
    async def stream(self, path: str, json: Any) -> AsyncIterator[StreamReply]:
        """A streamed call; leaving it early drops the connection, which stops the engine's work.

        Sent again as :meth:`_send` says, on a connection of its own (llama-server closes a
        stream's), read in a thread (:mod:`~strata_serve.engine.llama_server.stream`).
        """
        pool = self._streams
        assert pool is not None
        body = request_body(json)

        async def send() -> Opened:
            return await open_stream(StreamOpener(self.url, path, body, self._headers, self._read_timeout), pool)

        opened, proc = await self._send(send, True)
        reply = StreamReply(opened, pool, lambda exc: self.gone(exc, proc), self._read_timeout)
        self._open_streams.add(reply)
        try:
            yield reply
        finally:
            self._open_streams.discard(reply)
            reply.close()

    async def _send(self, send: Callable[[], Awaitable[A]], resend: bool) -> tuple[A, Process | None]:
        """Send a call until it is answered: the one policy of every call to the engine.

        A call waits until the engine is up: never sent to one that is still loading.
        It is sent once more when it delivered nothing: with ``resend``, after a refused
        connection or a 503 from a new process still loading, once a new engine is up
        (:meth:`_came_back`); and after a kept connection closed before any answer
        (:meth:`_dropped_unanswered`). Returns the answer (its headers read) and the
        process it came from.

        :raises EngineUnavailable: when the engine cannot be reached.
        """
        resent = dropped = False
        while True:
            await self.state.wait_up()
            proc = self.current()
            try:
                resp = await send()
            except NOT_CONNECTED as exc:
                if resend and not resent and await self._came_back(proc):
                    resent = True
                    continue
                raise await self.gone(exc, proc) from exc
            except DROPPED as exc:
                if not dropped and await self._dropped_unanswered(proc, resend):
                    dropped = True
                    continue
                raise await self.gone(exc, proc) from exc
            except LOST as exc:
                raise await self.gone(exc, proc) from exc
            if not (resp.status == 503 and self._replaced(proc)):
                return resp, proc
            resp.close()  # a new process, still loading, answered: nothing was done
            if not (resend and not resent and await self._came_back(proc)):
                raise EngineUnavailable(RESTARTED_DURING_CALL, status=502)
            resent = True

    def _replaced(self, proc: Process | None) -> bool:
        """Whether the process a call went to is no longer the one that is up (it died, or was replaced)."""
        return self.managed and (self.current() is not proc or not self.state.up.is_set())

    async def _came_back(self, proc: Process | None) -> bool:
        """After a call that delivered nothing: is a new engine up now (then send again)?

        A refused connection, or a 503 from a process still loading, means nothing was
        done, so sending again is safe. This happens when the engine died just before
        (a slot operation that crashed it, a kill).

        :raises EngineUnavailable: at once when the engine is down and no start is under way.
        """
        if not self.managed or proc is None or self.state.stopping:
            return False
        if self.current() is proc:
            if not await exited(proc, 1.0):
                return False  # refused by a process that lives on: not a restart
            if self.current() is proc:
                self.state.set_lost()  # before the supervisor sees it: wait for what it does next
        await self.state.wait_up()
        return self.current() is not proc

    async def _dropped_unanswered(self, proc: Process | None, resend: bool) -> bool:
        """A kept connection closed before any answer came: send again on another one?

        An engine may close an idle connection just as a call goes out on it; the call
        then reached nothing, and sending it again is safe. But a connection also closes
        unanswered when the engine dies with the call in hand: that is told as today
        (the engine stopped while answering), never sent to the next engine. An engine
        we started is known to live on by its process; one we attach to is not, so a
        call that must not reach another engine (``resend=False``) is not sent again.
        """
        if self.state.stopping:
            return False
        if not self.managed:
            return resend
        # Rare (idle connections are given up before the engine closes them): waiting to
        # be sure the process lives on costs little.
        return proc is not None and not await exited(proc, 1.0) and not self._replaced(proc)

    async def gone(self, exc: BaseException, proc: Process | None) -> EngineUnavailable:
        """Describe a lost connection; ``proc`` is the engine process the call went to."""
        if self.managed and proc is not None and await exited(proc, 1.0):
            if self.restart_on_crash:
                return EngineUnavailable(
                    f"the engine stopped while answering (exit code {proc.returncode}); "
                    "it is being restarted, try again shortly",
                    status=502,
                )
            return EngineUnavailable(
                f"the engine stopped while answering (exit code {proc.returncode}) and is not restarted "
                "(engine.restart_on_crash is off)",
                status=502,
            )
        return EngineUnavailable(f"the engine at {self.url} did not answer ({type(exc).__name__})", status=502)


def json_answer(raw: bytes) -> Any:
    """A JSON body as Python (an object keeps its bytes, for the relay to pass on as they came).

    :raises ValueError: when the body is not JSON.
    """
    if not raw.strip():
        return None
    value = json_module.loads(raw)
    return JSONAnswer(value, raw) if isinstance(value, dict) else value
