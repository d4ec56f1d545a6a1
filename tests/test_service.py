"""The service FIFO end to end: one request at a time, bounds, disconnects, normal stop.

What the service and the plugins decide (the FIFO's order and bounds, keys, hooks) runs on
the in-memory engine (``strata_memory_client_factory``); what needs the engine to be at
work (a client leaving mid-answer, a stop finishing or cutting an answer, the engine up
during ``on_startup``) on the real one.
"""

import asyncio
import json
import contextlib
import logging
import time

import aiohttp
import pytest
from aiohttp import web

import strata_serve
from strata_serve.api import SERVICE
from strata_serve.testing import assert_openai_error, chat_body, until, until_idle


class Gate:
    """Holds the FIFO in pre_request until released, so queueing can be observed."""

    strata_name = "gate"

    def __init__(self):
        self.entered = asyncio.Event()
        self.release = asyncio.Event()
        self.keys = []

    @strata_serve.hookimpl
    async def pre_request(self, request):
        self.keys.append(request.conversation_key)
        self.entered.set()
        await self.release.wait()


async def test_ten_concurrent_clients_never_interleave(strata_memory_client_factory, recorder):
    client = await strata_memory_client_factory(recorder)
    bodies = [chat_body(f"Client number {n} says hello", max_tokens=6) for n in range(10)]
    replies = await asyncio.gather(*(client.post("/v1/chat/completions", json=b) for b in bodies))
    assert [r.status for r in replies] == [200] * 10
    assert recorder.max_active == 1
    steps = [e[0] for e in recorder.events if e[0] in ("pre", "post")]
    assert steps == ["pre", "post"] * 10
    # Each post belongs to the pre right before it.
    pairs = [e for e in recorder.events if e[0] in ("pre", "post")]
    assert all(pairs[i][1] == pairs[i + 1][1] for i in range(0, 20, 2))


async def test_fifo_serves_in_arrival_order(strata_memory_client_factory, recorder):
    gate = Gate()
    client = await strata_memory_client_factory(gate, recorder)
    fifo = client.app[SERVICE].fifo
    first = asyncio.create_task(client.post("/v1/chat/completions", json=chat_body("first")))
    await gate.entered.wait()
    later = []
    for n in range(4):
        later.append(asyncio.create_task(client.post("/v1/chat/completions", json=chat_body(f"later {n}"))))
        await until(lambda n=n: fifo.waiting == n + 1, what=f"request {n} waiting in the FIFO")
    gate.release.set()
    await asyncio.gather(first, *later)
    import hashlib

    expected = [hashlib.sha1(t.encode()).hexdigest()[:16] for t in ["first"] + [f"later {n}" for n in range(4)]]
    assert gate.keys == expected


async def test_queue_limit_answers_503_with_retry_after(strata_memory_client_factory, strata_settings_factory):
    gate = Gate()
    client = await strata_memory_client_factory(gate, settings=strata_settings_factory(server={"queue_limit": 1}))
    holding = asyncio.create_task(client.post("/v1/chat/completions", json=chat_body("one")))
    await gate.entered.wait()
    waiting = asyncio.create_task(client.post("/v1/chat/completions", json=chat_body("two")))
    fifo = client.app[SERVICE].fifo
    await until(lambda: fifo.waiting == 1, what="the second request waiting in the FIFO")
    refused = await client.post("/v1/chat/completions", json=chat_body("three"))
    assert_openai_error(await refused.json(), 503, refused.status)
    assert int(refused.headers["Retry-After"]) > 0
    gate.release.set()
    assert (await holding).status == 200
    assert (await waiting).status == 200


async def test_client_that_leaves_the_queue_never_reaches_the_engine(strata_memory_client_factory, recorder):
    gate = Gate()
    client = await strata_memory_client_factory(gate, recorder)
    service = client.app[SERVICE]
    holding = asyncio.create_task(client.post("/v1/chat/completions", json=chat_body("holder")))
    await gate.entered.wait()
    url = client.make_url("/v1/chat/completions")
    async with aiohttp.ClientSession() as session:
        with_timeout = session.post(url, json=chat_body("impatient"), timeout=aiohttp.ClientTimeout(total=0.3))
        try:
            await with_timeout
        except TimeoutError:
            pass
    await until(lambda: service.fifo.waiting == 0, what="the impatient request leaving the FIFO")
    gate.release.set()
    assert (await holding).status == 200
    await until_idle(service)  # anything still in line would have had its turn by now
    assert len(gate.keys) == 1, "the impatient request must not have been served"
    assert [e[0] for e in recorder.events].count("pre") == 1


