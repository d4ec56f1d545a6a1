"""The engine's plain calls (a body that comes whole, not a stream) on kept connections,
read on the event loop with little Python.

Through aiohttp's client, a 1-token call took about 1.4 ms of this process's CPU on a
2-core machine, and http.client in a thread as much; written and read here on the loop's
own streams, about 0.6 ms, and it was answered 0.7-1.3 ms sooner at the median (the same
engine, the calls taking turns; bench/results/engine-alone.md). On two cores the CPU is
the engine's and the client's too.

The engine is llama-server (or a proxy in front of one): an answer is HTTP/1.1 with a
``Content-Length``, or in chunks, or (HTTP/1.0, ``Connection: close``) up to the close.
The head is parsed here, in a few lines: h11 (a parser of its own, sans I/O) took 148 µs
for a call and its answer, where these lines take 7 µs (measured on the same machine).
Nothing is asked compressed. A connection goes back to the pool only when its answer was
read whole and the engine keeps it; it is given up after :data:`KEEP_IDLE_S` idle (the
engine closes one after 5 s) and at any error or cancellation on it.

A failed call is told as aiohttp's errors are, for the client's one policy of sending
again (:meth:`~strata_serve.engine.llama_server.client.EngineClient._send`): no
connection (:class:`~strata_serve.engine.llama_server.stream.NotConnected`), a connection
closed before any byte of the answer (:class:`http.client.RemoteDisconnected`), and the
rest (a timeout, a reset, a connection lost within the answer, an answer that is not HTTP).
"""

from __future__ import annotations

import asyncio
import http.client
import time
from urllib.parse import urlsplit

from strata_serve.engine.llama_server.stream import CONNECT_TIMEOUT_S, NotConnected

__all__ = ["KEEP_IDLE_S", "KeptConnections", "PlainAnswer"]

#: How long an idle connection is kept for the next call: well before llama-server closes
#: it (after 5 s idle, ``Keep-Alive: timeout=5``), so that no call goes out on one the
#: engine is closing at that moment.
KEEP_IDLE_S = 2.0
#: The most idle connections kept (calls at once beyond it close theirs after the answer).
KEEP_MOST = 16
#: The longest answer head read (aiohttp's limit is about as large).
HEAD_LIMIT = 1 << 20


class BadAnswer(http.client.HTTPException):
    """The engine's answer is not HTTP this reader takes."""


class PlainAnswer:
    """A whole answer: its status, its media type (lower case, without parameters), its body."""

    __slots__ = ("status", "content_type", "body")

    def __init__(self, status: int, content_type: str, body: bytes) -> None:
        self.status, self.content_type, self.body = status, content_type, body

    def close(self) -> None:
        """Nothing to free: the body is read, the connection given back or closed."""


class _Connection:
    __slots__ = ("reader", "writer", "idle_since")

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer, self.idle_since = reader, writer, 0.0

    def usable(self, now: float) -> bool:
        return (now - self.idle_since < KEEP_IDLE_S and not self.reader.at_eof()
                and not self.writer.is_closing())

    def close(self) -> None:
        self.writer.close()


