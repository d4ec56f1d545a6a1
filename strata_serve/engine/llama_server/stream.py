"""A streamed answer read off the event loop: a connection of its own, read in a thread.

Relayed on the event loop, each token of a stream cost a turn of the loop, aiohttp's HTTP
parser and a task's wake: about 0.25 ms of CPU a token, on the cores the engine decodes on
(on 2 cores the engine lost 1.2-1.8 times that share of a core). Read here, the thread a
token wakes runs no loop: it reads the engine's chunk and hands it over (``forward``), and
the relay writes it to its client from that same thread.

Every call still goes through the client's one policy for sending again
(:meth:`~strata_serve.engine.llama_server.client.EngineClient._send`); the errors of this
module's connection are told apart as aiohttp's are: a refused connection
(:class:`NotConnected`), one closed before any answer (:class:`http.client.RemoteDisconnected`),
and the rest.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import http.client
import json as json_module
import socket
import threading
import time
from typing import Any
from collections.abc import Awaitable, Callable
from urllib.parse import urlsplit

#: How long connecting to the engine may take (aiohttp's ``sock_connect`` for other calls).
CONNECT_TIMEOUT_S = 10.0
#: The most read at once from the engine: a token's event is a few hundred bytes.
READ_BYTES = 65536
#: How long closing a stream waits for its reading thread to leave (it is woken at once).
LEAVE_TIMEOUT_S = 5.0

#: What a lost stream connection raises (each told apart by the client's policy).
STREAM_ERRORS = (OSError, http.client.HTTPException)


class NotConnected(ConnectionError):
    """The engine could not be connected to: the call reached nothing."""


class Opened:
    """An answer whose head is read: its connection, and the first chunk of a stream under way."""

    def __init__(self, sock: socket.socket, resp: http.client.HTTPResponse, first: bytes | None) -> None:
        self.sock, self.resp, self.first, self.status = sock, resp, first, resp.status

    def close(self) -> None:
        self.resp.close()


class _Connection(http.client.HTTPConnection):
    """Sends a call in one write: http.client writes its head and its body apart, and
    the engine reads (and its thread wakes for) each."""

    _held: list[bytes] | None = None

    def endheaders(self, message_body: Any = None, *, encode_chunked: bool = False) -> None:
        self._held = []
        try:
            super().endheaders(message_body, encode_chunked=encode_chunked)
            data = b"".join(self._held)
        finally:
            self._held = None
        super().send(data)

    def send(self, data: Any) -> None:
        if self._held is not None and isinstance(data, (bytes, bytearray)):
            self._held.append(bytes(data))
        else:
            super().send(data)


class _SecureConnection(_Connection, http.client.HTTPSConnection):
    """:class:`_Connection` over TLS."""


class StreamOpener:
    """Opens one streamed call, blocking (in a thread); :meth:`cut` from the loop wakes it."""

    def __init__(self, url: str, path: str, body: bytes, headers: dict[str, str],
                 read_timeout: float | None) -> None:
        parts = urlsplit(url)
        self._https = parts.scheme == "https"
        self._host = parts.hostname or "127.0.0.1"
        self._port = parts.port
        self._target = (parts.path.rstrip("/") + path) or "/"
        self._body = body
        self._headers = {"Content-Type": "application/json", "Connection": "close",
                         "Accept": "text/event-stream", **headers}
        self._read_timeout = read_timeout
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._cut = False

    def open(self) -> Opened:
        """Connect, send, read the answer's head and, of a stream under way, its first
        chunk, in one go (llama-server sends its head at once, then reads the prompt: the
        relay does its own steps once the first token is there). Runs in a thread.

        :raises NotConnected: when no connection was made.
        """
        kind = _SecureConnection if self._https else _Connection
        conn = kind(self._host, self._port, timeout=CONNECT_TIMEOUT_S)
        try:
            conn.connect()
        except OSError as exc:
            conn.close()
            raise NotConnected(f"{type(exc).__name__}: {exc}") from exc
        sock = conn.sock
        assert sock is not None
        sock.settimeout(self._read_timeout)  # the engine may take minutes to read a prompt
        with self._lock:
            if self._cut:
                conn.close()
                raise ConnectionAbortedError("the call was given up")
            self._sock = sock
        try:
            conn.request("POST", self._target, body=self._body, headers=self._headers)
            resp = conn.getresponse()
            first = resp.read1(READ_BYTES) if resp.status == 200 else None
        except BaseException:
            self.cut()
            conn.close()
            raise
        # The answer holds the connection from here on (closed with it): http.client lets
        # go of one whose answer says ``Connection: close``, as llama-server's does.
        if conn.sock is not None:
            conn.sock = None
            sock.close()  # done once the answer is closed
        # From here the socket blocks: with a timeout of Python's own, each read would be
        # two system calls, a poll and the read. The reply keeps the timeout (its watch).
        # An answer read whole already (a body of known length) has closed it.
        if not resp.isclosed():
            sock.settimeout(None)
        return Opened(sock, resp, first)

    def cut(self) -> None:
        """Wake :meth:`open` (from any thread): its connection is shut, the engine's work stops."""
        with self._lock:
            self._cut = True
            sock = self._sock
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)


