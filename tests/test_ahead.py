"""A request that needs no switch reaches the engine before the answer before it ends
(``strata_serve/ahead.py``), on the in-memory engine: the ordering is the core's.

The engine here runs one request at a time, as a one-slot llama-server does, and holds
its first answer until the test lets it go: what reached it meanwhile is what the service
sent ahead of its turn.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

import pytest

import strata_serve
from strata_serve.api import SERVICE
from strata_serve.engine.base import EngineUnavailable
from strata_serve.memory_engine import MemoryEngine, MemoryStream
from strata_serve.testing import chat_body, until, until_idle

CHAT = ("/v1/chat/completions", "/v1/completions")


class OneAtATime(MemoryEngine):
    """The in-memory engine running one request at a time, its first answer held until ``go``."""

    def __init__(self) -> None:
        super().__init__(None)
        self.line = asyncio.Lock()
        self.go = asyncio.Event()
        #: The last message of each request, as it reached the engine and as it ran.
        self.arrived: list[str] = []
        self.ran: list[str] = []

    async def request(self, method: str, path: str, json: Any = None, **kwargs: Any) -> tuple[int, Any]:
        if method != "POST" or path not in CHAT:
            return await super().request(method, path, json, **kwargs)
        text = json["messages"][-1]["content"]
        self.arrived.append(text)
        async with self.line:
            await self.wait_to_run()
            self.ran.append(text)
            return await super().request(method, path, json, **kwargs)

    async def wait_to_run(self) -> None:
        if not self.ran:
            await self.go.wait()


class Steps:
    """Records the hooks' order; agrees to a request going ahead when told to."""

    strata_name = "steps"

    def __init__(self, agree: bool) -> None:
        self.agree = agree
        self.events: list[tuple[str, str]] = []
        self.asked: list[tuple[str | None, str | None]] = []
        #: The task serving each request, by its last message.
        self.tasks: dict[str, asyncio.Task] = {}

    @strata_serve.hookimpl
    def on_arrival(self, request):
        task = asyncio.current_task()
        assert task is not None
        self.tasks[request.body["messages"][-1]["content"]] = task

    @strata_serve.hookimpl
    def may_go_ahead(self, request, held):
        self.asked.append((request.conversation_key, held.key))
        return self.agree

    @strata_serve.hookimpl
    def pre_request(self, request):
        self.events.append(("pre", request.body["messages"][-1]["content"]))

    @strata_serve.hookimpl
    def post_request(self, request, outcome):
        self.events.append(("post", request.body["messages"][-1]["content"]))


async def _two_requests(client, engine: OneAtATime):
    first = asyncio.create_task(client.post("/v1/chat/completions", json=chat_body("first", max_tokens=3)))
    await until(lambda: engine.arrived == ["first"], what="the first request at the engine")
    second = asyncio.create_task(client.post("/v1/chat/completions",
                                              json=chat_body("second", max_tokens=3, stream=True)))
    return first, second


async def test_a_request_every_plugin_lets_go_ahead_reaches_the_engine_before_the_answer_before_it_ends(
        strata_client_factory):
    engine, steps = OneAtATime(), Steps(agree=True)
    client = await strata_client_factory(steps, engine=engine)
    service = client.app[SERVICE]
    first, second = await _two_requests(client, engine)
    await until(lambda: engine.arrived == ["first", "second"], what="the second request at the engine, ahead")
    assert engine.ran == [] and not first.done(), "the first answer is still held"
    assert steps.events == [("pre", "first")], "the second's pre_request waits for its turn"
    first_key = service.slots[0].key
    assert steps.asked == [(steps.asked[0][0], first_key)], "asked with what the slot holds"
    engine.go.set()
    replies = [await first, await second]
    assert [reply.status for reply in replies] == [200, 200]
    assert "[DONE]" in await replies[1].text()
    await until_idle(service)
    # The engine ran them in order; the hooks kept theirs, each in its request's turn.
    assert engine.ran == ["first", "second"]
    assert steps.events == [("pre", "first"), ("post", "first"), ("pre", "second"), ("post", "second")]
    # The picture of the slot is the second's, with the engine's own count.
    held = service.slots[0]
    assert held.key == replies[1].headers["X-Strata-Conversation"] != first_key
    assert held.tokens == len(engine.slot)


async def test_a_request_goes_ahead_only_when_every_plugin_acting_around_requests_agrees(
        strata_client_factory, recorder):
    # The recorder has pre_request and post_request but no word on going ahead: a no.
    engine, steps = OneAtATime(), Steps(agree=True)
    client = await strata_client_factory(steps, recorder, engine=engine)
    service = client.app[SERVICE]
    first, second = await _two_requests(client, engine)
    await until(lambda: service.fifo.waiting == 1, what="the second request waiting in the FIFO")
    assert engine.arrived == ["first"], "it waits for its turn to reach the engine"
    engine.go.set()
    assert [(await first).status, (await second).status] == [200, 200]
    assert engine.arrived == engine.ran == ["first", "second"]


