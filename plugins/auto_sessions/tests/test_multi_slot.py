"""Parking on an engine with several slots (``engine.parallel`` = 2 and 4), real engine.

Requests run side by side, one per slot; a conversation goes back to the slot that holds
it, a new one displaces the least valuable state (parked first), and nothing that is
parked or held is ever lost, whatever runs in the other slots meanwhile.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest

import strata_serve

from strata_serve.api import SERVICE
from strata_serve.testing import conversation

from tests.parked_state import (
    PATH_TOLERANCE,
    WRONG_STATE_DISTANCE,
    logprob_body,
    logprob_distance,
    reordered,
    settle,
    sharp_demo_model,
    wrong_state_answer,
)
from tests.slot_reads import ENGINE_ARGS, SlotReads

#: A turn reused its own state when it reused at least this much of its ~750-token opening.
OWN_STATE = 600


#: Engine flags for tests that need an answer still running while something happens in
#: another slot: with its context shift on, the engine writes an answer without
#: ``max_tokens`` (and ignoring end-of-text) until its client leaves or the engine dies.
#: (The demo model writes 2,000 tokens a second: any bounded answer may end before a
#: loaded machine gets to the other slot.)
ENDLESS = ["--context-shift"]


def engine_for(parallel: int, **extra) -> dict:
    # llama-server splits its context evenly among the slots (-np without --kv-unified).
    return {"parallel": parallel, "ctx_size": 2048 * parallel, **extra}


def url_of(client) -> str:
    return str(client.make_url("")).rstrip("/")


async def stream_turn(url: str, messages: list[dict], max_tokens: int = 8,
                      started: asyncio.Event | None = None, **extra) -> tuple[dict, dict]:
    """Stream one turn the way agents do: leave as soon as the event with the timings is read.

    ``started`` is set once the first event arrives; ``extra`` goes into the body.

    :returns: the engine's timings and the response headers.
    """
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True, **extra}
    async with httpx.AsyncClient(timeout=120) as http:
        async with http.stream("POST", url + "/v1/chat/completions", json=body) as reply:
            assert reply.status_code == 200, await reply.aread()
            async for line in reply.aiter_lines():
                if not line.startswith("data:"):
                    continue
                if started is not None:
                    started.set()
                if '"timings"' in line:
                    return json.loads(line[5:])["timings"], reply.headers
    raise AssertionError("the stream ended without timings")


async def ask(client, body: dict) -> tuple[dict, dict]:
    resp = await client.post("/v1/chat/completions", json=body)
    assert resp.status == 200, await resp.text()
    return await resp.json(), resp.headers


def more(messages: list[dict], text: str) -> list[dict]:
    return messages + [{"role": "assistant", "content": "noted"}, {"role": "user", "content": text}]


def numbers(client) -> dict:
    return client.app[SERVICE].state["auto_sessions"].stats.snapshot()


class Admissions:
    """Writes down how many requests held a slot at once, as each one got its slot."""

    strata_name = "admissions"

    def __init__(self) -> None:
        self.most = 0

    @strata_serve.hookimpl(tryfirst=True)
    def pre_request(self, service):
        self.most = max(self.most, len(service.fifo.busy))


@pytest.mark.parametrize("parallel", [2, 4])
async def test_concurrent_conversations_each_keep_their_own_slot(auto_client, parallel):
    admissions = Admissions()
    client = await auto_client(admissions, engine=engine_for(parallel), idle_save_s=0)
    service = client.app[SERVICE]
    url = url_of(client)
    chats = {name: conversation(name) for name in (f"par-{n}" for n in range(parallel))}
    first = await asyncio.gather(*(stream_turn(url, chats[n]) for n in chats))
    slots = {h["X-Strata-Conversation"]: int(h["X-Strata-Slot"]) for _, h in first}
    assert sorted(slots.values()) == list(range(parallel)), "as many conversations as slots, one in each"
    names = list(chats)
    for round_ in range(3):
        chats = {n: more(m, f"step {round_}") for n, m in chats.items()}
        names = names[1:] + names[:1]  # each round in another order: a slot is found by what it holds
        turns = await asyncio.gather(*(stream_turn(url, chats[n]) for n in names))
        for timings, headers in turns:
            key = headers["X-Strata-Conversation"]
            assert int(headers["X-Strata-Slot"]) == slots[key], "a conversation stays in its slot"
            assert headers["X-Strata-State"] == "slot"
            assert timings["cache_n"] >= OWN_STATE, timings
    assert admissions.most == parallel, "every slot was busy at once"
    assert numbers(client)["saves"] == 0 and numbers(client)["restores"] == 0, "nothing needed parking"
    await service.check_slots()
    assert service.slots.corrections == 0, "the picture matched the engine"


async def endless_stream(url: str, messages: list[dict], started: asyncio.Event, release: asyncio.Event, *,
                         read_to_the_end: bool) -> tuple[int, dict, list[str]]:
    """Stream an answer without end (an engine run with ``ENDLESS``): set ``started`` at its
    first event, then read no further until ``release`` is set (the engine writes on
    meanwhile). Then read the rest to the stream's end (the engine died), or leave (the
    engine stops once it sees the client gone).

    The context shift keeps the whole prompt (``n_keep`` -1): the slot still holds the
    conversation afterwards.

    :returns: the status, the response headers and the data of the events read, in order.
    """
    body = {"messages": messages, "ignore_eos": True, "n_keep": -1, "temperature": 0, "stream": True}
    events: list[str] = []
    async with httpx.AsyncClient(timeout=120) as http:
        async with http.stream("POST", url + "/v1/chat/completions", json=body) as reply:
            async for line in reply.aiter_lines():
                if not line.startswith("data:"):
                    continue
                events.append(line[5:].strip())
                if not started.is_set():
                    started.set()
                    await release.wait()
                    if not read_to_the_end:
                        break
            return reply.status_code, reply.headers, events


@pytest.mark.parametrize("parallel", [2, 4])
async def test_a_switch_on_one_slot_never_disturbs_another(auto_client, monkeypatch, parallel):
    client = await auto_client(engine=engine_for(parallel, extra_args=ENDLESS), idle_save_s=0)
    service = client.app[SERVICE]
    engine = service.engine
    url = url_of(client)
    # C, A, then one conversation in each other slot: the last one displaces C (parked),
    # and A is then the least recently used.
    c, a, *others = (conversation(f"dis-{n}") for n in range(parallel + 1))
    await stream_turn(url, c)
    _, ha = await stream_turn(url, a)
    slot_of = {}
    for messages in others:
        _, headers = await stream_turn(url, messages)
        slot_of[headers["X-Strata-Conversation"]] = int(headers["X-Strata-Slot"])
    slot_a = int(ha["X-Strata-Slot"])
    assert sorted([slot_a, *slot_of.values()]) == list(range(parallel))
    assert numbers(client)["saves"] == 1, "C was parked"
    held = {report.id: report.tokens for report in await engine.slots()}
    during: list[tuple[str, int, dict[int, dict]]] = []

    def watched(call, name):
        async def run(filename, slot=0):
            during.append((name, slot, {report.id: report for report in await engine.slots()}))
            return await call(filename, slot)
        return run

    monkeypatch.setattr(engine, "save", watched(engine.save, "save"))
    monkeypatch.setattr(engine, "restore", watched(engine.restore, "restore"))
    # The others stream long answers in their slots; once they all run, C comes back into
    # A's slot: A is saved and C restored there meanwhile.
    started, release = [asyncio.Event() for _ in others], asyncio.Event()
    streams = [asyncio.create_task(endless_stream(url, more(messages, "tell me more"), event, release,
                                                  read_to_the_end=False))
               for messages, event in zip(others, started)]
    try:
        await asyncio.wait_for(asyncio.gather(*(event.wait() for event in started)), 60)
        # (A slot call on a busy slot waits until that slot is free: here, for ever.)
        timings, headers = await asyncio.wait_for(stream_turn(url, more(c, "back")), 60)
        after = {report.id: report for report in await engine.slots()}
    finally:
        release.set()
    for stream in streams:
        status, stream_headers, _ = await stream
        assert status == 200 and int(stream_headers["X-Strata-Slot"]) == slot_of[stream_headers["X-Strata-Conversation"]]
    await settle(client, 60)
    assert int(headers["X-Strata-Slot"]) == slot_a
    assert headers["X-Strata-State"] == "disk" and timings["cache_n"] >= OWN_STATE, (headers, timings)
    assert [(name, slot) for name, slot, _ in during] == [("save", slot_a), ("restore", slot_a)]
    # Every other slot was at work during the save and the restore, on one task from
    # before the switch to after it...
    for name, _, engine_slots in during:
        for slot in slot_of.values():
            assert engine_slots[slot].processing, (f"slot {slot} was at work during the {name}", engine_slots)
            assert after[slot].processing and engine_slots[slot].task == after[slot].task, (
                engine_slots[slot], after[slot])
    # ...and still holds its conversation: the next turn reuses it there.
    for messages in others:
        timings, headers = await stream_turn(url, more(messages, "again"))
        slot = slot_of[headers["X-Strata-Conversation"]]
        assert int(headers["X-Strata-Slot"]) == slot and headers["X-Strata-State"] == "slot", headers
        # (all of its prompt; its 8 generated tokens differ from the "noted" sent back)
        assert timings["cache_n"] >= held[slot] - 8, ("its slot kept its state through the switch", timings)
    # A comes back from its file (it displaces the least recently used, parked first), and
    # C with its own state.
    timings, headers = await stream_turn(url, more(a, "back"))
    assert headers["X-Strata-State"] == "disk" and timings["cache_n"] >= OWN_STATE, (headers, timings)
    timings, headers = await stream_turn(url, more(more(c, "back"), "again"))
    assert timings["cache_n"] >= OWN_STATE, (headers, timings)
    await service.check_slots()
    assert service.slots.corrections == 0, "the picture matched the engine"


@pytest.mark.parametrize("held", [False, True], ids=["new", "held"])
async def test_one_conversation_never_runs_in_two_slots_at_once(auto_client, caplog, held):
    """Three requests of one conversation at once, each an answer without end: all three
    are in the server together, while the first streams on, and still they run one after
    the other in one slot, each reading only the little the last left unread (the
    engine's own count for that slot). A new conversation (no slot is named for it yet:
    only the line knows it is running) and one a slot holds."""
    reads = SlotReads(caplog)
    client = await auto_client(reads, engine=engine_for(2, extra_args=ENDLESS + ENGINE_ARGS), idle_save_s=0)
    service = client.app[SERVICE]
    url = url_of(client)
    a = conversation(f"twice-{'held' if held else 'new'}")
    if held:
        await stream_turn(url, a)
    started, release = [asyncio.Event() for _ in range(3)], asyncio.Event()
    streams = [asyncio.create_task(endless_stream(url, more(a, f"q{n}"), event, release, read_to_the_end=False))
               for n, event in enumerate(started)]
    try:
        deadline = time.monotonic() + 60
        while not (any(event.is_set() for event in started)
                   and len(service.fifo.busy) + service.fifo.waiting == 3):
            assert time.monotonic() < deadline, ("the three requests never were in the server at once",
                                                 service.fifo.busy, service.fifo.waiting)
            await asyncio.sleep(0.01)
        # They overlap: the first is still writing its answer with the other two in.
        engine_view = await service.engine.slots()
        assert any(report.processing for report in engine_view), engine_view
    finally:
        release.set()
    results = await asyncio.wait_for(asyncio.gather(*streams), 120)
    await settle(client, 60)
    assert all(status == 200 for status, _, _ in results), results
    key = results[0][1]["X-Strata-Conversation"]
    ran_in = {int(headers["X-Strata-Slot"]) for _, headers, _ in results}
    assert len(ran_in) == 1, f"one conversation ran in slots {ran_in}"
    # Per request, the engine's count in its slot: one read of the opening at most (a new
    # conversation's first request), every later one reads the few tokens after it.
    turns = reads.of(key)
    assert len(turns) == 3 + held and {read.slot for read in turns} == ran_in, turns
    assert all(read.task is not None for read in turns), ("every request reached the engine", turns)
    assert all(read.tokens is not None for read in turns), turns
    whole = [read for read in turns if read.tokens >= OWN_STATE]
    assert len(whole) == 1 and whole[0] is turns[0], ("the opening was read once, by the first", turns)
    assert all(read.cached >= OWN_STATE for read in turns[1:]), turns


async def test_a_restart_restores_each_conversation_into_whichever_slot_it_lands_on(auto_client, llama_server_factory,
                                                                                    tmp_path):
    """On the sharp demo model, whose answers depend on the state they read: a wrong state
    (the conversation's tokens over another's KV data) is shown to give another answer."""
    model = sharp_demo_model(tmp_path)
    client = await auto_client(engine=engine_for(4, model=str(model)), idle_save_s=0.2)
    service = client.app[SERVICE]
    url = url_of(client)
    names = [f"rs-{n}" for n in range(4)]
    chats = {n: conversation(n) for n in names}
    await asyncio.gather(*(stream_turn(url, chats[n]) for n in names))
    deadline = time.monotonic() + 60
    while numbers(client)["idle_saves"] < 4:  # each slot saved once idle
        assert time.monotonic() < deadline, numbers(client)
        await asyncio.sleep(0.05)
    generation = service.engine.generation
    os.kill(service.engine.pid, signal.SIGKILL)
    deadline = time.monotonic() + 60
    while service.engine.generation == generation or not service.engine.ready:
        assert time.monotonic() < deadline, "the engine was not restarted"
        await asyncio.sleep(0.05)
    chats = {n: more(m, "after the restart") for n, m in chats.items()}
    results = await asyncio.gather(*(ask(client, logprob_body(chats[n], 4)) for n in names))
    for answer, headers in results:
        assert headers["X-Strata-State"] == "disk", headers
        assert answer["timings"]["cache_n"] >= OWN_STATE, answer["timings"]
    # The same answers as a fresh read of each conversation (greedy, by logprobs): a
    # fresh engine's, since nothing is reused with cache_prompt off.
    for name, (answer, _) in zip(names, results):
        fresh, _ = await ask(client, logprob_body(chats[name], 4, cache_prompt=False))
        assert logprob_distance(answer, fresh) <= PATH_TOLERANCE, name
    # Control: the first conversation's turn answered from a wrong state differs by far more.
    bare = await llama_server_factory(model=model)
    first = conversation(names[0])
    wrong = await wrong_state_answer(bare, bare.info.slot_save_path, first, reordered(first), chats[names[0]], 4)
    assert logprob_distance(wrong, results[0][0]) > WRONG_STATE_DISTANCE


async def test_a_route_the_engine_places_itself_parks_every_other_slot_first(auto_client):
    """llama-server's /v1/messages ignores id_slot: the service holds all slots for it."""
    client = await auto_client(engine=engine_for(2), idle_save_s=0)
    service = client.app[SERVICE]
    url = url_of(client)
    a, b = conversation("un-a"), conversation("un-b")
    await asyncio.gather(stream_turn(url, a), stream_turn(url, b))
    resp = await client.post("/v1/messages", json={"model": "m", "max_tokens": 4,
                                                    "messages": conversation("un-c")})
    assert resp.status == 200, await resp.text()
    assert numbers(client)["saves"] == 2, "both held conversations were parked before it ran"
    ran = int(resp.headers["X-Strata-Slot"])
    keys = [s.key for s in service.slots]
    assert keys[ran] == resp.headers["X-Strata-Conversation"], "the picture follows the engine's choice"
    assert keys.count(resp.headers["X-Strata-Conversation"]) == 1
    await service.check_slots()
    assert service.slots.corrections == 0
    for messages in (a, b):
        timings, _ = await stream_turn(url, more(messages, "back"))
        assert timings["cache_n"] >= OWN_STATE, timings