class KeptConnections:
    """Plain calls to one engine over ``http://``, each on a kept connection or a new one."""

    def __init__(self, url: str, headers: dict[str, str], read_timeout: float | None) -> None:
        parts = urlsplit(url)
        if parts.scheme != "http":
            raise ValueError(f"not an http:// URL: {url}")
        self._host = parts.hostname or "127.0.0.1"
        self._port = parts.port or 80
        self._prefix = parts.path.rstrip("/")
        head = f"Host: {parts.netloc}\r\n" + "".join(f"{name}: {value}\r\n" for name, value in headers.items())
        self._head = head.encode("latin-1")
        self._read_timeout = read_timeout
        self._idle: list[_Connection] = []
        self._closed = False

    async def call(self, method: str, path: str, body: bytes | None) -> PlainAnswer:
        """Send one call and read its answer whole.

        :raises NotConnected: no connection could be made.
        :raises http.client.RemoteDisconnected: the connection closed before any answer.
        :raises OSError, TimeoutError, http.client.HTTPException: lost within the answer.
        """
        conn = self._take() or await self._connect()
        try:
            request = f"{method} {self._prefix + path} HTTP/1.1\r\n".encode("latin-1") + self._head
            if body is not None:
                request += b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body
            elif method in ("GET", "HEAD"):
                request += b"\r\n"
            else:
                request += b"Content-Length: 0\r\n\r\n"  # a POST without a body, as aiohttp sends one
            conn.writer.write(request)
            answer, keep = await self._read(conn.reader, method)
        except BaseException:
            conn.close()
            raise
        if keep and not self._closed and len(self._idle) < KEEP_MOST:
            conn.idle_since = time.monotonic()
            self._idle.append(conn)
        else:
            conn.close()
        return answer

    def close(self) -> None:
        """Close every idle connection; those of calls under way close after their answer."""
        self._closed = True
        idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()

    def _take(self) -> _Connection | None:
        now = time.monotonic()
        while self._idle:
            conn = self._idle.pop()  # the last used: the least likely to be closing
            if conn.usable(now):
                return conn
            conn.close()
        return None

    async def _connect(self) -> _Connection:
        try:
            async with asyncio.timeout(CONNECT_TIMEOUT_S):
                reader, writer = await asyncio.open_connection(self._host, self._port, limit=HEAD_LIMIT)
        except OSError as exc:
            raise NotConnected(f"{type(exc).__name__}: {exc}") from exc
        return _Connection(reader, writer)

    async def _read(self, reader: asyncio.StreamReader, method: str) -> tuple[PlainAnswer, bool]:
        """The answer, and whether its connection may take another call."""
        timeout = self._read_timeout
        try:
            async with asyncio.timeout(timeout):
                head = await reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError as exc:
            if not exc.partial:
                raise http.client.RemoteDisconnected("the engine closed the connection without an answer") from None
            raise BadAnswer(f"the answer's head ended early ({len(exc.partial)} bytes)") from None
        except asyncio.LimitOverrunError:
            raise BadAnswer(f"the answer's head is longer than {HEAD_LIMIT} bytes") from None
        # A connection reset (ConnectionResetError) goes on as it is: lost, as aiohttp tells
        # one, since part of an answer may have come before it.
        version, status, fields = _parse_head(head)
        connection = fields.get("connection", "").lower()
        keep = connection != "close" if version == "HTTP/1.1" else connection == "keep-alive"
        try:
            if method == "HEAD" or status in (204, 304):
                body = b""
            elif "chunked" in fields.get("transfer-encoding", "").lower():
                body = await _read_chunks(reader, timeout)
            elif "content-length" in fields:
                length = _length(fields["content-length"])
                async with asyncio.timeout(timeout):
                    body = await reader.readexactly(length)
            else:
                keep = False
                async with asyncio.timeout(timeout):
                    body = await reader.read()
        except asyncio.IncompleteReadError as exc:
            raise ConnectionResetError(f"the engine closed the connection within its answer "
                                       f"({len(exc.partial)} bytes read)") from None
        except asyncio.LimitOverrunError:
            raise BadAnswer("a chunk's size line is too long") from None
        content_type = fields.get("content-type", "application/octet-stream").split(";", 1)[0].strip().lower()
        return PlainAnswer(status, content_type, body), keep


def _parse_head(head: bytes) -> tuple[str, int, dict[str, str]]:
    """The status line's version and status, and the fields by lower-case name (a
    repeated one's values joined by commas)."""
    lines = head.decode("latin-1").split("\r\n")
    status_line = lines[0].split(" ", 2)
    if len(status_line) < 2 or not status_line[0].startswith("HTTP/") or not status_line[1].isdigit():
        raise BadAnswer(f"not an HTTP answer: {lines[0][:80]!r}")
    fields: dict[str, str] = {}
    for line in lines[1:]:
        if not line:
            continue
        name, sep, value = line.partition(":")
        if not sep:
            raise BadAnswer(f"a header line without a colon: {line[:80]!r}")
        name, value = name.strip().lower(), value.strip()
        fields[name] = f"{fields[name]}, {value}" if name in fields else value
    return status_line[0], int(status_line[1]), fields


def _length(text: str) -> int:
    values = {v.strip() for v in text.split(",")}
    if len(values) != 1 or not (value := values.pop()).isdigit():
        raise BadAnswer(f"a Content-Length that is not one number: {text[:40]!r}")
    return int(value)


async def _read_chunks(reader: asyncio.StreamReader, timeout: float | None) -> bytes:
    parts: list[bytes] = []
    async with asyncio.timeout(timeout) as deadline:
        while True:
            line = await reader.readuntil(b"\r\n")
            try:
                size = int(line.split(b";", 1)[0].strip(), 16)
            except ValueError:
                raise BadAnswer(f"a chunk's size is not a number: {line[:40]!r}") from None
            if size == 0:
                while await reader.readuntil(b"\r\n") != b"\r\n":
                    pass  # trailers: none of them is needed
                return b"".join(parts)
            chunk = await reader.readexactly(size + 2)
            if chunk[-2:] != b"\r\n":
                raise BadAnswer("a chunk does not end where its size says")
            parts.append(chunk[:-2])
            if timeout is not None:
                # the timeout is for each read, as aiohttp's ``sock_read``: one more chunk came
                deadline.reschedule(asyncio.get_running_loop().time() + timeout)