class StreamReply:
    """The engine's streamed answer: its status, then its bytes as they come.

    Read in threads of the client's ``pool``, on a connection of its own that the engine
    closes after the stream. ``read_timeout``: the longest the engine may stay silent
    mid-answer, kept by one watch (:meth:`_look`, a few times per timeout) rather than by the
    socket (which would poll before each read): a read waiting that long is woken, and
    fails as :class:`TimeoutError`; never sooner, at most a quarter of it later. ``gone``
    turns a lost connection into the backend's error.
    """

    def __init__(self, opened: Opened, pool: concurrent.futures.Executor,
                 gone: Callable[[BaseException], Awaitable[Exception]], read_timeout: float | None) -> None:
        self._sock = opened.sock
        self._resp = opened.resp
        self._first = opened.first
        self._pool = pool
        self._gone = gone
        self.status = opened.status
        self._lock = threading.Lock()
        self._reading = False
        self._closed = False
        self._timeout = read_timeout
        #: When the engine last gave a read something, or a read began (``time.monotonic``).
        self._last = time.monotonic()
        self._silent = False
        self._watch: asyncio.TimerHandle | None = None
        if read_timeout:
            self._watch = asyncio.get_running_loop().call_later(read_timeout / 4, self._look)

    def _look(self) -> None:
        timeout = self._timeout
        assert timeout is not None
        if self._closed:
            return
        if self._reading and time.monotonic() - self._last >= timeout:
            self._silent = True
            self._shut()  # the read wakes, and fails
            return
        self._watch = asyncio.get_running_loop().call_later(timeout / 4, self._look)

    def close(self) -> None:
        """Leave the answer: the connection is dropped (which stops the engine's work). A
        thread still reading is woken, and closes the connection as it leaves."""
        if self._watch is not None:
            self._watch.cancel()
        with self._lock:
            self._closed = True
            if self._reading:
                self._shut()
                return
        self._resp.close()

    def _shut(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)

    def _read(self, work: Callable[[], Any]) -> Any:
        """``work()`` on this connection, in a pool thread, never on a closed one."""
        with self._lock:
            if self._closed:
                raise ConnectionAbortedError("the stream was left")
            self._reading = True
            self._last = time.monotonic()
        try:
            return work()
        except STREAM_ERRORS as exc:
            if self._silent:
                raise TimeoutError(f"the engine said nothing for {self._timeout:g} s") from exc
            raise
        finally:
            with self._lock:
                self._reading = False
                if self._closed:
                    self._resp.close()

    async def _in_thread(self, work: Callable[[], Any]) -> Any:
        """``work()`` in a pool thread; a cancel wakes it, and waits until it has left (so
        that nothing it was handed runs after the caller goes on)."""
        job = self._pool.submit(self._read, work)
        try:
            return await asyncio.wrap_future(job)
        except asyncio.CancelledError:
            if not job.cancel():
                self._shut()
                concurrent.futures.wait((job,), timeout=LEAVE_TIMEOUT_S)
            raise
        except STREAM_ERRORS as exc:
            raise await self._gone(exc) from exc

    async def body(self) -> Any:
        """The whole body (for an error answer): JSON when it parses, else text."""
        first, self._first = self._first or b"", None
        raw: bytes = first + await self._in_thread(self._resp.read)
        text = raw.decode("utf-8", "replace")
        try:
            return json_module.loads(text)
        except ValueError:
            return text

    def chunks(self) -> StreamReply:
        """The bytes as they arrive, as many as have arrived at each step (a thread's hop each).

        :raises EngineUnavailable: when the engine goes away mid-answer.
        """
        return self

    def __aiter__(self) -> StreamReply:
        return self

    async def __anext__(self) -> bytes:
        chunk = self._first
        if chunk is not None:
            self._first = None
        else:
            chunk = await self._in_thread(self._read_some)
        if not chunk:
            raise StopAsyncIteration
        return chunk

    def _read_some(self) -> bytes:
        chunk = self._resp.read1(READ_BYTES)
        self._last = time.monotonic()
        return chunk

    async def forward(self, take: Callable[[bytes], bool]) -> bool:
        """Hand the answer's bytes to ``take`` as they arrive, in this stream's thread: no
        turn of the event loop for each chunk (most often one token). ``take`` runs in that
        thread, so it must not touch the event loop nor anything it owns; it returns True
        to stop taking (what is left is then read with :meth:`chunks`), and must not raise.
        When the caller is cancelled, ``take`` has run for the last time once this returns.

        Returns True when the answer ended, False when ``take`` stopped.

        :raises EngineUnavailable: when the engine goes away mid-answer.
        """
        read, now = self._resp.read1, time.monotonic
        first, self._first = self._first, None

        def pump() -> bool:
            chunk = first
            while True:
                if chunk is None:
                    chunk = read(READ_BYTES)
                    self._last = now()
                if not chunk:
                    return True
                if take(chunk):
                    return False
                chunk = None

        ended: bool = await self._in_thread(pump)
        return ended


async def open_stream(opener: StreamOpener, pool: concurrent.futures.Executor) -> Opened:
    """:meth:`StreamOpener.open` in a pool thread; a cancel cuts it short (and closes what
    it opened, should it have opened it by then)."""
    job = pool.submit(opener.open)
    try:
        return await asyncio.wrap_future(job)
    except asyncio.CancelledError:
        if not job.cancel():
            opener.cut()
            job.add_done_callback(_close_opened)
        raise


def _close_opened(job: concurrent.futures.Future[Opened]) -> None:
    if not job.cancelled() and job.exception() is None:
        job.result().close()


def request_body(json: Any) -> bytes:
    """A call's JSON body, as aiohttp would send it."""
    return json_module.dumps(json).encode()