async def test_disconnect_mid_stream_cancels_and_post_request_sees_it(strata_client_factory, recorder):
    client = await strata_client_factory(recorder)
    engine = client.app[SERVICE].engine
    asked = 3000  # close to a minute of work for the demo model on 2 cores
    body = chat_body("Talk for a long time", max_tokens=asked, stream=True, ignore_eos=True)
    url = client.make_url("/v1/chat/completions")
    async with aiohttp.ClientSession() as session:
        resp = await session.post(url, json=body)
        assert resp.status == 200
        await resp.content.readany()  # the answer has started...
        assert (await engine.slots())[0].processing, "the engine is at work on it"
        resp.close()  # ...and the client goes away
    # Asked of the engine right away, not after some later request made it idle anyway.
    deadline = time.monotonic() + 10
    while (slot := (await engine.slots())[0]).processing:
        assert time.monotonic() < deadline, "the engine is still answering a client that left"
        await asyncio.sleep(0.05)
    # Stopped, not finished: the slot holds the prompt and far fewer tokens than were asked.
    assert slot.tokens is not None and slot.tokens < asked / 2, slot
    deadline = time.monotonic() + 10
    while not recorder.outcomes:
        assert time.monotonic() < deadline, "post_request never ran"
        await asyncio.sleep(0.05)
    assert recorder.outcomes[-1].status == "cancelled"
    after = await client.post("/v1/chat/completions", json=chat_body("next"))
    assert after.status == 200


class SlowSteps:
    """A plugin whose ``pre_request`` does some work that waits (as a save does) until told
    to go on, and whose ``post_request`` waits until told to go on."""

    strata_name = "slow_steps"

    def __init__(self):
        self.pre_steps: list[str] = []
        self.pre_release = asyncio.Event()
        self.pre_release.set()
        self.post_entered = asyncio.Event()
        self.post_release = asyncio.Event()
        self.post_release.set()
        self.posts_done = 0

    @strata_serve.hookimpl
    async def pre_request(self, request):
        self.pre_steps.append("begun")
        await self.pre_release.wait()
        self.pre_steps.append("finished")

    @strata_serve.hookimpl
    async def post_request(self, request, outcome):
        self.post_entered.set()
        await self.post_release.wait()
        self.posts_done += 1


async def test_a_plain_answer_leaves_before_post_request_and_the_next_request_waits_for_it(
        strata_memory_client_factory, recorder):
    plugin = SlowSteps()
    client = await strata_memory_client_factory(plugin, recorder)
    plugin.post_release.clear()
    # The answer arrives while post_request still waits: the client does not pay for it.
    try:
        first = await asyncio.wait_for(client.post("/v1/chat/completions", json=chat_body("one")), 10)
    except BaseException:
        plugin.post_release.set()  # failing, the server still stops in time
        raise
    assert first.status == 200
    assert first.headers["X-Strata-State"] and first.headers["X-Strata-Slot"] == "0"
    assert (await first.json())["choices"], "the whole answer"
    assert plugin.post_entered.is_set() and plugin.posts_done == 0, "post_request is still at work"
    # The request's turn lasts until post_request has finished: the next one waits for it in
    # the FIFO. (On a connection of its own: on the first's, kept alive, the server would not
    # read it before the first's handler ends, FIFO or not.)
    fifo = client.app[SERVICE].fifo
    async with aiohttp.ClientSession() as other_connection:
        second = asyncio.create_task(other_connection.post(client.make_url("/v1/chat/completions"),
                                                           json=chat_body("two")))
        await until(lambda: fifo.waiting == 1, what="the second request waiting in the FIFO")
        assert not second.done() and [e[0] for e in recorder.events].count("pre") == 1
        plugin.post_release.set()
        assert (await asyncio.wait_for(second, 30)).status == 200
    await until_idle(client.app[SERVICE])  # its answer, too, left before its post_request
    assert plugin.posts_done == 2
    assert [e[0] for e in recorder.events if e[0] in ("pre", "post")] == ["pre", "post", "pre", "post"]


