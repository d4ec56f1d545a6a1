"""A client that stops reading its answer costs its own connection only (#38, defect 2).

The engine's turn ends when the engine's answer ends: the answer is buffered for a client
slower than the engine, another client's request is answered meanwhile, and what the slow
client has not read once the turn is over leaves within ``server.client_write_timeout_s``,
or its connection is closed. Real engine, real sockets: the slow reader is a raw socket
with a tiny receive buffer that reads its headers (a stream) or nothing at all, and then
stops, while the answer is made large with ``logprobs``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import time
from typing import Any

import strata_serve
from strata_serve.api import SERVICE
from strata_serve.testing import chat_body

#: Tokens of the slow reader's answer, each with its 1,000 likeliest candidates: about
#: 7 MB, more than twice what the kernel's socket buffers took here.
SLOW_TOKENS = 300
#: How long the engine may take to write the slow reader's answer (15 s on a busy machine,
#: 140 s on one busier still).
SLOW_TURN_BOUND_S = 240
#: How long the other client may take once the slow reader's turn has ended.
OTHER_BOUND_S = 60


class Admitted:
    """Notes each request as its turn begins, and how each ended."""

    strata_name = "admitted"

    def __init__(self) -> None:
        self.first = asyncio.Event()
        self.outcomes: list[Any] = []

    @strata_serve.hookimpl
    def pre_request(self, request: Any) -> None:
        self.first.set()

    @strata_serve.hookimpl
    def post_request(self, outcome: Any) -> None:
        self.outcomes.append(outcome)


def large_answer(stream: bool) -> dict[str, Any]:
    return chat_body("Tell me a very long story about the sea", max_tokens=SLOW_TOKENS, ignore_eos=True,
                     logprobs=True, top_logprobs=1000, stream=stream)


async def slow_reader(client: Any, body: dict[str, Any], *, read_headers: bool) -> socket.socket:
    """A raw connection with a tiny receive buffer: it sends ``body``, reads its headers or
    nothing, and stops reading."""
    loop = asyncio.get_running_loop()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    host, port = client.server.host, client.server.port
    await loop.sock_connect(sock, (host, port))
    payload = json.dumps(body).encode()
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}:{port}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n")
    await loop.sock_sendall(sock, head.encode() + payload)
    if read_headers:
        seen = b""
        while not seen.endswith(b"\r\n\r\n"):
            byte = await asyncio.wait_for(loop.sock_recv(sock, 1), 30)
            assert byte, "the server closed the connection before its headers"
            seen += byte
        assert seen.startswith(b"HTTP/1.1 200"), seen
    return sock


async def until(condition: Any, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "the condition did not hold in time"
        await asyncio.sleep(0.05)


async def the_rest_of_the_stream(sock: socket.socket) -> bytes:
    """What the slow reader gets once it reads again, up to its stream's last chunk."""
    loop = asyncio.get_running_loop()
    received = b""
    async with asyncio.timeout(60):
        while not received.endswith(b"0\r\n\r\n"):
            data = await loop.sock_recv(sock, 1 << 16)
            assert data, "the stream was cut"
            received += data
    return received


def assert_whole_stream(received: bytes) -> None:
    """Every token's event whole and in its place, though part of the stream was written from
    the engine's thread and the rest, once the client's socket was full, by the event loop."""
    assert len(received) > 1_000_000  # far more than the socket buffers took
    events = [line[6:] for line in dechunked(received).split(b"\n") if line.startswith(b"data: ")]
    assert events[-1] == b"[DONE]"
    tokens = [entry for data in events[:-1]
              for choice in json.loads(data).get("choices") or []
              for entry in (choice.get("logprobs") or {}).get("content") or []]
    assert len(tokens) == SLOW_TOKENS, f"{len(tokens)} tokens' events of {SLOW_TOKENS}"


def dechunked(body: bytes) -> bytes:
    """An HTTP/1.1 chunked body's bytes; fails on framing that does not add up."""
    out, at = [], 0
    while True:
        end = body.index(b"\r\n", at)
        size = int(body[at:end], 16)
        if not size:
            assert body[end:] == b"\r\n\r\n", body[end:end + 100]
            return b"".join(out)
        out.append(body[end + 2:end + 2 + size])
        at = end + 2 + size
        assert body[at:at + 2] == b"\r\n", f"a chunk's framing is broken at byte {at}"
        at += 2


async def read_to_the_end(sock: socket.socket, timeout: float) -> bytes:
    """Read everything until the server's end of the connection."""
    loop = asyncio.get_running_loop()
    received = b""
    async with asyncio.timeout(timeout):
        while True:
            try:
                data = await loop.sock_recv(sock, 1 << 16)
            except ConnectionResetError:
                return received
            if not data:
                return received
            received += data


async def test_a_stream_whose_client_stops_reading_does_not_hold_the_fifo(strata_client_factory,
                                                                         strata_settings_factory):
    admitted = Admitted()
    settings = strata_settings_factory(server={"client_write_timeout_s": 120})
    client = await strata_client_factory(admitted, settings=settings)
    service = client.server.app[SERVICE]
    sock = await slow_reader(client, large_answer(stream=True), read_headers=True)
    try:
        await asyncio.wait_for(admitted.first.wait(), 30)
        other = asyncio.create_task(client.post("/v1/chat/completions", json=chat_body("Another client", max_tokens=4)))
        # The slow reader's turn ends with the engine's answer, its client reading nothing:
        # the answer ran to its end, and its post_request ran, with the engine's numbers.
        await until(lambda: admitted.outcomes, SLOW_TURN_BOUND_S)
        slow = admitted.outcomes[0]
        assert slow.status == "ok" and slow.timings is not None and slow.timings.generated == SLOW_TOKENS
        # The request queued behind it is answered.
        reply = await asyncio.wait_for(other, OTHER_BOUND_S)
        assert reply.status == 200, await reply.text()
        assert (await reply.json())["choices"][0]["message"]["content"] is not None
        # Nothing holds the FIFO while the slow reader's answer waits for it (the write timeout is long).
        await until(lambda: service.fifo.idle, 30)
        # Once it reads again, it gets its whole stream, ended as a stream ends.
        assert_whole_stream(await the_rest_of_the_stream(sock))
    finally:
        sock.close()


