"""service.when_idle: work a plugin runs while the service is quiet, holding the FIFO.

The service's own scheduling: on the in-memory engine.
"""

from __future__ import annotations

import asyncio
import logging

import strata_serve
from strata_serve.api import SERVICE
from strata_serve.testing import chat_body


class QuietWork:
    """A plugin that asks, after each request, for work once the server is idle."""

    strata_name = "quiet_work"

    def __init__(self, delay_s: float, fail: bool = False):
        self.delay_s, self.fail = delay_s, fail
        self.ran: list[bool] = []
        self.handle = None

    @strata_serve.hookimpl
    def post_request(self, service):
        async def work():
            self.ran.append(service.fifo.holders == 1)
            await asyncio.sleep(0.2)
            if self.fail:
                raise RuntimeError("the quiet work broke")

        self.handle = service.when_idle(self.delay_s, work, name="quiet work")


async def wait_for(condition, deadline_s=10):
    deadline = asyncio.get_running_loop().time() + deadline_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.01)


async def test_it_runs_holding_the_fifo_and_a_request_waits_for_it(strata_memory_client_factory):
    plugin = QuietWork(0.05)
    client = await strata_memory_client_factory(plugin)
    assert (await client.post("/v1/chat/completions", json=chat_body())).status == 200
    await wait_for(lambda: plugin.handle.running)
    assert plugin.ran == [True], "it held the FIFO"
    resp = await client.post("/v1/chat/completions", json=chat_body())
    assert resp.status == 200 and plugin.ran == [True]


class Gate:
    """A plugin that holds each request in ``pre_request`` until it is let through: a busy service."""

    strata_name = "gate"

    def __init__(self) -> None:
        self.entered = asyncio.Event()
        self.through = asyncio.Event()

    @strata_serve.hookimpl
    async def pre_request(self, request):
        self.entered.set()
        await self.through.wait()


async def test_a_busy_service_never_starts_it_and_an_idle_one_does(strata_memory_client_factory):
    gate = Gate()
    client = await strata_memory_client_factory(gate)
    service = client.app[SERVICE]
    ran: list[str] = []

    def work(name: str):
        async def run() -> None:
            ran.append(name)
        return run

    held = asyncio.create_task(client.post("/v1/chat/completions", json=chat_body()))
    await asyncio.wait_for(gate.entered.wait(), 10)
    busy = service.when_idle(0.05, work("busy"), name="busy work")
    # Its delay is over while the request still holds the service: it gives up, unstarted
    # (started, it would wait for the FIFO behind the request, and never be done here).
    await wait_for(lambda: busy.done)
    assert ran == [] and not busy.running and not held.done()
    gate.through.set()
    assert (await asyncio.wait_for(held, 10)).status == 200
    # The control: the same work asked for once the service is idle runs.
    idle = service.when_idle(0.05, work("idle"), name="idle work")
    await wait_for(lambda: idle.done)
    assert ran == ["idle"], "the work run while busy never ran later either"


async def test_cancel_stops_it(strata_memory_client_factory):
    plugin = QuietWork(0.3)
    client = await strata_memory_client_factory(plugin)
    await client.post("/v1/chat/completions", json=chat_body())
    first = plugin.handle
    first.cancel()
    assert first.done
    # Work asked for later with the same delay has run: the first, had it not been
    # cancelled, would have run before it.
    later = asyncio.Event()

    async def mark() -> None:
        later.set()

    client.app[SERVICE].when_idle(0.3, mark, name="later work")
    await asyncio.wait_for(later.wait(), 10)
    assert plugin.ran == [] and first.done


async def test_a_failure_is_logged_by_name_and_a_stop_cancels_what_has_not_started(
        strata_memory_client_factory, caplog):
    plugin = QuietWork(0.01, fail=True)
    client = await strata_memory_client_factory(plugin)
    with caplog.at_level(logging.ERROR, logger="strata_serve.service"):
        await client.post("/v1/chat/completions", json=chat_body())
        await wait_for(lambda: plugin.handle.done)
    assert any("quiet work (run while idle) failed" in r.getMessage() for r in caplog.records)
    plugin.delay_s = 30
    await client.post("/v1/chat/completions", json=chat_body())
    pending = plugin.handle
    service = client.app[SERVICE]
    await asyncio.wait_for(service.shutdown(), 10)
    assert pending.done and len(plugin.ran) == 1, "the stop cancelled it, and did not wait 30 s"