class Steps:
    """Records the plugin steps around each request in a list shared with the test."""

    def __init__(self, order: list[str]) -> None:
        self.order = order

    @strata_serve.hookimpl
    def pre_request(self, request):
        self.order.append("pre")

    @strata_serve.hookimpl
    def post_request(self, request, outcome):
        self.order.append("post")


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
async def test_the_cpu_is_given_up_once_an_answer_is_written_before_post_request(
        strata_memory_client_factory, monkeypatch, stream):
    # A socket's write wakes its reader on the writer's CPU: the client reads its answer
    # only once strata-serve gives that CPU up. It does, once per answer, after the
    # answer's last bytes and before the plugins' post_request steps.
    from strata_serve.api import client_writes

    order: list[str] = []
    monkeypatch.setattr(client_writes, "_sched_yield", lambda: order.append("yield"))
    write_eof, ended = web.StreamResponse.write_eof, set()

    async def last_bytes(response, *args, **kwargs):
        await write_eof(response, *args, **kwargs)
        if id(response) not in ended:  # aiohttp calls it again as the handler ends: a no-op
            ended.add(id(response))
            order.append("last bytes")

    monkeypatch.setattr(web.StreamResponse, "write_eof", last_bytes)
    client = await strata_memory_client_factory(Steps(order))
    for text in ("one", "two"):
        resp = await client.post("/v1/chat/completions", json=chat_body(text, stream=stream))
        assert resp.status == 200
        await resp.read()
        await until_idle(client.app[SERVICE])
    assert order == ["pre", "last bytes", "yield", "post"] * 2
    # A body refused before the line: its error leaves as the handler ends, nothing after it.
    order.clear()
    assert (await client.post("/v1/chat/completions", json={"messages": []})).status == 400
    assert order == ["last bytes"]


async def test_a_plugin_step_that_waits_runs_to_its_end_when_the_client_leaves_meanwhile(
        strata_memory_client_factory, recorder):
    plugin = SlowSteps()
    client = await strata_memory_client_factory(plugin, recorder)
    plugin.pre_release.clear()
    url = client.make_url("/v1/chat/completions")
    async with aiohttp.ClientSession() as session:
        with contextlib.suppress(TimeoutError):
            await session.post(url, json=chat_body("leaves"), timeout=aiohttp.ClientTimeout(total=0.2))
            raise AssertionError("the answer came before the client left")
    assert plugin.pre_steps == ["begun"], "the client left while the step was at work"
    plugin.pre_release.set()  # the step goes on, its client gone
    deadline = time.monotonic() + 10
    while not recorder.outcomes:
        assert time.monotonic() < deadline, "post_request never ran"
        await asyncio.sleep(0.02)
    assert plugin.pre_steps == ["begun", "finished"], "the step was cut"
    assert recorder.outcomes[-1].status == "cancelled"
    assert (await client.post("/v1/chat/completions", json=chat_body("next"))).status == 200
    assert plugin.pre_steps[-2:] == ["begun", "finished"]


class Broken:
    strata_name = "broken_plugin"

    @strata_serve.hookimpl
    def pre_request(self, request):
        raise RuntimeError("boom in pre")

    @strata_serve.hookimpl
    async def post_request(self, request, outcome):
        raise ValueError("boom in post")

    @strata_serve.hookimpl
    def conversation_key(self, request):
        raise KeyError("boom in key")


async def test_a_raising_plugin_is_logged_by_name_and_the_request_goes_on(
    strata_memory_client_factory, recorder, caplog
):
    client = await strata_memory_client_factory(Broken(), recorder)
    with caplog.at_level(logging.ERROR, logger="strata_serve.plugins"):
        resp = await client.post("/v1/chat/completions", json=chat_body("still works"))
    assert resp.status == 200
    assert recorder.outcomes[-1].status == "ok"
    assert recorder.keys[0] is not None, "the default key still applies"
    messages = [r.getMessage() for r in caplog.records]
    for hook in ("pre_request", "post_request", "conversation_key"):
        assert any("broken_plugin" in m and hook in m for m in messages), messages


class SyncAndAsync:
    strata_name = "both_kinds"

    def __init__(self):
        self.calls = []

    @strata_serve.hookimpl
    def pre_request(self, request):
        self.calls.append("sync pre")

    @strata_serve.hookimpl
    async def post_request(self, outcome):  # any subset of the arguments
        await asyncio.sleep(0)
        self.calls.append(f"async post {outcome.status}")

    @strata_serve.hookimpl
    async def conversation_key(self, request):  # wrong: firstresult hooks must be sync
        return "never-used"


async def test_sync_and_async_impls_are_both_awaited(strata_memory_client_factory, recorder):
    plugin = SyncAndAsync()
    client = await strata_memory_client_factory(plugin, recorder)
    assert (await client.post("/v1/chat/completions", json=chat_body())).status == 200
    # post_request runs once the answer is delivered: the client may have it first.
    await until(lambda: len(plugin.calls) == 2, what="the async post_request step")
    assert plugin.calls == ["sync pre", "async post ok"]
    assert recorder.keys[0] != "never-used"