async def test_engine_killed_mid_save_on_one_slot_while_another_streams(auto_client, llama_server_factory, tmp_path,
                                                                         monkeypatch, caplog):
    """The engine dies in the middle of writing a save (it may write 64 KiB of the
    temporary, then dies of SIGXFSZ), made for a switch in one slot while the other slot
    streams an answer: the stream ends with an error event, the switch's request is
    answered by the restarted engine, nothing partial is kept, and every conversation
    comes back afterwards with its own state or read anew, never another's (on the sharp
    demo model, where a wrong state is shown to give another answer)."""
    import resource

    from tests.test_reliability import PARTIAL_BYTES, only_complete_files

    caplog.set_level(logging.INFO, logger="strata_auto_sessions")
    model = sharp_demo_model(tmp_path)
    client = await auto_client(engine=engine_for(2, model=str(model), extra_args=ENDLESS), idle_save_s=0)
    service = client.app[SERVICE]
    engine = service.engine
    url = url_of(client)
    directory = Path(engine.info.slot_save_path)
    chats = {name: conversation(f"kill-{name}") for name in "abc"}
    _, ha = await stream_turn(url, chats["a"])
    _, hb = await stream_turn(url, chats["b"])
    slot_a, slot_b = int(ha["X-Strata-Slot"]), int(hb["X-Strata-Slot"])
    real_save = engine.save
    seen: dict = {}

    async def save_dies_writing(filename, slot=0):
        seen["slot"] = slot
        seen["engine"] = {report.id: report for report in await engine.slots()}  # as the save starts
        resource.prlimit(engine.pid, resource.RLIMIT_CORE, (0, 0))
        resource.prlimit(engine.pid, resource.RLIMIT_FSIZE, (PARTIAL_BYTES, PARTIAL_BYTES))
        try:
            return await real_save(filename, slot)
        finally:
            path = directory / filename
            seen["temporary"] = path.stat().st_size if path.exists() else None

    monkeypatch.setattr(engine, "save", save_dies_writing)
    generation = engine.generation
    # B streams an answer without end in its slot...
    started, release = asyncio.Event(), asyncio.Event()
    streaming = asyncio.create_task(endless_stream(url, more(chats["b"], "go on"), started, release,
                                                   read_to_the_end=True))
    try:
        await asyncio.wait_for(started.wait(), 60)
        # ...while C takes the other slot: A is saved first, and the engine dies writing it.
        resp = await asyncio.wait_for(client.post("/v1/chat/completions", json=logprob_body(chats["c"])), 120)
    finally:
        release.set()
    status, headers, events = await asyncio.wait_for(streaming, 120)
    monkeypatch.setattr(engine, "save", real_save)

    assert seen["slot"] == slot_a, seen
    assert seen["engine"][slot_b].processing is True, "B's slot was streaming when the save began"
    assert seen["temporary"] is not None and 0 < seen["temporary"] <= PARTIAL_BYTES, seen
    assert engine.generation == generation + 1, "the engine died once and came back"
    # The stream ends with an error event: neither a hang nor a silent cut.
    assert status == 200 and int(headers["X-Strata-Slot"]) == slot_b
    assert "choices" in json.loads(events[0]), events[:2]
    last = json.loads(events[-1])
    assert "engine stopped while answering" in last["error"]["message"], last
    assert "[DONE]" not in events
    # The request that waited on the save is answered by the restarted engine.
    assert resp.status == 200, await resp.text()
    answered_c = await resp.json()
    assert int(resp.headers["X-Strata-Slot"]) == slot_a
    assert [r for r in caplog.records if r.levelno == logging.WARNING
            and "saving" in r.getMessage() and "failed" in r.getMessage()], caplog.text
    # Nothing partial is kept: no temporary, no file for A's lost state.
    await settle(client, 60)
    only_complete_files(directory)
    assert not (directory / f"auto-{ha['X-Strata-Conversation']}.bin").exists()
    # The picture is of the new engine: C in the slot it ran in (what it holds, the engine says).
    engine_view = {report.id: report.tokens for report in await engine.slots()}
    held = await service.slot(slot_a)
    assert held.key == resp.headers["X-Strata-Conversation"] and held.tokens == engine_view[slot_a] > 0, (
        list(service.slots), engine_view)

    # Later turns switch each conversation out and back: saves and restores work, and each
    # answer is its own conversation's (greedy logprobs equal a fresh read of it).
    answers = [(chats["c"], answered_c, "-")]
    states: dict[str, list[str]] = {name: [] for name in "abc"}
    for round_ in range(2):
        for name in "abc":
            chats[name] = more(chats[name], f"turn {round_}")
            reply = await client.post("/v1/chat/completions", json=logprob_body(chats[name]))
            assert reply.status == 200, await reply.text()
            answer = await reply.json()
            state = reply.headers["X-Strata-State"]
            if state in ("slot", "disk"):
                assert answer["timings"]["cache_n"] >= OWN_STATE, (name, state, answer["timings"])
            states[name].append(state)
            answers.append((chats[name], answer, state))
    # A's state died unsaved with the engine, B's was cut mid-answer: both are read anew.
    # C's answer from the restarted engine is kept (parked when displaced); then every
    # conversation comes back from its file.
    assert states == {"a": ["none", "disk"], "b": ["none", "disk"], "c": ["disk", "disk"]}, states
    assert numbers(client)["restore_failures"] == 0 and numbers(client)["save_failures"] == 1, numbers(client)
    only_complete_files(directory)
    for messages, answer, state in answers:
        fresh, _ = await ask(client, logprob_body(messages, cache_prompt=False))
        assert logprob_distance(answer, fresh) <= PATH_TOLERANCE, (state, messages[0]["content"][:20])
    # Control: the check tells an answer from a wrong state (C's tokens over other KV data).
    bare = await llama_server_factory(model=model)
    messages, answer, _ = answers[-1]
    opening = messages[:1]
    wrong = await wrong_state_answer(bare, bare.info.slot_save_path, opening, reordered(opening), messages, 4)
    assert logprob_distance(wrong, answer) > WRONG_STATE_DISTANCE