async def test_a_request_sent_ahead_keeps_its_turn_when_its_client_leaves(strata_client_factory):
    engine, steps = OneAtATime(), Steps(agree=True)
    client = await strata_client_factory(steps, engine=engine)
    service = client.app[SERVICE]
    first, second = await _two_requests(client, engine)
    await until(lambda: engine.arrived == ["first", "second"], what="the second request at the engine, ahead")
    second.cancel()
    third = asyncio.create_task(client.post("/v1/chat/completions", json=chat_body("third", max_tokens=3)))
    await until(lambda: service.fifo.waiting == 2, what="the third request waiting behind the second")
    engine.go.set()
    assert (await first).status == 200 and (await third).status == 200
    await until_idle(service)
    # The second's turn came before the third's, with its plugin steps, whatever its client did.
    assert engine.ran == ["first", "second", "third"]
    assert [event for event in steps.events] == [("pre", "first"), ("post", "first"), ("pre", "second"),
                                                 ("post", "second"), ("pre", "third"), ("post", "third")]


async def test_on_the_real_engine_requests_behind_an_answer_go_ahead_and_the_slot_picture_holds(
        strata_client_factory, caplog):
    caplog.set_level(logging.DEBUG, logger="strata_serve.service")
    client = await strata_client_factory()  # the default plugins: tenant isolation, not strict, agrees
    service = client.app[SERVICE]
    engine = service.engine
    # A story long enough to still be told however busy the machine: once a request behind
    # it went ahead, its client leaves (the engine stops it).
    story = await client.post("/v1/chat/completions", json=chat_body(
        "Tell a long story about a river", max_tokens=3000, ignore_eos=True, stream=True))
    assert story.status == 200

    async def answering() -> bool:
        return any(report.processing for report in await engine.slots())

    await until(answering, timeout=60, what="the engine answering the first request")
    behind = [asyncio.create_task(client.post("/v1/chat/completions", json=chat_body(
        f"Client {n} asks about stones", max_tokens=8, stream=n % 2 == 1))) for n in range(3)]
    await until(lambda: any("ahead of its turn" in record.getMessage() for record in caplog.records), timeout=60,
                what="a request behind the story reaching the engine before the story's answer ended")
    assert not story.content.at_eof(), "the story was still being told"
    story.close()
    replies = [await task for task in behind]
    assert [reply.status for reply in replies] == [200] * 3
    texts = [await reply.text() for reply in replies]
    assert all(text.strip() for text in texts)
    await until_idle(service)
    # The picture of the slot is what the engine holds: the last request's conversation, its count.
    report = next(report for report in await engine.slots() if report.id == 0)
    assert service.slots[0].tokens == report.tokens
    assert service.slots[0].key in {reply.headers["X-Strata-Conversation"] for reply in replies}


async def test_a_request_sent_ahead_whose_turn_finds_the_engine_gone_leaves_nothing_named_in_the_slot(
        strata_client_factory):
    engine, steps = OneAtATime(), Steps(agree=True)
    client = await strata_client_factory(steps, engine=engine)
    service = client.app[SERVICE]
    first, second = await _two_requests(client, engine)
    await until(lambda: engine.arrived == ["first", "second"], what="the second request at the engine, ahead")

    async def gone() -> None:
        raise EngineUnavailable("the engine stopped, and no restart is coming")

    engine.wait_ready = gone  # type: ignore[method-assign]
    engine.go.set()
    assert (await first).status == 200
    await second  # a stream: its answer left as the engine made it, before its turn failed
    await until_idle(service)
    # The engine ran the second request (its conversation is in the slot) but no turn
    # recorded it: the slot holds nothing a plugin may save under a name.
    assert engine.ran == ["first", "second"]
    assert service.slots[0].key is None and service.slots[0].tokens is None


# -- the first in line, sent ahead once the answer before it has begun ------------------------

class StatusFirst(OneAtATime):
    """The in-memory engine running one request at a time, each answer held until the test
    lets one more go (``let_one_go``). A stream's status comes as soon as the request reaches
    it, as llama-server's headers do; its events once it ran."""

    def __init__(self) -> None:
        super().__init__()
        self.allowed = asyncio.Semaphore(0)

    def let_one_go(self) -> None:
        self.allowed.release()

    async def wait_to_run(self) -> None:
        await self.allowed.acquire()

    @contextlib.asynccontextmanager
    async def stream(self, path: str, json: Any) -> AsyncIterator[Any]:
        answer = asyncio.ensure_future(self.request("POST", path, {**json, "stream": False}))
        await asyncio.sleep(0)  # it has reached the engine
        try:
            yield _Later(answer)
        finally:
            answer.cancel()