class Keyed:
    strata_name = "keyed"

    def __init__(self, key):
        self.key = key

    @strata_serve.hookimpl
    def conversation_key(self, request):
        return self.key


async def test_a_plugin_key_beats_the_default_and_bad_keys_are_dropped(strata_memory_client_factory, recorder):
    client = await strata_memory_client_factory(Keyed("my-session_1"), recorder)
    await client.post("/v1/chat/completions", json=chat_body())
    assert recorder.keys == ["my-session_1"]

    for bad in ("../../etc", "ends-in-a-newline\n", "x" * 65, ""):
        client = await strata_memory_client_factory(Keyed(bad), recorder)
        await client.post("/v1/chat/completions", json=chat_body())
        assert recorder.keys[-1] is None, repr(bad)


class NamedKey:
    def __init__(self, name):
        self.strata_name = name

    @strata_serve.hookimpl
    def conversation_key(self, request):
        return f"from-{self.strata_name}"


async def test_conversation_key_order_decides_which_plugin_wins(
    strata_memory_client_factory, strata_settings_factory, recorder
):
    first, second = NamedKey("first_keyer"), NamedKey("second_keyer")
    client = await strata_memory_client_factory(first, second, recorder)
    await client.post("/v1/chat/completions", json=chat_body())
    assert recorder.keys[-1] == "from-second_keyer", "unordered: the last registered is asked first"

    settings = strata_settings_factory(server={"conversation_key_order": ["first_keyer"]})
    client = await strata_memory_client_factory(first, second, recorder, settings=settings)
    await client.post("/v1/chat/completions", json=chat_body())
    assert recorder.keys[-1] == "from-first_keyer"

    settings = strata_settings_factory(server={"conversation_key_order": ["opening_key"]})
    client = await strata_memory_client_factory(first, second, recorder, settings=settings)
    await client.post("/v1/chat/completions", json=chat_body("ordered"))
    assert len(recorder.keys[-1]) == 16, "the built-in default can be put first too"


class Refuser:
    strata_name = "refuser"

    @strata_serve.hookimpl
    def conversation_key(self, request):
        if "X-Bad" in request.headers:
            raise strata_serve.KeyRefused("X-Bad is not acceptable", param="X-Bad")
        return None


async def test_a_keying_plugin_can_refuse_a_request_with_400(strata_memory_client_factory, recorder):
    client = await strata_memory_client_factory(Refuser(), recorder)
    resp = await client.post("/v1/chat/completions", json=chat_body(), headers={"X-Bad": "1"})
    body = await resp.json()
    assert_openai_error(body, 400, resp.status)
    assert body["error"]["param"] == "X-Bad" and body["error"]["code"] == "invalid_conversation_key"
    assert recorder.keys == [], "refused before the queue: never keyed, never sent"
    assert (await client.post("/v1/chat/completions", json=chat_body())).status == 200


async def test_tenants_never_share_a_key(strata_memory_client_factory, strata_settings_factory, recorder):
    settings = strata_settings_factory(server={"api_keys": {"alice": "ka", "bob": "kb"}})
    client = await strata_memory_client_factory(recorder, settings=settings)
    for key in ("ka", "kb"):
        resp = await client.post("/v1/chat/completions", json=chat_body("same words"),
                                 headers={"Authorization": f"Bearer {key}"})
        assert resp.status == 200
    alice, bob = recorder.keys
    assert alice.startswith("alice--") and bob.startswith("bob--")
    assert alice.split("--", 1)[1] == bob.split("--", 1)[1]
    refused = await client.post("/v1/chat/completions", json=chat_body())
    assert refused.status == 401


async def test_normal_stop_finishes_the_request_then_runs_on_shutdown(strata_client_factory, strata_settings_factory,
                                                                     recorder):
    # A grace far longer than the answer takes, even on a busy machine: the stop waits for it.
    client = await strata_client_factory(recorder, settings=strata_settings_factory(server={"shutdown_grace_s": 120}))
    in_flight = asyncio.create_task(
        client.post("/v1/chat/completions", json=chat_body("finish me", max_tokens=200, ignore_eos=True))
    )
    deadline = time.monotonic() + 30
    while not recorder.keys:
        assert time.monotonic() < deadline, "the request never reached pre_request"
        await asyncio.sleep(0.01)
    service = client.app[SERVICE]
    shutdown = asyncio.create_task(service.shutdown())
    await until(lambda: service.closing, what="the stop beginning")
    refused = await client.post("/v1/chat/completions", json=chat_body("too late"))
    assert_openai_error(await refused.json(), 503, refused.status)
    reply = await in_flight
    assert reply.status == 200
    assert len((await reply.json())["choices"][0]["message"]["content"]) > 0
    await shutdown
    kinds = [e[0] for e in recorder.events]
    assert kinds.index("shutdown") > kinds.index("post")
    shutdown_event = recorder.events[kinds.index("shutdown")]
    assert shutdown_event == ("shutdown", True, 1), "engine up and the FIFO held during on_shutdown"


