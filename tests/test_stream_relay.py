"""The stream relay's own guarantees, against a test double of the engine over real HTTP.

A stream is read on a connection of its own, in a thread (``StreamReply``), and its bytes
handed over there (``StreamReply.forward``), with no turn of the event loop per chunk.
Every byte still arrives, in order, however the engine's writes were cut; a relay that
stops taking gets the rest intact; an engine that goes silent mid-stream is still given
up after ``engine.request_timeout_s``, never sooner.
"""

import asyncio
import contextlib
import json
import socket
import threading
import time

import pytest

from strata_serve.api.formats import OPENAI, StreamSeen
from strata_serve.config import EngineSettings
from strata_serve.engine import EngineUnavailable, LlamaServer
from strata_serve.testing import chat_body
from tests.engine_doubles import read_request

#: The engine's read timeout in these tests: short, but far above a loaded machine's hiccups.
READ_TIMEOUT_S = 1.5


def event(data: dict | str) -> bytes:
    text = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {text}\n\n".encode()


def http_chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


class SilentEngine:
    """Test double: answers a stream with ``tokens`` events, one every ``pause_s``, then
    says nothing more, holding the connection open, until the client leaves (a ``GET``,
    as the backend's start sends, gets an empty JSON object)."""

    def __init__(self, tokens: int = 3, pause_s: float = 0.0) -> None:
        self.tokens = tokens
        self.pause_s = pause_s
        self.left = asyncio.Event()

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if (await read_request(reader)).startswith(b"GET "):  # not a stream: ``left`` is not about it
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 2\r\nConnection: close\r\n\r\n{}")
            await writer.drain()
            writer.close()
            return
        try:
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                         b"Transfer-Encoding: chunked\r\n\r\n")
            for n in range(self.tokens):
                writer.write(http_chunk(event({"choices": [{"index": 0, "delta": {"content": str(n)},
                                                             "finish_reason": None}]})))
                await writer.drain()
                await asyncio.sleep(self.pause_s)
            await reader.read()  # silent until the client closes its end
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            self.left.set()
            writer.close()