async def test_metrics_and_stats_say_which_slot_each_request_ran_in(auto_client):
    import strata_ram_cache_stats
    from prometheus_client.parser import text_string_to_metric_families

    client = await auto_client(strata_ram_cache_stats, engine=engine_for(2), idle_save_s=0)
    service = client.app[SERVICE]
    url = url_of(client)
    a, b = conversation("met-a"), conversation("met-b")
    await asyncio.gather(stream_turn(url, a), stream_turn(url, b))
    _, headers = await stream_turn(url, more(a, "again"))
    slot_a = headers["X-Strata-Slot"]
    text = await (await client.get("/metrics")).text()
    samples = {(s.name, s.labels.get("slot")): s.value
               for family in text_string_to_metric_families(text) for s in family.samples}
    assert samples[("strata_slot_requests_total", slot_a)] == 2
    assert samples[("strata_slot_requests_total", str(1 - int(slot_a)))] == 1
    engine = {report.id: report.tokens for report in await service.engine.slots()}
    for n in (0, 1):
        assert samples[("strata_slot_tokens", str(n))] == engine[n]
        assert samples[("strata_slot_busy", str(n))] == 0
    stats = await (await client.get("/stats")).json()
    assert stats["slots"][slot_a]["requests"] == 2


async def test_an_engine_that_empties_idle_slots_itself_loses_no_conversation(auto_client):
    """--kv-unified with the RAM cache on: llama-server moves idle slots into its RAM cache
    when another slot gets a task (and the RAM cache may drop them). Each conversation is
    saved as its answer ends, and the picture follows what the engine reports."""
    client = await auto_client(engine=engine_for(2, cache_ram_mib=256, extra_args=["--kv-unified"]),
                               idle_save_s=0)
    service = client.app[SERVICE]
    assert service.engine.info.clears_idle_slots
    url = url_of(client)
    a, b = conversation("kvu-a"), conversation("kvu-b")
    _, ha = await stream_turn(url, a)
    await settle(client, 60)
    assert numbers(client)["saves"] == 1, "A was saved as its answer ended"
    await stream_turn(url, b)  # A's slot is emptied as B starts
    engine = {report.id: report.tokens for report in await service.engine.slots()}
    assert engine[int(ha["X-Strata-Slot"])] == 0, engine
    timings, headers = await stream_turn(url, more(a, "back"))
    assert service.slots.corrections >= 1, "the check before the request saw the emptied slot"
    assert headers["X-Strata-State"] == "disk" and timings["cache_n"] >= OWN_STATE, (headers, timings)


