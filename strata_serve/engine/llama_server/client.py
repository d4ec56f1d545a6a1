"""Calls to llama-server over HTTP, with one policy for when a call is sent again."""

from __future__ import annotations

import asyncio
import contextlib
import json as json_module
from typing import Any
from collections.abc import AsyncIterator, Awaitable, Callable

import aiohttp
from pydantic import SecretStr

from strata_serve.engine.base import EngineUnavailable, JSONAnswer
from strata_serve.engine.llama_server.process import exited
from strata_serve.engine.llama_server.state import EngineState

RESTARTED_DURING_CALL = "the engine was restarted during the call, which it never received; try again"
#: How long an idle connection to the engine is kept for the next call. llama-server closes
#: one after 5 s idle (it says ``Keep-Alive: timeout=5``); giving it up well before that,
#: we never send on a connection the engine is closing at that moment.
KEEPALIVE_S = 2.0
#: Asked of the engine for a streamed call: llama-server closes the connection after a
#: stream whatever was asked; asking for it makes it say so (``Connection: close``), so the
#: connection is never put back for another call.
CLOSE_AFTER = {"Connection": "close"}

Process = asyncio.subprocess.Process


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
        #: The connection being opened for the next call (:meth:`_warm_soon`).
        self._warming: asyncio.Task[bool] | None = None

    def open(self, api_key: SecretStr | None, request_timeout_s: float) -> None:
        headers = {}
        if api_key is not None:
            headers["Authorization"] = f"Bearer {api_key.get_secret_value()}"
        self.session = aiohttp.ClientSession(
            # Connections are kept for the next call (a connect per call was the largest
            # part of what the layer added to a request), except a stream's (CLOSE_AFTER).
            connector=aiohttp.TCPConnector(keepalive_timeout=KEEPALIVE_S),
            headers=headers,
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=request_timeout_s),
        )

    async def close(self) -> None:
        if self._warming is not None and not self._warming.done():
            self._warming.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._warming
        if self.session is not None:
            await self.session.close()

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
        assert self.session is not None
        session = self.session
        resp, proc = await self._send(lambda: session.request(method, self.url + path, json=json), resend)
        try:
            async with resp:
                if resp.content_type == "application/json":
                    return resp.status, json_answer(await resp.read())
                return resp.status, await resp.text()
        except (TimeoutError, aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as exc:
            raise await self.gone(exc, proc) from exc

    @contextlib.asynccontextmanager
    async def stream(self, path: str, json: Any) -> AsyncIterator[StreamReply]:
        """A streamed call; leaving it early drops the connection, which stops the engine's work.

        Sent again as :meth:`_send` says; its own connection is not kept.
        """
        assert self.session is not None
        session = self.session
        resp, proc = await self._send(lambda: session.post(self.url + path, json=json, headers=CLOSE_AFTER), True)
        reply = StreamReply(resp, lambda exc: self.gone(exc, proc), session.timeout.sock_read)
        try:
            yield reply
        finally:
            reply.close()
            self._warm_soon()

    def _warm_soon(self) -> None:
        """After a stream, whose connection the engine closes: a new one opened (by a
        ``/health`` call, kept alive) off the request's path, for the next call to take."""
        if self.session is None or self.session.closed:
            return  # stopping: nothing more goes to the engine
        if self._warming is None or self._warming.done():
            self._warming = asyncio.get_running_loop().create_task(self.health())

    async def _send(self, send: Callable[[], Awaitable[aiohttp.ClientResponse]],
                    resend: bool) -> tuple[aiohttp.ClientResponse, Process | None]:
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
            except aiohttp.ClientConnectorError as exc:
                if resend and not resent and await self._came_back(proc):
                    resent = True
                    continue
                raise await self.gone(exc, proc) from exc
            except aiohttp.ServerDisconnectedError as exc:
                if not dropped and await self._dropped_unanswered(proc, resend):
                    dropped = True
                    continue
                raise await self.gone(exc, proc) from exc
            except (TimeoutError, aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as exc:
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


class StreamReply:
    """The engine's streamed answer: its status, then its bytes as they come.

    ``read_timeout``: the longest the engine may stay silent mid-answer (the session's
    ``sock_read``), kept by one watch for the whole stream (:class:`ReadWatch`) rather than
    by aiohttp's timer, re-armed for every packet: one per token.
    """

    def __init__(self, resp: aiohttp.ClientResponse,
                 gone: Callable[[BaseException], Awaitable[EngineUnavailable]],
                 read_timeout: float | None = None):
        self._resp = resp
        self._gone = gone
        self._content = resp.content
        self.status = resp.status
        self._watch = ReadWatch(resp, read_timeout) if read_timeout else None

    def close(self) -> None:
        """Leave the answer: the connection is dropped (which stops the engine's work)."""
        if self._watch is not None:
            self._watch.stop()
        self._resp.close()

    async def body(self) -> Any:
        """The whole body (for an error answer): JSON when it parses, else text."""
        text = await self._resp.text()
        try:
            return json_module.loads(text)
        except ValueError:
            return text

    def chunks(self) -> AsyncIterator[bytes]:
        """The bytes as they arrive, as many as have arrived at each step.

        :raises EngineUnavailable: when the engine goes away mid-answer.
        """
        return self

    def __aiter__(self) -> StreamReply:
        return self

    async def forward(self, take: Callable[[bytes], bool]) -> bool:
        """Hand the answer's bytes to ``take`` as they arrive, from the connection's own
        callback: no task is woken for each chunk (most often one token), the largest part
        of what relaying a chunk cost. ``take`` returns True to stop taking (what is left is
        then read with :meth:`chunks`); it must not raise.

        Returns True when the answer ended, False when ``take`` stopped.

        :raises EngineUnavailable: when the engine goes away mid-answer.
        """
        content = self._content
        connection = self._resp.connection
        protocol = connection.protocol if connection is not None else None
        loop = asyncio.get_running_loop()
        stopped = loop.create_future()
        pumping = False

        def pump() -> None:
            # Reading may make aiohttp resume the connection and feed more at once, calling
            # data_received within: that call leaves the reading to this loop.
            nonlocal pumping
            if pumping:
                return
            pumping = True
            try:
                while not stopped.done() and content.exception() is None:
                    chunk = content.read_nowait()
                    if not chunk:
                        return
                    if take(chunk):
                        stopped.set_result(None)
            finally:
                pumping = False

        try:
            if protocol is None:
                async for chunk in self:
                    if take(chunk):
                        return False
                return True
            received = protocol.data_received

            def data_received(data: bytes) -> None:
                received(data)
                pump()  # a failure is raised where the answer's end is awaited

            protocol.data_received = data_received  # type: ignore[method-assign]
            ended = loop.create_task(_end_of(content))
            try:
                pump()
                await asyncio.wait((ended, stopped), return_when=asyncio.FIRST_COMPLETED)
                if not stopped.done() and ended.done() and ended.exception() is None:
                    pump()  # what came with the end
            finally:
                del protocol.data_received
                if not ended.done():
                    ended.cancel()
                    with contextlib.suppress(asyncio.CancelledError, Exception):
                        await ended
            if stopped.done():
                if not ended.cancelled():
                    ended.exception()  # seen: what is left is read, and fails, chunk by chunk
                return False
            ended.result()  # the engine's failure, if it failed
            return True
        except (TimeoutError, aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as exc:
            raise await self._gone(exc) from exc

    async def __anext__(self) -> bytes:
        # A plain iterator rather than an async generator: one step less for every chunk.
        try:
            chunk = await self._content.readany()
        except (TimeoutError, aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as exc:
            raise await self._gone(exc) from exc
        if not chunk:
            raise StopAsyncIteration
        return chunk


async def _end_of(content: aiohttp.StreamReader) -> None:
    """The answer's end; raises its failure (one that came before the wait too)."""
    failure = content.exception()
    if failure is not None:
        raise failure
    await content.wait_eof()


class ReadWatch:
    """A stream's read timeout, looked at a few times per timeout instead of per packet.

    aiohttp keeps ``sock_read`` by cancelling and scheduling a timer for every packet it
    reads: for a stream, one per token, beside the relay's own work. Here the connection's
    own timer is turned off and the count of bytes read is looked at every quarter of the
    timeout: the engine is taken for silent once nothing came for the whole timeout (never
    sooner; at most half a timeout later). A silent engine then fails the read as aiohttp's own
    timer would (:class:`aiohttp.SocketTimeoutError`).
    """

    def __init__(self, resp: aiohttp.ClientResponse, timeout: float) -> None:
        self._content = resp.content
        self._timeout = timeout
        self._handle: asyncio.TimerHandle | None = None
        connection = resp.connection
        if connection is None or connection.protocol is None or self._content.is_eof():
            return  # the whole answer is in already: nothing left to wait for
        # The timer armed for the last packet read still runs; the next packet cancels it
        # and arms none.
        connection.protocol.read_timeout = None
        self._loop = asyncio.get_running_loop()
        self._seen = self._content.total_bytes
        self._since = self._loop.time()
        self._handle = self._loop.call_later(timeout / 4, self._look)

    def _look(self) -> None:
        content = self._content
        if content.is_eof() or content.exception() is not None:
            self._handle = None
            return
        now = self._loop.time()
        if content.total_bytes != self._seen:
            self._seen, self._since = content.total_bytes, now
        elif now - self._since >= self._timeout:
            self._handle = None
            content.set_exception(aiohttp.SocketTimeoutError("Timeout on reading data from socket"))
            return
        self._handle = self._loop.call_later(self._timeout / 4, self._look)

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None


def json_answer(raw: bytes) -> Any:
    """A JSON body as Python (an object keeps its bytes, for the relay to pass on as they came).

    :raises ValueError: when the body is not JSON.
    """
    if not raw.strip():
        return None
    value = json_module.loads(raw)
    return JSONAnswer(value, raw) if isinstance(value, dict) else value