async def test_request_running_past_the_grace_is_cut(strata_client_factory, strata_settings_factory, recorder):
    settings = strata_settings_factory(server={"shutdown_grace_s": 0.3})
    client = await strata_client_factory(recorder, settings=settings)
    body = chat_body("never ending", max_tokens=3500, ignore_eos=True, stream=True)
    resp = await client.post("/v1/chat/completions", json=body)
    await resp.content.readany()
    await asyncio.wait_for(client.app[SERVICE].shutdown(), 15)
    assert recorder.outcomes[-1].status == "cancelled"
    assert recorder.events[-1][0] == "shutdown"
    # The stream was cut while its tokens passed from the engine's thread: it ends with the
    # stop's error event, every event before it whole (broken framing fails the read).
    rest = await asyncio.wait_for(resp.content.read(), 15)
    events = [json.loads(line[6:]) for line in rest.split(b"\n") if line.startswith(b"data: ")]
    assert events[-1]["error"]["message"] == "cut: the server is shutting down", events[-1]
    assert len(events) > 2 and all("choices" in event for event in events[:-1])


async def test_requests_a_stop_cuts_before_their_answer_get_503_in_their_shape(strata_client_factory,
                                                                                strata_settings_factory, recorder):
    """Queued behind a request that outlives the grace, they are cut with it: each gets the
    stop's 503 in its API's shape (the connection used to be closed with no answer at all)."""
    settings = strata_settings_factory(server={"shutdown_grace_s": 0.3})
    client = await strata_client_factory(recorder, settings=settings)
    service = client.app[SERVICE]
    resp = await client.post("/v1/chat/completions",
                             json=chat_body("never ending", max_tokens=3500, ignore_eos=True, stream=True))
    await resp.content.readany()
    queued = [
        asyncio.create_task(client.post("/v1/chat/completions", json=chat_body("queued plain"))),
        asyncio.create_task(client.post("/v1/chat/completions", json=chat_body("queued stream", stream=True))),
        asyncio.create_task(client.post("/v1/messages", json={
            "model": "local", "max_tokens": 4, "messages": [{"role": "user", "content": "queued messages"}]})),
    ]
    deadline = time.monotonic() + 30
    while len(service._tasks) < 1 + len(queued):
        assert time.monotonic() < deadline, "the requests never reached the queue"
        await asyncio.sleep(0.01)
    await asyncio.wait_for(service.shutdown(), 15)
    plain, stream, messages = [await asyncio.wait_for(task, 15) for task in queued]
    assert_openai_error(await plain.json(), 503, plain.status)
    assert_openai_error(await stream.json(), 503, stream.status)
    body = await messages.json()
    assert messages.status == 503 and body["type"] == "error" and body["error"]["type"] == "overloaded_error", body
    assert "shutting down" in body["error"]["message"]


async def test_startup_hooks_run_in_order_before_the_first_request(strata_client_factory, recorder):
    client = await strata_client_factory(recorder)
    await client.post("/v1/chat/completions", json=chat_body())
    kinds = [e[0] for e in recorder.events]
    assert kinds[:3] == ["startup", "engine_start", "pre"], "on_startup first, then on_engine_start"
    assert recorder.events[0] == ("startup", True), "the engine is up during on_startup"
    assert recorder.events[1] == ("engine_start", False)


class BrokenStats:
    strata_name = "broken_stats"

    @strata_serve.hookimpl
    def collect_stats(self):
        raise RuntimeError("no numbers today")


async def test_collect_stats_gathers_every_plugin_and_skips_a_broken_one(strata_memory_client_factory, recorder,
                                                                         caplog):
    from strata_serve.plugins import call_each_sync

    client = await strata_memory_client_factory(BrokenStats(), recorder)
    await client.post("/v1/chat/completions", json=chat_body())
    service = client.app[SERVICE]
    with caplog.at_level(logging.ERROR, logger="strata_serve.plugins"):
        reported = dict(call_each_sync(service.pm, "collect_stats", service=service))
    assert reported == {"recorder": {"requests": 1}}
    assert any("broken_stats" in r.getMessage() and "collect_stats" in r.getMessage() for r in caplog.records)