def test_which_engine_flags_empty_idle_slots():
    from strata_serve.config import EngineSettings
    from strata_serve.engine.llama_server import clears_idle_slots

    def clears(parallel=2, ram=None, *args):
        return clears_idle_slots(EngineSettings(parallel=parallel, cache_ram_mib=ram, extra_args=list(args)))

    assert clears(2, None, "--kv-unified")
    assert clears(4, 512, "-kvu")
    assert not clears(2, None)  # an explicit -np: one buffer per slot, slots kept
    assert not clears(1, None, "--kv-unified")
    assert not clears(2, 0, "--kv-unified")
    assert not clears(2, None, "--kv-unified", "--cache-ram", "0")
    assert not clears(2, None, "--kv-unified", "--no-cache-idle-slots")
    assert not clears(2, None, "--kv-unified", "--no-kv-unified")
    assert clears(2, None, "--no-kv-unified", "--kv-unified")


async def test_disk_full_during_a_save_on_one_slot_while_the_other_works(auto_client, tmp_path):
    from tests.test_reliability import only_complete_files, tmpfs

    with tmpfs(tmp_path / "small", "900k") as slots:
        client = await auto_client(engine=engine_for(2, slot_save_path=str(slots)), idle_save_s=0)
        url = url_of(client)
        a, b, c, d = (conversation(f"full{n}") for n in "abcd")
        await stream_turn(url, a)
        await stream_turn(url, b)
        _, hc = await stream_turn(url, c)  # A saved (about 0.5 MB): fits
        assert numbers(client)["saves"] == 1
        # D displaces B, whose save does not fit, while C goes on in the other slot.
        (_, hd), (tc, hc2) = await asyncio.gather(stream_turn(url, d), stream_turn(url, more(c, "on")))
        assert numbers(client)["save_failures"] == 1
        assert hc2["X-Strata-Slot"] == hc["X-Strata-Slot"] != hd["X-Strata-Slot"]
        assert hc2["X-Strata-State"] == "slot" and tc["cache_n"] >= OWN_STATE, "C's slot was not disturbed"
        only_complete_files(slots)
        subprocess.run(["mount", "-o", "remount,size=10m", str(slots)], check=True)  # space comes back
        timings, headers = await stream_turn(url, more(a, "back"))  # A's file is whole
        assert headers["X-Strata-State"] == "disk" and timings["cache_n"] >= OWN_STATE
        await client.close()


