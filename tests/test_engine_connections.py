"""Connections to the engine: kept between calls, never reused once the engine closes them."""

import asyncio
import json
import sys
from pathlib import Path

import pytest

from strata_serve.api import SERVICE
from strata_serve.config import EngineSettings
from strata_serve.engine import EngineUnavailable, LlamaServer
from strata_serve.testing import chat_body
from tests.engine_doubles import read_request

TIME_WAIT = "06"


def closed_connections(port: int) -> int:
    """Connections to or from ``port`` closed lately (in TIME_WAIT, for a minute on Linux)."""
    count = 0
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        ports = {int(fields[1].rsplit(":", 1)[1], 16), int(fields[2].rsplit(":", 1)[1], 16)}
        if fields[3] == TIME_WAIT and port in ports:
            count += 1
    return count


@pytest.mark.skipif(sys.platform != "linux", reason="counts connections in /proc/net/tcp")
async def test_calls_keep_their_connection_and_streams_leave_none_behind(llama_server_factory):
    """Measured on llama-server: it keeps a connection 5 s idle and for 100 answers (the
    100th says ``Connection: close``), and closes it after every stream. 150 calls, a
    stream every tenth, all answered; only the streams' connections are closed."""
    engine = await llama_server_factory()
    port = int(engine.info.url.rsplit(":", 1)[1])
    before = closed_connections(port)
    streams = 0
    for n in range(150):
        if n % 10 == 5:
            async with engine.stream("/v1/chat/completions", chat_body(max_tokens=2, stream=True)) as reply:
                assert reply.status == 200
                assert b"[DONE]" in b"".join([chunk async for chunk in reply.chunks()])
            streams += 1
        else:
            status, answer = await engine.request("POST", "/v1/chat/completions", json=chat_body(max_tokens=1))
            assert status == 200, answer
    closed = closed_connections(port) - before
    # A connection per call (150) before; now one per stream, one past 100 answers, and slack.
    assert closed <= streams + 4, f"{closed} connections closed for {streams} streams"


class DroppingEngine:
    """Test double: an engine that answers the first call on a connection and closes the
    connection, unanswered, when a second call comes on it (what a real engine does when
    it closes an idle connection just as a call goes out on it, a race too rare to stage)."""

    def __init__(self) -> None:
        self.connections = self.dropped = 0
        #: How many of the next first calls on a connection are dropped unanswered too.
        self.drop_first = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        answered = 0
        try:
            while True:
                await read_request(reader)
                if answered or self.drop_first:
                    self.drop_first -= 0 if answered else 1
                    self.dropped += 1
                    return
                body = b'{"status": "ok"}'
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                             b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
                await writer.drain()
                answered += 1
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


async def test_a_call_on_a_kept_connection_closed_unanswered_is_sent_again():
    double = DroppingEngine()
    server = await asyncio.start_server(double.handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    engine = LlamaServer(EngineSettings(url=f"http://127.0.0.1:{port}", start_timeout_s=10))
    try:
        await engine.start()
        for _ in range(3):
            assert await engine.request("GET", "/props") == (200, {"status": "ok"})
        assert double.dropped >= 3, "the kept connection was reused, and dropped under the call"
        # A stream goes out on a connection of its own, never on a kept one...
        dropped, connections = double.dropped, double.connections
        async with engine.stream("/v1/chat/completions", chat_body(stream=True)) as reply:
            assert reply.status == 200 and await reply.body() == {"status": "ok"}
        assert (double.dropped, double.connections) == (dropped, connections + 1)
        # ... and follows the same policy: closed unanswered, it is sent once more.
        double.drop_first = 1
        async with engine.stream("/v1/chat/completions", chat_body(stream=True)) as reply:
            assert reply.status == 200 and await reply.body() == {"status": "ok"}
        assert (double.dropped, double.connections) == (dropped + 1, connections + 3)
        # A slot call to an engine we did not start is never sent twice: another engine
        # may be there now, which holds nothing to save.
        with pytest.raises(EngineUnavailable, match="did not answer"):
            await engine.save("x.bin")
    finally:
        await engine.stop()
        server.close()
        await server.wait_closed()


@pytest.mark.skipif(sys.platform != "linux", reason="counts connections in /proc/net/tcp")
async def test_requests_through_strata_keep_the_connection_to_the_engine(strata_client_factory):
    """The relay's own path (read, FIFO, hooks, answer), not only the backend's: 60
    non-streamed chat requests through strata-serve close at most a few connections to
    the engine (a connection per request would close 60)."""
    client = await strata_client_factory()
    engine = client.server.app[SERVICE].engine
    port = int(engine.info.url.rsplit(":", 1)[1])
    before = closed_connections(port)
    for _ in range(60):
        resp = await client.post("/v1/chat/completions", json=chat_body(max_tokens=1))
        assert resp.status == 200, await resp.text()
    closed = closed_connections(port) - before
    assert closed <= 3, f"{closed} connections to the engine closed for 60 requests"


async def test_a_json_answer_reaches_the_client_as_the_engine_wrote_it(strata_client_factory):
    """Not parsed and written out again: the engine's compact JSON (no spaces after ``:``
    and ``,``) arrives as it is, where Python's encoder would have added them."""
    client = await strata_client_factory()
    resp = await client.post("/v1/chat/completions", json=chat_body(max_tokens=1))
    body = await resp.read()
    assert resp.status == 200 and resp.content_type == "application/json" and resp.charset == "utf-8"
    answer = json.loads(body)
    assert answer["choices"][0]["message"]["role"] == "assistant" and "timings" in answer
    # One generated token is a character or a byte: it cannot hold either separator.
    assert b'": ' not in body and b'", "' not in body, body[:200]


async def test_a_stream_s_call_leaves_in_one_write(llama_server_factory, monkeypatch):
    """A stream's call (on a connection of its own, written by http.client, which sends a
    head and its body apart) leaves in one write: the engine reads it, and wakes for it,
    once. Every ``sendall`` of a socket is recorded (real engine)."""
    import socket

    sent: list[bytes] = []
    sendall = socket.socket.sendall

    def recorded(self, data, *args):
        sent.append(bytes(data))
        return sendall(self, data, *args)

    engine = await llama_server_factory()
    monkeypatch.setattr(socket.socket, "sendall", recorded)
    async with engine.stream("/v1/chat/completions", chat_body("one write", max_tokens=2, stream=True)) as reply:
        assert reply.status == 200
        assert b"[DONE]" in b"".join([chunk async for chunk in reply.chunks()])
    calls = [data for data in sent if data.startswith(b"POST ")]
    assert len(calls) == 1, sent
    assert b"\r\n\r\n" in calls[0] and b"one write" in calls[0].split(b"\r\n\r\n", 1)[1], calls[0]