class _Later:
    """A stream whose status is known at once and whose events come once the answer is made."""

    status = 200

    def __init__(self, answer: asyncio.Future[tuple[int, Any]]) -> None:
        self._answer = answer

    async def body(self) -> Any:
        return (await self._answer)[1]

    async def chunks(self) -> AsyncIterator[bytes]:
        status, answer = await self._answer
        async for chunk in MemoryStream(status, answer).chunks():
            yield chunk


@pytest.fixture
def held_engine():
    """A :class:`StatusFirst` engine; a test that fails with answers still held lets them
    all go before its server stops (it is torn down before the client, named after it)."""
    engine = StatusFirst()
    yield engine
    for _ in range(100):
        engine.let_one_go()


NAMES = ["first", "second", "third", "fourth"]


async def _four_in_line(strata_client_factory, engine: StatusFirst):
    """A server on ``engine``, a plugin agreeing to every request going ahead, and four
    streamed requests (:data:`NAMES`) lined up as :func:`_in_line` says."""
    steps = Steps(agree=True)
    client = await strata_client_factory(steps, engine=engine)
    return client.app[SERVICE], steps, await _in_line(client, engine, NAMES)


async def _in_line(client, engine: StatusFirst, names: list[str]) -> dict[str, asyncio.Task]:
    """Streamed requests, one after another: the first at the engine, the second sent ahead
    at its arrival (no one waited), the others waiting in line behind it."""
    tasks = {}
    for n, name in enumerate(names):
        tasks[name] = asyncio.create_task(client.post("/v1/chat/completions",
                                                      json=chat_body(name, max_tokens=3, stream=True)))
        if n < 2:
            await until(lambda n=n: engine.arrived == names[:n + 1], what=f"{name} at the engine")
        else:
            # the second waits for its turn too (at the engine already)
            await until(lambda n=n: client.app[SERVICE].fifo.waiting == n, what=f"{name} waiting in line")
    return tasks


async def test_the_first_in_line_reaches_the_engine_once_the_answer_before_it_began(strata_client_factory,
                                                                                     held_engine):
    engine, names = held_engine, NAMES
    service, steps, tasks = await _four_in_line(strata_client_factory, engine)
    assert engine.arrived == ["first", "second"], "one request at a time goes ahead"
    engine.let_one_go()  # the first answer; the second's turn comes, its answer began at once
    await until(lambda: engine.arrived == names[:3], what="the third at the engine before the second's answer")
    assert engine.ran == ["first"], "the second's answer is still held"
    engine.let_one_go()
    await until(lambda: engine.arrived == names, what="the fourth at the engine before the third's answer")
    assert engine.ran == ["first", "second"]
    engine.let_one_go()
    engine.let_one_go()
    replies = [await tasks[name] for name in names]
    assert [reply.status for reply in replies] == [200] * 4
    texts = [await reply.text() for reply in replies]
    assert all("[DONE]" in text for text in texts)
    await until_idle(service)
    # The engine ran them in their order, and each request's plugin steps ran in its own turn.
    assert engine.ran == names
    assert steps.events == [(step, name) for name in names for step in ("pre", "post")]
    held = service.slots[0]
    assert held.key == replies[-1].headers["X-Strata-Conversation"] and held.tokens == len(engine.slot)


async def test_a_request_in_line_whose_client_leaves_before_it_went_ahead_never_reaches_the_engine(
        strata_client_factory, held_engine):
    engine = held_engine
    service, steps, tasks = await _four_in_line(strata_client_factory, engine)
    tasks["third"].cancel()
    await until(lambda: service.fifo.waiting == 2, what="the third out of the line")
    for _ in range(3):
        engine.let_one_go()
    assert [(await tasks[name]).status for name in ("first", "second", "fourth")] == [200] * 3
    await until_idle(service)
    assert engine.arrived == engine.ran == ["first", "second", "fourth"]
    assert ("pre", "third") not in steps.events and ("post", "third") not in steps.events


async def test_a_request_sent_ahead_from_the_line_keeps_its_turn_when_its_client_leaves(strata_client_factory,
                                                                                       held_engine):
    engine, names = held_engine, NAMES
    service, steps, tasks = await _four_in_line(strata_client_factory, engine)
    engine.let_one_go()
    await until(lambda: engine.arrived == names[:3], what="the third at the engine, ahead")
    # Its client leaves, and the server cancels the request's task. The client's call has
    # returned already (the answer's headers came with its status), so the task is
    # cancelled here, as the server does.
    await until(lambda: tasks["third"].done(), what="the third's headers at its client")
    steps.tasks["third"].cancel()
    for _ in range(3):
        engine.let_one_go()
    assert [(await tasks[name]).status for name in ("first", "second", "fourth")] == [200] * 3
    await until_idle(service)
    assert steps.tasks["third"].cancelled(), "cancelled once its turn ended"
    # The third's turn came in its place, with its plugin steps, whatever its client did.
    assert engine.ran == names
    assert steps.events == [(step, name) for name in names for step in ("pre", "post")]
    assert service.slots[0].tokens == len(engine.slot)