async def test_a_request_without_a_conversation_takes_a_free_slot_not_a_conversation(auto_client):
    client = await auto_client(engine=engine_for(2), idle_save_s=0)
    url = url_of(client)
    a = conversation("side-a")
    _, ha = await stream_turn(url, a)
    for _ in range(3):  # side requests (completions are not keyed)
        resp = await client.post("/v1/completions", json={"prompt": "Once upon a time", "max_tokens": 4})
        assert resp.status == 200 and resp.headers["X-Strata-State"] == "unkeyed"
        assert resp.headers["X-Strata-Slot"] != ha["X-Strata-Slot"], "the other slot was free"
    assert numbers(client)["saves"] == 0, "A was never displaced"
    timings, headers = await stream_turn(url, more(a, "back"))
    assert headers["X-Strata-State"] == "slot" and timings["cache_n"] >= OWN_STATE


async def test_a_request_for_several_completions_never_spills_into_another_slot(auto_client):
    """The engine runs ``n_cmpl`` completions in as many slots: the extra ones would overwrite
    whatever the other slots hold, behind the picture's back. Refused, in the API's shape."""
    client = await auto_client(engine=engine_for(2), idle_save_s=0)
    service = client.app[SERVICE]
    url = url_of(client)
    a, b = conversation("spill-a"), conversation("spill-b")
    _, ha = await stream_turn(url, a)
    _, hb = await stream_turn(url, b)
    slot_b = int(hb["X-Strata-Slot"])
    held_b = (await service.engine.slots())[slot_b].tokens
    for field in ("n_cmpl", "n"):
        body = {"messages": more(a, "two answers"), "max_tokens": 4, field: 2}
        resp = await client.post("/v1/chat/completions", json=body)
        assert resp.status == 400, (field, await resp.text())
        error = (await resp.json())["error"]
        assert error["type"] == "invalid_request_error" and error["param"] == field, error
    resp = await client.post("/v1/completions", json={"prompt": "x y z", "max_tokens": 2, "n_cmpl": 2})
    assert resp.status == 400 and (await resp.json())["error"]["param"] == "n_cmpl"
    resp = await client.post("/v1/messages", json={"model": "m", "max_tokens": 2, "n_cmpl": 2,
                                                   "messages": [{"role": "user", "content": "hi"}]})
    assert resp.status == 400 and (await resp.json())["type"] == "error", await resp.text()
    assert (await service.engine.slots())[slot_b].tokens == held_b, "B's slot untouched"
    timings, headers = await stream_turn(url, more(b, "back"))
    assert headers["X-Strata-State"] == "slot" and timings["cache_n"] >= OWN_STATE, (headers, timings)
    resp = await client.post("/v1/chat/completions", json={"messages": more(a, "one"), "max_tokens": 2, "n_cmpl": 1})
    assert resp.status == 200, "one completion is what every request gets anyway"


