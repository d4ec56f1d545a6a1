"""Where a request's time goes outside the engine (strata_serve.timing), on the real engine:
what a switch's answer says it spent, against an answer from the slot, and the engine's
idle time between two answers when a request waited."""

from __future__ import annotations

import asyncio
import time

import pytest

import strata_serve
from strata_serve import span
from strata_serve.api import SERVICE
from strata_serve.testing import conversation, until_idle
from strata_serve.timing import PhaseTotals, Timeline, read_server_timing as spans, timeline_of


async def chat(client, messages: list[dict], **more) -> dict[str, float]:
    resp = await client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 4, **more})
    assert resp.status == 200, await resp.text()
    await resp.read()
    return spans(resp.headers["Server-Timing"])


async def test_a_switch_names_its_save_and_an_answer_from_the_slot_names_none(auto_client):
    client = await auto_client(idle_save_s=0)
    a, b = conversation("timed-a"), conversation("timed-b")
    first = await chat(client, a)
    assert "engine_save" not in first and first["queue"] >= 0 and "pre_request" in first
    again = await chat(client, a + [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "more"}])
    assert "engine_save" not in again and "engine_restore" not in again, again  # the control: from its slot
    switch = await chat(client, b, stream=True)  # a stream's header leaves after the steps before the engine
    for name in ("engine_save", "auto_sessions.commit", "pre_request.auto_sessions"):
        assert switch.get(name, 0) > 0, (name, switch)
    # The commit's own step: a whole file's digest, or the cut into blocks.
    assert switch.get("auto_sessions.digest", 0) > 0 or switch.get("auto_sessions.blocks", 0) > 0, switch
    assert switch["engine_save"] + switch["auto_sessions.commit"] <= switch["pre_request"] + 0.01, switch
    back = await chat(client, a)
    assert back.get("engine_restore", 0) > 0 and back.get("auto_sessions.restore_checks", 0) > 0, back
    await until_idle(client.app[SERVICE])  # a turn's spans count once it has ended
    totals = client.app[SERVICE].phases.snapshot()
    assert totals["requests"] == 4 and totals["count"]["engine_save"] == 2, totals  # B's save at the return


class HoldsTheTurnUntilAnotherWaits:
    """Once armed, the next request is held in its steps before the engine until another
    request waits in the line: that one then arrives before this answer ends and waits for
    it, however busy the machine (a short answer could otherwise end first)."""

    def __init__(self) -> None:
        self.armed = False

    @strata_serve.hookimpl
    async def pre_request(self, request, service):
        if not self.armed:
            return
        self.armed = False
        deadline = time.monotonic() + 30
        while not service.fifo.waiting:
            assert time.monotonic() < deadline, "no request came to wait"
            await asyncio.sleep(0.001)


async def test_the_engine_idle_between_two_answers_is_the_gap_of_the_request_that_waited(auto_client):
    holder = HoldsTheTurnUntilAnotherWaits()
    client = await auto_client(holder, idle_save_s=0)
    a, b = conversation("gap-a"), conversation("gap-b")
    await chat(client, a)
    service = client.app[SERVICE]
    await until_idle(service)  # A's turn has ended: the FIFO taken next is the long request's
    assert service.phases.snapshot()["count"].get("gap", 0) == 0  # nobody waited
    holder.armed = True
    long = asyncio.ensure_future(chat(client, a + [{"role": "user", "content": "go on"}], max_tokens=64))
    deadline = time.monotonic() + 30
    while service.fifo.idle:  # the long request holds the FIFO
        assert time.monotonic() < deadline and not long.done(), "the long request never took the FIFO"
        await asyncio.sleep(0.001)
    waited = await chat(client, b)  # waits for A's answer, then B's switch saves A
    await long
    assert waited["gap"] >= waited["pre_request"] > 0, waited
    assert waited["gap"] >= waited["engine_save"] > 0, waited


def test_spans_outside_a_request_cost_nothing_and_names_are_checked():
    with span("nothing.to.see"):
        pass  # no timeline: nothing recorded, nothing raised
    timeline = Timeline()
    with timeline_of(timeline):
        with span("mine.fetch"):
            pass
        with span("mine.fetch"):
            pass
        with pytest.raises(ValueError, match="span's name"):
            with span("no spaces"):
                pass
    assert timeline.spans["mine.fetch"][1] == 2
    assert timeline.server_timing().startswith("mine.fetch;dur=")
    totals = PhaseTotals()
    totals.add(timeline)
    totals.add(timeline)
    assert totals.snapshot()["count"]["mine.fetch"] == 4 and totals.snapshot()["requests"] == 2
