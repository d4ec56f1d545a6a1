"""The engine's plain calls on kept connections (``kept.py``): every shape of answer an HTTP
server may give, and every way a connection fails, told as the client's policy needs.

The engine here is a test double: a server that answers with the bytes each test gives,
for shapes llama-server never sends (chunks, an answer up to the close, a broken head) but
a proxy in front of an attached one may. The real engine's calls run through this path in
every other test that makes one (tests/test_engine_connections.py counts its connections).
"""

from __future__ import annotations

import asyncio
import http.client
import socket
import struct

import pytest

from strata_serve.engine.base import EngineUnavailable
from strata_serve.engine.llama_server import LlamaServer
from strata_serve.config import EngineSettings
from strata_serve.engine.llama_server import kept as kept_module
from strata_serve.engine.llama_server.kept import BadAnswer, KeptConnections
from strata_serve.engine.llama_server.stream import NotConnected


class ScriptedEngine:
    """Test double: answers each call with the next of ``answers``, on whichever connection
    it comes: bytes are written as they are, None closes the connection unanswered, ``(s,
    bytes)`` writes them after ``s`` seconds, ``("cut", bytes)`` writes them and closes,
    ``("reset", b"")`` resets the connection unanswered.
    ``GET /health`` is answered 200 without taking one. Records each call's head and body,
    and how many connections were made."""

    def __init__(self, *answers: bytes | tuple[float | str, bytes] | None) -> None:
        self.answers = list(answers)
        self.calls: list[tuple[bytes, bytes]] = []
        self.connections = 0
        self.server: asyncio.Server | None = None

    async def __aenter__(self) -> str:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length:")), 0)
                body = await reader.readexactly(length)
                if head.startswith(b"GET /health "):
                    writer.write(json_answer(b'{"status":"ok"}'))
                    continue
                self.calls.append((head, body))
                answer = self.answers.pop(0)
                if answer is None:
                    return
                close = False
                if isinstance(answer, tuple):
                    first, answer = answer
                    if first == "reset":  # closed with a reset, not a FIN (lingering 0 s)
                        writer.get_extra_info("socket").setsockopt(
                            socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                        writer.transport.abort()
                        return
                    if first == "cut":
                        close = True
                    else:
                        await asyncio.sleep(first)
                writer.write(answer)
                await writer.drain()
                if close or b"Connection: close" in answer or answer.startswith(b"HTTP/1.0"):
                    return
        except (asyncio.IncompleteReadError, ConnectionError, IndexError):
            pass
        finally:
            writer.close()


def json_answer(body: bytes, *extra: bytes) -> bytes:
    return (b"HTTP/1.1 200 OK\r\nContent-Type: application/json; charset=utf-8\r\n" + b"".join(extra)
            + b"Content-Length: %d\r\n\r\n" % len(body) + body)


async def test_a_call_sends_its_key_host_and_body_and_keeps_the_connection():
    double = ScriptedEngine(json_answer(b'{"a":1}'), json_answer(b'{"b":2}'), json_answer(b'{}'))
    async with double as url:
        calls = KeptConnections(url + "/prefix/", {"Authorization": "Bearer k"}, 5.0)
        first = await calls.call("POST", "/completion", b'{"x": 1}')
        second = await calls.call("GET", "/props", None)
        await calls.call("POST", "/slots/0?action=erase", None)
        calls.close()
    assert (first.status, first.content_type, first.body) == (200, "application/json", b'{"a":1}')
    assert second.body == b'{"b":2}'
    assert double.connections == 1, "the second call went out on the first one's connection"
    head, body = double.calls[0]
    assert head.startswith(b"POST /prefix/completion HTTP/1.1\r\n")
    assert b"\r\nAuthorization: Bearer k\r\n" in head and f"\r\nHost: {url[7:]}\r\n".encode() in head
    assert body == b'{"x": 1}'
    assert double.calls[1][0].startswith(b"GET /prefix/props HTTP/1.1\r\n")
    assert b"Content-Length" not in double.calls[1][0]
    # A POST without a body says so (a server may otherwise wait for one, or refuse it).
    assert b"\r\nContent-Length: 0\r\n" in double.calls[2][0]


async def test_an_answer_in_chunks_is_read_whole():
    chunked = (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
               b"4;ext=1\r\n{\"a\"\r\n3\r\n:12\r\n1\r\n}\r\n0\r\nX-Trailer: y\r\n\r\n")
    double = ScriptedEngine(chunked, json_answer(b"{}"))
    async with double as url:
        calls = KeptConnections(url, {}, 5.0)
        assert (await calls.call("GET", "/x", None)).body == b'{"a":12}'
        assert (await calls.call("GET", "/x", None)).body == b"{}"
        calls.close()
    assert double.connections == 1, "a chunked answer read to its end leaves the connection usable"


async def test_an_answer_up_to_the_close_and_one_that_says_close_are_not_kept():
    double = ScriptedEngine(b"HTTP/1.0 200 OK\r\nContent-Type: text/plain\r\n\r\nall of it",
                            json_answer(b"{}", b"Connection: close\r\n"), json_answer(b"[]"))
    async with double as url:
        calls = KeptConnections(url, {}, 5.0)
        up_to_close = await calls.call("GET", "/x", None)
        assert (up_to_close.content_type, up_to_close.body) == ("text/plain", b"all of it")
        assert (await calls.call("GET", "/x", None)).body == b"{}"
        assert (await calls.call("GET", "/x", None)).body == b"[]"
        calls.close()
    assert double.connections == 3


async def test_an_idle_connection_is_given_up_before_the_engine_closes_it(monkeypatch):
    double = ScriptedEngine(json_answer(b"{}"), json_answer(b"{}"), json_answer(b"{}"))
    async with double as url:
        calls = KeptConnections(url, {}, 5.0)
        await calls.call("GET", "/x", None)
        await calls.call("GET", "/x", None)
        assert double.connections == 1
        monkeypatch.setattr(kept_module, "KEEP_IDLE_S", 0.0)
        await calls.call("GET", "/x", None)
        calls.close()
    assert double.connections == 2


async def test_failures_are_told_apart_as_the_policy_needs():
    # Nothing listens: no connection was made.
    server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    server.close()
    await server.wait_closed()
    with pytest.raises(NotConnected):
        await KeptConnections(f"http://127.0.0.1:{port}", {}, 5.0).call("GET", "/x", None)
    # Closed before any byte of an answer: dropped (the policy may send it again).
    async with ScriptedEngine(None) as url:
        with pytest.raises(http.client.RemoteDisconnected):
            await KeptConnections(url, {}, 5.0).call("GET", "/x", None)
    # Reset before any answer: lost, as aiohttp tells it (part of an answer may have come).
    async with ScriptedEngine(("reset", b"")) as url:
        with pytest.raises(ConnectionResetError) as reset:
            await KeptConnections(url, {}, 5.0).call("GET", "/x", None)
        assert not isinstance(reset.value, http.client.RemoteDisconnected)
    # Closed within the answer: lost, never "dropped" (the engine may have done the work).
    cut = json_answer(b'{"long": "answer"}')[:-5]
    async with ScriptedEngine(("cut", cut)) as url:
        with pytest.raises(ConnectionResetError) as lost:
            await KeptConnections(url, {}, 5.0).call("GET", "/x", None)
        assert not isinstance(lost.value, http.client.RemoteDisconnected)
    # Not HTTP at all.
    async with ScriptedEngine(b"SSH-2.0-OpenSSH\r\n\r\n") as url:
        with pytest.raises(BadAnswer, match="not an HTTP answer"):
            await KeptConnections(url, {}, 5.0).call("GET", "/x", None)
    # Nothing within the read timeout.
    async with ScriptedEngine((2.0, json_answer(b"{}"))) as url:
        with pytest.raises(TimeoutError):
            await KeptConnections(url, {}, 0.2).call("GET", "/x", None)


async def test_a_call_given_up_under_way_never_leaves_its_connection_for_the_next():
    """A cancelled call's connection may carry its late answer: the next call must not read it."""
    double = ScriptedEngine((0.5, json_answer(b'{"late":1}')), json_answer(b'{"next":2}'))
    async with double as url:
        calls = KeptConnections(url, {}, 5.0)
        waiting = asyncio.ensure_future(calls.call("GET", "/slow", None))
        await asyncio.sleep(0.1)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert (await calls.call("GET", "/next", None)).body == b'{"next":2}'
        calls.close()
    assert double.connections == 2


async def test_the_engine_client_tells_a_broken_answer_as_the_engine_not_answering():
    """Through the backend: a 502 naming the engine, not an exception of the reader."""
    async with ScriptedEngine(json_answer(b'{"status":"ok"}'), b"garbage\r\n\r\n") as url:
        engine = LlamaServer(EngineSettings(url=url, start_timeout_s=10))
        try:
            await engine.start()
            with pytest.raises(EngineUnavailable, match="did not answer .BadAnswer"):
                await engine.request("GET", "/props")
        finally:
            await engine.stop()