async def test_a_request_the_engine_spreads_over_slots_leaves_no_false_name(auto_client, caplog):
    """Embeddings of several inputs run in several slots at once (the engine places them):
    every slot they touched holds nothing nameable after, so its conversation comes back
    from its file instead of being taken for still held and read anew."""
    caplog.set_level(logging.INFO, logger="strata_serve")
    client = await auto_client(engine=engine_for(2, extra_args=["--embeddings", "--pooling", "mean"]),
                               idle_save_s=0)
    service = client.app[SERVICE]
    url = url_of(client)
    a, b = conversation("emb-a"), conversation("emb-b")
    await stream_turn(url, a)
    await stream_turn(url, b)
    resp = await client.post("/v1/embeddings", json={"input": ["hello there " * 20, "other words " * 30, "x " * 50]})
    assert resp.status == 200, await resp.text()
    engine_held = [report.tokens for report in await service.engine.slots()]
    assert all(tokens < 400 for tokens in engine_held), ("both slots ran an input", engine_held)
    assert [slot.key for slot in service.slots] == [None, None], "neither slot holds A or B any more"
    assert any("ran part of request" in r.getMessage() for r in caplog.records)
    for messages in (a, b):
        timings, headers = await stream_turn(url, more(messages, "back"))
        assert headers["X-Strata-State"] == "disk" and timings["cache_n"] >= OWN_STATE, (headers, timings)