async def test_a_plain_answer_nobody_reads_is_cut_after_the_write_timeout(strata_client_factory,
                                                                          strata_settings_factory, caplog):
    caplog.set_level(logging.WARNING, logger="strata_serve.api")
    admitted = Admitted()
    settings = strata_settings_factory(server={"client_write_timeout_s": 2})
    client = await strata_client_factory(admitted, settings=settings)
    sock = await slow_reader(client, large_answer(stream=False), read_headers=False)
    try:
        await asyncio.wait_for(admitted.first.wait(), 30)
        other = asyncio.create_task(client.post("/v1/chat/completions", json=chat_body("Another client", max_tokens=4)))
        await until(lambda: admitted.outcomes, SLOW_TURN_BOUND_S)
        assert admitted.outcomes[0].status == "ok"
        reply = await asyncio.wait_for(other, OTHER_BOUND_S)
        assert reply.status == 200, await reply.text()

        def cut() -> bool:
            return any("did not read its answer within 2 s" in r.getMessage() for r in caplog.records)

        await until(cut, 30)
        # Its connection was closed: what the kernel had taken is all it gets, not the answer.
        received = await read_to_the_end(sock, 30)
        head, _, body = received.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200"), head
        length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                          if line.lower().startswith(b"content-length:")))
        assert length > 3_000_000 and 0 < len(body) < length
    finally:
        sock.close()


class Sent:
    """Notes, for each request, whether it was sent ahead of its turn, and its outcome; lets
    every request go ahead (a plugin acting around requests that says nothing says no)."""

    strata_name = "sent"

    def __init__(self) -> None:
        self.ended: dict[str, tuple[bool, Any]] = {}

    @strata_serve.hookimpl
    def may_go_ahead(self) -> bool:
        return True

    @strata_serve.hookimpl
    def post_request(self, request: Any, outcome: Any) -> None:
        self.ended[request.body["messages"][-1]["content"]] = (request.sent_ahead, outcome)


async def test_a_stream_sent_ahead_from_the_line_whose_client_stops_reading_does_not_hold_the_fifo(
        strata_client_factory, strata_settings_factory, caplog):
    """The slow reader's request waits in line, and is sent to the engine ahead of its turn
    by the request before it (strata_serve/service.py, ``_send_next_ahead``): its answer is
    written from a task of its own, not its handler's, and is held for its client all the same."""
    caplog.set_level(logging.DEBUG, logger="strata_serve.service")
    sent = Sent()
    settings = strata_settings_factory(server={"client_write_timeout_s": 120})
    client = await strata_client_factory(sent, settings=settings)
    service = client.app[SERVICE]

    def went_ahead() -> int:
        return sum("ahead of its turn" in record.getMessage() for record in caplog.records)

    async def answering() -> bool:
        return any(report.processing for report in await service.engine.slots())

    # A story long enough to be told however busy the machine; its client leaves once the
    # slow reader is in line.
    story = await client.post("/v1/chat/completions", json=chat_body(
        "Tell a long story about a river", max_tokens=3000, ignore_eos=True, stream=True))
    assert story.status == 200
    deadline = time.monotonic() + 60
    while not await answering():
        assert time.monotonic() < deadline, "the engine did not begin the story within 60 s"
        await asyncio.sleep(0.05)
    # One request goes ahead at its arrival, behind the story; the slow reader's, behind it,
    # waits in line.
    short = asyncio.create_task(client.post("/v1/chat/completions", json=chat_body(
        "A short question", max_tokens=8, stream=True)))
    await until(lambda: went_ahead() == 1, 60)
    slow = asyncio.create_task(slow_reader(client, large_answer(stream=True), read_headers=True))
    await until(lambda: service.fifo.waiting == 2, 60)  # the short one, ahead, and the slow reader
    assert went_ahead() == 1 and not story.content.at_eof(), "the slow reader waits in line"
    story.close()
    assert (await asyncio.wait_for(short, 60)).status == 200
    sock = await asyncio.wait_for(slow, SLOW_TURN_BOUND_S)  # its headers came: the engine runs it
    try:
        assert went_ahead() == 2, "the slow reader was sent ahead from the line"
        other = asyncio.create_task(client.post("/v1/chat/completions", json=chat_body("Another client", max_tokens=4)))
        # Its turn ends with the engine's answer, its client reading nothing.
        await until(lambda: "Tell me a very long story about the sea" in sent.ended, SLOW_TURN_BOUND_S)
        ahead, outcome = sent.ended["Tell me a very long story about the sea"]
        assert ahead, "it was sent ahead of its turn"
        assert outcome.status == "ok" and outcome.timings is not None and outcome.timings.generated == SLOW_TOKENS
        reply = await asyncio.wait_for(other, OTHER_BOUND_S)
        assert reply.status == 200, await reply.text()
        await until(lambda: service.fifo.idle, 30)
        # Once it reads again, it gets its whole stream, ended as a stream ends.
        assert_whole_stream(await the_rest_of_the_stream(sock))
    finally:
        sock.close()