async def engine_on(double: "SilentEngine | SplitEngine") -> tuple[LlamaServer, asyncio.Server]:
    server = await asyncio.start_server(double.handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    engine = LlamaServer(EngineSettings(url=f"http://127.0.0.1:{port}", start_timeout_s=10,
                                        request_timeout_s=READ_TIMEOUT_S))
    return engine, server


async def test_an_engine_silent_mid_stream_is_given_up_after_the_read_timeout_not_sooner():
    # Tokens come for longer than the timeout in all: only silence counts, not the stream's length.
    double = SilentEngine(tokens=6, pause_s=READ_TIMEOUT_S / 3)
    engine, server = await engine_on(double)
    try:
        await engine.start()
        got = b""
        async with engine.stream("/v1/chat/completions", chat_body(stream=True)) as reply:
            assert reply.status == 200
            # Bounded: an engine never given up would hold the test forever.
            async with asyncio.timeout(READ_TIMEOUT_S * 20):
                with pytest.raises(EngineUnavailable, match="did not answer"):
                    async for chunk in reply.chunks():
                        got += chunk
                        last = time.monotonic()
        silent = time.monotonic() - last
        assert got.count(b"data: ") == 6, "every token sent before the silence was relayed"
        assert silent >= READ_TIMEOUT_S, f"given up after {silent:.2f} s of silence, before the read timeout"
        async with asyncio.timeout(30):
            await double.left.wait()  # leaving the stream dropped the engine's connection
    finally:
        await engine.stop()
        server.close()
        await server.wait_closed()


class SplitEngine:
    """Test double: answers a stream with ``pieces``, each in its own write (and packet),
    then ends it."""

    def __init__(self, pieces: list[bytes]) -> None:
        self.pieces = pieces

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await read_request(reader)
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                         b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n")
            for piece in self.pieces:
                writer.write(http_chunk(piece))
                await writer.drain()
                await asyncio.sleep(0.02)  # shapes the packets; nothing waits on it
            writer.write(b"0\r\n\r\n")
            await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


TIMINGS = {"cache_n": 40, "prompt_n": 7, "predicted_n": 3}
LAST = event({"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}], "timings": TIMINGS})
STREAM = b"".join(event({"choices": [{"index": 0, "delta": {"content": t}, "finish_reason": None}]})
                  for t in "abc") + LAST + event("[DONE]")


def pieces_of(stream: bytes) -> list[bytes]:
    """The stream cut in odd places: the final event's numbers in three pieces."""
    start = stream.index(LAST)
    cuts = [7, start - 5, start + 20, start + 60, len(stream) - 4]
    return [stream[a:b] for a, b in zip([0, *cuts], [*cuts, len(stream)])]


async def test_every_byte_passes_in_order_and_the_numbers_split_across_packets_are_read():
    engine, server = await engine_on(SplitEngine(pieces_of(STREAM)))
    taken: list[bytes] = []
    try:
        await engine.start()
        async with engine.stream("/v1/chat/completions", chat_body(stream=True)) as reply:
            ended = await reply.forward(lambda chunk: taken.append(chunk) or False)
    finally:
        await engine.stop()
        server.close()
        await server.wait_closed()
    assert ended and b"".join(taken) == STREAM
    assert len(taken) >= 4, "the engine's writes arrived as one piece: the split was not tested"
    seen = StreamSeen(OPENAI, "timings")
    for chunk in taken:
        seen.feed(chunk)
    assert seen.timings == TIMINGS and seen.finished and seen.error is None


async def test_a_relay_that_stops_taking_gets_the_rest_chunk_by_chunk_intact():
    engine, server = await engine_on(SplitEngine(pieces_of(STREAM)))
    taken: list[bytes] = []
    try:
        await engine.start()
        async with engine.stream("/v1/chat/completions", chat_body(stream=True)) as reply:
            ended = await reply.forward(lambda chunk: taken.append(chunk) or True)  # stops at once
            rest = [chunk async for chunk in reply.chunks()]
    finally:
        await engine.stop()
        server.close()
        await server.wait_closed()
    assert not ended and len(taken) == 1
    assert b"".join(taken + rest) == STREAM


def test_the_numbers_in_a_final_event_split_across_chunks_are_read():
    """The engine's last event (its numbers) cut anywhere, even inside a marker the fast path looks for."""
    timings = {"cache_n": 40, "prompt_n": 7, "predicted_n": 3}
    last = event({"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}], "timings": timings})
    stream = event({"choices": [{"index": 0, "delta": {"content": "a"}, "finish_reason": None}]}) + last
    stream += event("[DONE]")
    for cut in range(len(stream) - len(last), len(stream)):
        seen = StreamSeen(OPENAI, "timings")
        seen.feed(stream[:cut])
        seen.feed(stream[cut:])
        assert seen.timings == timings and seen.finished and seen.error is None, cut


async def test_an_http_1_0_client_gets_the_stream_s_bare_bytes(strata_client_factory):
    """A stream to an HTTP/1.0 client has no chunked framing (HTTP/1.1's): its body is the
    events alone, up to the connection's close. Written in HTTP/1.1's framing, the chunks'
    sizes would reach the client as lines of the stream (real engine: the relay's fast path
    is the llama-server backend's)."""
    client = await strata_client_factory()
    payload = json.dumps(chat_body("Count to twenty", max_tokens=24, stream=True)).encode()
    reader, writer = await asyncio.open_connection(client.host, client.port)
    writer.write(b"POST /v1/chat/completions HTTP/1.0\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(payload), payload))
    await writer.drain()
    async with asyncio.timeout(60):
        raw = await reader.read(-1)  # to the connection's close
    writer.close()
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.0 200"), head[:200]
    assert b"chunked" not in head.lower()
    lines = [line for line in body.split(b"\n") if line.strip()]
    assert len(lines) > 5  # the role, the tokens, the end
    assert all(line.startswith(b"data: ") for line in lines), [line for line in lines if not line.startswith(b"data: ")][:3]
    assert lines[-1] == b"data: [DONE]"


class LingeringEngine:
    """Test double: llama-server's few calls answered, and a chat stream whose last event
    (``[DONE]``) is followed by nothing: neither the chunked end nor the connection's close,
    until ``release`` is set (llama-server closes a stream's connection a little after its
    last event; this one holds it, so that waiting for it would show)."""

    def __init__(self, stream: bytes = STREAM) -> None:
        self.stream = stream
        self.release = asyncio.Event()
        self.streams = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await read_request(reader)
                if not head.startswith(b"POST /v1/chat/completions"):
                    body = b"[]" if head.startswith(b"GET /slots") else b'{"status":"ok"}'
                    writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
                    await writer.drain()
                    continue
                self.streams += 1
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                             b"Transfer-Encoding: chunked\r\n\r\n" + http_chunk(self.stream))
                await writer.drain()
                await asyncio.wait_for(self.release.wait(), 30)
                writer.write(b"0\r\n\r\n")
                await writer.drain()
                return
        except (asyncio.IncompleteReadError, ConnectionError, TimeoutError):
            pass
        finally:
            writer.close()


async def test_a_stream_ends_for_its_client_at_its_last_event_not_at_the_engines_close(strata_client_factory):
    """The client's stream ends once ``[DONE]`` passed whole, while the engine still holds its
    connection: llama-server closes it a little after its last event, and waiting for that
    was most of what a streamed 1-token request added. Nothing is lost: every event, the
    engine's numbers read."""
    double = LingeringEngine()
    engine, server = await engine_on(double)
    try:
        client = await strata_client_factory(engine=engine)
        resp = await client.post("/v1/chat/completions", json=chat_body(stream=True))
        assert resp.status == 200
        # Bounded below the double's own 30 s: a relay that waits for the engine's end fails here.
        async with asyncio.timeout(15):
            body = await resp.read()
        assert not double.release.is_set() and double.streams == 1, "ended while the engine held its connection"
        assert body == STREAM, body
        double.release.set()
        await client.close()
    finally:
        double.release.set()
        server.close()
        await server.wait_closed()


async def test_a_stream_s_tokens_reach_the_client_while_the_event_loop_is_held(strata_client_factory):
    """A stream's chunks are written to the client from the thread that reads them from the
    engine: no turn of the event loop for each token. Held here for a second (a stand-in for
    whatever else it runs), the loop holds none of them back. The client is a raw socket read
    in a thread of its own (real engine)."""
    client = await strata_client_factory()
    payload = json.dumps(chat_body("Count to a thousand", max_tokens=3000, ignore_eos=True,
                                   stream=True)).encode()
    sock = socket.create_connection((client.host, client.port), timeout=60)
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: %s:%d\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (client.host.encode(), client.port, len(payload), payload))
    arrivals: list[float] = []  # when each read of the client's got bytes
    stop = threading.Event()

    def read() -> None:
        with contextlib.suppress(OSError):
            while not stop.is_set() and sock.recv(65536):
                arrivals.append(time.monotonic())

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 60
        while len(arrivals) < 5:  # the tokens are flowing
            assert reader.is_alive(), "the server ended the answer"
            assert time.monotonic() < deadline, "the stream did not begin in 60 s"
            await asyncio.sleep(0.01)
        held_from = time.monotonic()
        time.sleep(1.0)  # the event loop held: nothing else runs on it meanwhile
        held_to = time.monotonic()
        during = [t for t in arrivals if held_from + 0.1 < t < held_to]
        assert len(during) >= 5, f"{len(during)} reads got bytes while the event loop was held"
    finally:
        stop.set()
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)  # wakes the reader's recv
        reader.join(10)
        sock.close()


async def test_stopping_the_engine_wakes_a_stream_s_reading_thread():
    """A stream still open when the engine's client closes (a stop) has its thread woken at
    once, not left blocked until the read timeout (which would hold the process's exit)."""
    double = SilentEngine(tokens=1)
    server = await asyncio.start_server(double.handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    engine = LlamaServer(EngineSettings(url=f"http://127.0.0.1:{port}", start_timeout_s=10,
                                        request_timeout_s=120))
    try:
        await engine.start()
        async with engine.stream("/v1/chat/completions", chat_body(stream=True)) as reply:
            chunks = reply.chunks()
            assert b"data: " in await anext(chunks)
            reading = asyncio.create_task(anext(chunks))  # the engine says nothing more
            await asyncio.sleep(0.3)
            assert not reading.done()
            began = time.monotonic()
            await engine.stop()
            with pytest.raises(EngineUnavailable):
                await asyncio.wait_for(reading, 30)
            assert time.monotonic() - began < 10, "the read waited for its timeout"
        async with asyncio.timeout(30):
            await double.left.wait()  # the engine's connection was dropped
    finally:
        await engine.stop()
        server.close()
        await server.wait_closed()
