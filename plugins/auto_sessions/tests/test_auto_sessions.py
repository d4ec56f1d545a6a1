"""auto-sessions against the real engine (tiny model, RAM cache off unless a test turns it on)."""

from __future__ import annotations

import asyncio
import logging
import os
import time
from pathlib import Path

import pytest

import strata_auto_sessions
from strata_auto_sessions import ParkingMode
import strata_serve
from strata_serve.api import SERVICE
from strata_serve.hook_types import Verdict
from strata_serve.testing import ask, conversation, until
from tests.parked_state import (
    STATE_HEADER,
    TOLERANCE,
    WRONG_STATE_DISTANCE,
    engine_ask,
    logprob_body,
    logprob_distance,
    reordered,
    replayed_answer,
    sharp_demo_model,
    switch_and_back,
    wrong_state_answer,
)
from tests.parked_state import ask as ask_for_logprobs

from strata_auto_sessions.testing import is_parked

MIN_TOKENS = 100
#: Tokens generated where an answer's top logprobs are compared.
LOGPROB_TOKENS = 8


def parking(client):
    return client.app[SERVICE].state["auto_sessions"]


def held(client):
    """The core's picture of slot 0."""
    return client.app[SERVICE].slots[0]


def slot_dir(client):
    return client.app[SERVICE].engine.info.slot_save_path


def key_of(client, messages) -> str:
    from strata_serve.hook_types import StrataRequest

    return client.app[SERVICE].conversation_key(StrataRequest(route="chat", body={"messages": messages}))


def log_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name.startswith("strata_auto_sessions")]


@pytest.fixture(scope="module")
def sharp_model(tmp_path_factory):
    """A demo model whose answers depend on their state: where an answer is compared."""
    return sharp_demo_model(tmp_path_factory.mktemp("sharp"))


@pytest.fixture(autouse=True)
def plugin_logs(caplog):
    caplog.set_level(logging.INFO, logger="strata_auto_sessions")


async def test_switch_saves_and_switching_back_restores_exactly(auto_client, llama_server_factory, caplog,
                                                               sharp_model):
    # Whole files (this test reads the file); in blocks: test_block_parking.py.
    client = await auto_client(engine={"model": str(sharp_model)}, blocks=False)
    a, b = conversation("alpha"), conversation("beta")
    # A, B (A saved), A's next turn (A restored and reused): checked inside.
    a2, after_switch = await switch_and_back(client, a, b, LOGPROB_TOKENS)
    key_a = key_of(client, a)
    bin_a = slot_dir(client) / f"auto-{key_a}.bin"
    assert bin_a.stat().st_size > 10_000
    assert oct(bin_a.stat().st_mode & 0o777) == "0o600"
    assert any("saved" in l and f"auto-{key_a}.bin in" in l and "tokens (" in l for l in log_lines(caplog))
    assert any(l.startswith("[strata] auto sessions: restored") and f"auto-{key_a}.bin" in l
               for l in log_lines(caplog))

    # Answered from A's own state: the top logprobs of a fresh engine that ran A's turns
    # with no switch between them. A's tokens over another state's KV data must differ.
    fresh = await llama_server_factory(model=sharp_model)
    reference = await replayed_answer(fresh, a, a2, LOGPROB_TOKENS)
    assert logprob_distance(after_switch, reference) <= TOLERANCE
    wrong = await wrong_state_answer(fresh, fresh.info.slot_save_path, a, reordered(a), a2, LOGPROB_TOKENS)
    assert logprob_distance(wrong, reference) > WRONG_STATE_DISTANCE


async def test_same_key_neither_saves_nor_restores(auto_client):
    client = await auto_client()
    a = conversation("same", turns=1)
    for turns in (1, 2, 3):
        await ask(client, conversation("same", turns=turns))
    stats = parking(client).stats
    assert stats.saves == 0 and stats.restores == 0 and stats.save_skips_below_min == 0
    assert not list(slot_dir(client).glob("auto-*.bin"))
    assert held(client).key == key_of(client, a)
    assert held(client).tokens > MIN_TOKENS


async def test_below_min_tokens_is_skipped_and_logged(auto_client, caplog):
    client = await auto_client()
    short = [{"role": "user", "content": "hi"}]
    await ask(client, short)
    await ask(client, conversation("long"))
    assert parking(client).stats.save_skips_below_min == 1
    assert not list(slot_dir(client).glob("auto-*.bin"))
    assert any("not saving" in l and "below min_tokens" in l for l in log_lines(caplog))


async def test_a_request_without_a_key_parks_the_held_conversation_first(auto_client):
    client = await auto_client()
    keyed = conversation("keyed")
    await ask(client, keyed)
    system_only = [{"role": "system", "content": "no user text here"}]
    await ask(client, system_only)
    stats = parking(client).stats
    assert stats.saves == 1, "the keyed conversation was saved before the keyless request took the slot"
    assert held(client).key is None, "a keyless request took the slot"
    back = await ask(client, keyed)
    assert stats.restores == 1 and back["timings"]["cache_n"] > MIN_TOKENS
    await ask(client, system_only)
    assert stats.saves == 2, "the restored conversation ran again, so its file was saved anew"


async def test_a_restore_writes_no_sidecar_and_the_last_use_is_written_as_the_file_goes_back(auto_client):
    """The restore's path writes nothing: the restored conversation's sidecar says when it
    was last used once it leaves the slot, by its next save when its turn changed it, by
    a touch when it goes back unchanged (its request refused by the engine)."""
    client = await auto_client()
    a, b = conversation("used-a"), conversation("used-b")
    await ask(client, a)
    await ask(client, b)  # A saved
    store, key_a = parking(client).store, key_of(client, a)
    saved_at, held_tokens = store.sidecar(key_a).last_used, store.sidecar(key_a).tokens
    sidecar_written = store.sidecar_path(key_a).stat().st_mtime_ns
    await asyncio.sleep(0.05)

    refused = await client.post("/v1/chat/completions",
                                json={"messages": a, "max_tokens": 4, "grammar": "root ::= ((( not a grammar"})
    assert 400 <= refused.status < 500, await refused.text()
    stats = parking(client).stats
    assert stats.restores == 1 and held(client).key == key_a and held(client).file_current
    assert store.sidecar_path(key_a).stat().st_mtime_ns == sidecar_written, "nothing written on the restore's path"
    saves = stats.saves  # B's, as A came back
    await ask(client, b)  # A goes back unchanged: its file is current, its sidecar touched
    assert stats.saves == saves and stats.save_skips_unchanged == 1
    touched = store.sidecar(key_a).last_used
    assert touched > saved_at and store.sidecar(key_a).tokens == held_tokens

    await ask(client, conversation("used-a", turns=2))  # restored, and its next turn changes it
    await ask(client, b)
    assert stats.restores == 4 and stats.save_skips_unchanged == 1, "A's changed state saved, with its last use"
    assert store.sidecar(key_a).last_used > touched and store.sidecar(key_a).tokens > held_tokens


@pytest.mark.parametrize("cache_ram_mib", [0, 256])
async def test_shutdown_saves_and_next_start_restores(auto_client, caplog, cache_ram_mib):
    client = await auto_client(engine={"cache_ram_mib": cache_ram_mib})
    a = conversation("restart")
    await ask(client, a)
    directory = slot_dir(client)
    await client.close()  # a normal stop: drain, on_shutdown, engine stopped
    key = key_of(client, a)
    assert is_parked(directory, key)
    assert any("(shutdown)" in l for l in log_lines(caplog))

    again = await auto_client(engine={"cache_ram_mib": cache_ram_mib})
    reply = await ask(again, a)  # a new engine: its RAM cache is empty, the disk has A
    assert parking(again).stats.restores == 1
    timings = reply["timings"]
    assert timings["cache_n"] >= timings["prompt_n"] + timings["cache_n"] - 2


async def test_failed_save_does_not_restore_over_the_held_state(auto_client, caplog, monkeypatch):
    client = await auto_client()
    a, b = conversation("keep"), conversation("other")
    await ask(client, b)
    await ask(client, a)  # B is saved here, A is held
    key_a = key_of(client, a)
    # Make the engine's own save fail for real: its target name is taken by a directory.
    store = parking(client).store
    monkeypatch.setattr(store, "temp_name", lambda key: "tmp-auto-blocked.bin")
    (store.directory / "tmp-auto-blocked.bin").mkdir()
    reply = await ask(client, b)
    stats = parking(client).stats
    assert stats.save_failures == 1
    assert stats.restores == 0 and stats.restores_withheld == 1
    assert reply["choices"], "the request itself is answered"
    assert not is_parked(store.directory, key_a)
    assert any("saving" in l and "failed" in l for l in log_lines(caplog))
    assert held(client).key == key_of(client, b), "the incoming request took the slot all the same"


class ProvisionalQuirk:
    """A quirk plugin saying every failed save held only provisional state."""

    strata_name = "provisional_quirk"

    @strata_serve.hookimpl
    def engine_verdict(self, op, error):
        if op == "save" and error is not None:
            return Verdict.PROVISIONAL
        return None


async def test_provisional_verdict_lets_the_restore_happen(auto_client, monkeypatch):
    client = await auto_client(ProvisionalQuirk())
    a, b = conversation("prov-a"), conversation("prov-b")
    await ask(client, b)
    await ask(client, a)
    store = parking(client).store
    monkeypatch.setattr(store, "temp_name", lambda key: "tmp-auto-blocked.bin")
    (store.directory / "tmp-auto-blocked.bin").mkdir()
    reply = await ask(client, b)
    stats = parking(client).stats
    assert stats.save_failures == 1 and stats.restores == 1
    assert reply["timings"]["cache_n"] > MIN_TOKENS


async def test_pruning_by_count_leaves_manual_files(auto_client):
    client = await auto_client(keep=2, blocks=False)  # whole files: in blocks, test_block_parking.py
    await ask(client, conversation("p0"))
    saved = await client.post("/slots/0?action=save", json={"filename": "manual.bin"})
    assert saved.status == 200
    for name in ("p1", "p2", "p3", "p4"):
        await ask(client, conversation(name))
    names = sorted(p.name for p in slot_dir(client).glob("*.bin"))
    assert "manual.bin" in names
    assert len([n for n in names if n.startswith("auto-")]) == 2
    assert parking(client).stats.prunes == 2


async def test_pruning_by_size_spares_the_newest_and_the_incoming_file(auto_client, caplog):
    # About one byte: every file is over. Whole files: in blocks, test_block_parking.py.
    client = await auto_client(max_gb=1e-9, blocks=False)
    s0, s1, s2 = conversation("s0"), conversation("s1"), conversation("s2")
    await ask(client, s0)
    await ask(client, s1)
    stats = parking(client).stats
    assert stats.saves == 1 and stats.prunes == 0, "the file just saved is never pruned"
    assert any("more than max_gb" in line for line in log_lines(caplog))
    await ask(client, s2)
    assert stats.saves == 2 and stats.prunes == 1
    names = {p.name for p in slot_dir(client).glob("auto-*.bin")}
    assert names == {f"auto-{key_of(client, s1)}.bin"}
    back = await ask(client, s1)  # saves s2, whose prune must not take s1 from under the restore
    assert stats.restores == 1 and back["timings"]["cache_n"] > MIN_TOKENS


async def test_file_from_another_model_is_refused(auto_client, auto_settings, strata_client_factory,
                                                  tmp_path, caplog):
    from strata_serve.demo_model import write_demo_model

    other = write_demo_model(tmp_path / "other.gguf", size="tiny", seed=7)
    a = conversation("model")
    first = await strata_client_factory(strata_auto_sessions, settings=auto_settings({"model": str(other)}))
    await ask(first, a)
    await first.close()  # saves A's state, made by the other model
    key = key_of(first, a)
    assert is_parked(slot_dir(first), key)

    client = await auto_client()
    reply = await ask(client, a)
    assert parking(client).stats.restores == 0
    assert parking(client).stats.restores_refused_other_model == 1
    assert reply["timings"]["cache_n"] == 0
    assert any("another model" in l for l in log_lines(caplog))


@pytest.mark.parametrize("damage", ["truncated", "overwritten"])
async def test_damaged_file_is_never_handed_to_the_engine(auto_client, llama_server_factory, caplog, damage,
                                                          sharp_model):
    # A whole file damaged; a damaged block: test_block_parking.py.
    client = await auto_client(engine={"model": str(sharp_model)}, blocks=False)
    a, b = conversation("trunc-a"), conversation("trunc-b")
    await ask(client, a)
    await ask(client, b)
    await ask(client, conversation("trunc-c"))  # B saved too
    path = slot_dir(client) / f"auto-{key_of(client, a)}.bin"
    data = path.read_bytes()
    if damage == "truncated":
        path.write_bytes(data[: len(data) // 2])
    else:
        # 12% of A's KV data overwritten with B's bytes at the same place: its tokens stay,
        # so an engine handed this file would reuse the damaged state as A's.
        other = (slot_dir(client) / f"auto-{key_of(client, b)}.bin").read_bytes()
        tokens_end = STATE_HEADER.size + 4 * STATE_HEADER.unpack_from(data)[2]
        start = tokens_end + (len(data) - tokens_end) // 2
        end = start + len(data) * 12 // 100
        assert data[start:end] != other[start:end] and len(other) >= end
        path.write_bytes(data[:start] + other[start:end] + data[end:])
    reply = await ask_for_logprobs(client, logprob_body(a, LOGPROB_TOKENS))
    stats = parking(client).stats
    assert stats.restores_refused_damaged == 1 and stats.restores == 0 and stats.restore_failures == 0
    assert reply["timings"]["cache_n"] < 40, "only the shared chat-template prefix is reused"
    assert any("truncated or damaged" in line for line in log_lines(caplog))
    assert client.app[SERVICE].engine.generation == 1, "the engine never restarted"
    # Answered as a fresh engine answers A, by the top logprobs; an answer from a state
    # that is not A's (A's tokens over another state's KV data) differs.
    fresh = await llama_server_factory(model=sharp_model)
    reference = await engine_ask(fresh, logprob_body(a, LOGPROB_TOKENS))
    assert reference["timings"]["cache_n"] == 0
    assert logprob_distance(reply, reference) <= TOLERANCE
    await fresh.erase()
    wrong = await wrong_state_answer(fresh, fresh.info.slot_save_path, a, reordered(a), a, LOGPROB_TOKENS)
    assert logprob_distance(wrong, reference) > WRONG_STATE_DISTANCE


async def test_a_restore_of_a_changed_conversation_is_not_held_against_the_engine(auto_client, caplog):
    # One file a key: a changed conversation is restored from it (by default it would be
    # a sibling of its own, started from none of it).
    client = await auto_client(siblings=1)
    a, b = conversation("reuse-a"), conversation("reuse-b")
    await ask(client, a)
    await ask(client, b)
    # Same first user message (same key), but a new system prompt in front: the
    # restored state matches almost none of the new prompt. That is the conversation's
    # doing, not the engine's: parking goes on.
    changed = [{"role": "system", "content": "A brand new system prompt " * 3}] + a
    for _ in range(3):
        await ask(client, changed)
        await ask(client, b)
    stats = parking(client).stats
    assert stats.restores >= 3 and stats.restores_diverged >= 1
    assert stats.restores_not_reused == 0 and stats.pauses == 0
    assert parking(client).mode is ParkingMode.ON
    assert any("changed since its file was saved" in l for l in log_lines(caplog))


async def test_refused_without_a_slot_directory(strata_client_factory, auto_settings, caplog):
    client = await strata_client_factory(strata_auto_sessions, settings=auto_settings({"slot_save_path": None}))
    await ask(client, conversation("nodir"))
    assert parking(client).mode is ParkingMode.OFF
    assert any("no slot directory" in l for l in log_lines(caplog))


async def test_temporaries_from_a_crash_are_cleaned_at_start(auto_settings, strata_client_factory):
    settings = auto_settings()
    directory = settings.engine.slot_save_path
    directory.mkdir(parents=True)
    (directory / "tmp-auto-dead-0000.bin").write_bytes(b"half a file")
    client = await strata_client_factory(strata_auto_sessions, settings=settings)
    assert not (directory / "tmp-auto-dead-0000.bin").exists()
    assert parking(client).mode is ParkingMode.ON


async def test_collect_stats_reports_the_numbers(auto_client):
    client = await auto_client()
    await ask(client, conversation("st-a"))
    await ask(client, conversation("st-b"))
    await ask(client, conversation("st-a"))
    from strata_serve.plugins import call_each_sync

    reported = dict(call_each_sync(client.app[SERVICE].pm, "collect_stats", service=client.app[SERVICE]))
    numbers = reported["auto_sessions"]
    assert numbers["saves"] == 2 and numbers["restores"] == 1
    assert numbers["files_on_disk"] == 2 and numbers["bytes_on_disk"] > 20_000
    assert numbers["save_ms"] > 0 and numbers["restored_tokens"] > MIN_TOKENS


async def test_disabled_in_config_does_nothing(strata_client_factory, strata_settings_factory):
    settings = strata_settings_factory(plugins={"auto_sessions": {"enabled": False, "min_tokens": 1}})
    client = await strata_client_factory(strata_auto_sessions, settings=settings)
    await ask(client, conversation("off-a"))
    await ask(client, conversation("off-b"))
    assert "auto_sessions" not in client.app[SERVICE].state
    assert not list(slot_dir(client).glob("auto-*"))


async def test_ram_cache_on_abab_never_worse_than_the_bare_engine(
    auto_client, strata_client_factory, strata_settings_factory
):
    """A -> B -> A -> B -> A with the engine's RAM cache on, with and without the plugin.

    Reuse (``cache_n``) is the deterministic measure of speed here: a step with the
    plugin must reuse as much as the same step on the bare engine.
    """
    engine = {"cache_ram_mib": 256}
    bare = await strata_client_factory(settings=strata_settings_factory(engine=engine))
    parked = await auto_client(engine=engine)
    a, b = conversation("ram-a"), conversation("ram-b")
    for step, messages in enumerate((a, b, a, b, a)):
        without = (await ask(bare, messages))["timings"]
        with_it = (await ask(parked, messages))["timings"]
        assert with_it["cache_n"] >= without["cache_n"] - 1, (step, with_it, without)
        if step >= 2:
            assert without["cache_n"] > MIN_TOKENS, "the bare engine's RAM cache brings it back"
    stats = parking(parked).stats
    # With room in the RAM cache the switches are left to it (``ram_first``): one save,
    # the engine's first state (which measures its size), and every return from RAM.
    assert stats.saves == 1 and stats.restores == 0 and stats.ram_hits == 3


async def test_a_return_the_engine_is_about_to_evict_from_ram_is_restored_from_disk(auto_client):
    """--cache-ram 1 holds about two of these conversations: parking C pushes A out.

    The engine parks the outgoing conversation (evicting the oldest) before it
    looks for the incoming one, so A must come back from disk, not be left to RAM.
    """
    client = await auto_client(engine={"cache_ram_mib": 1})
    a, b, c = conversation("evict-a"), conversation("evict-b"), conversation("evict-c")
    for messages in (a, b, c):
        await ask(client, messages)
    back = await ask(client, a)
    assert back["timings"]["cache_n"] > MIN_TOKENS, back["timings"]
    assert parking(client).stats.restores == 1


class RetryQuirk:
    """A quirk plugin saying a failed save is worth one more try."""

    strata_name = "retry_quirk"

    @strata_serve.hookimpl
    def engine_verdict(self, op, error):
        return Verdict.RETRY if op == "save" and error is not None else None


async def test_retry_verdict_tries_the_save_once_more(auto_client, monkeypatch):
    client = await auto_client(RetryQuirk())
    a, b = conversation("retry-a"), conversation("retry-b")
    await ask(client, b)
    await ask(client, a)  # B saved; A held
    store = parking(client).store
    real_name = store.temp_name
    names = iter(["tmp-auto-blocked.bin"])
    monkeypatch.setattr(store, "temp_name", lambda key: next(names, None) or real_name(key))
    (store.directory / "tmp-auto-blocked.bin").mkdir()
    await ask(client, b)
    stats = parking(client).stats
    assert stats.saves == 2 and stats.save_failures == 0, "the second try saved A"
    assert stats.restores == 1, "and B was restored as usual"
    assert is_parked(store.directory, key_of(client, a))


async def test_an_idle_server_saves_the_held_conversation_so_the_switch_does_not(auto_client, caplog):
    client = await auto_client(idle_save_s=0.2)
    a, b = conversation("idle-a"), conversation("idle-b")
    await ask(client, a)
    key_a = key_of(client, a)
    await until(lambda: parking(client).stats.idle_saves == 1, what="the idle save")
    assert is_parked(slot_dir(client), key_a)
    assert any(f"auto-{key_a}.bin" in line and "(idle)" in line for line in log_lines(caplog))
    await ask(client, b)  # the switch: A is on disk already
    stats = parking(client).stats
    assert stats.idle_saves == 1 and stats.saves == 1 and stats.save_skips_unchanged == 1
    await ask(client, a)
    assert parking(client).stats.restores == 1


async def test_a_request_arriving_during_an_idle_save_waits_and_is_answered(auto_client):
    client = await auto_client(idle_save_s=0.05)
    service = client.app[SERVICE]
    a = conversation("busy-a")
    real_save, saving, go_on = service.engine.save, asyncio.Event(), asyncio.Event()

    async def save_held_open(filename, slot=0):
        saving.set()
        await go_on.wait()  # the idle save is running while the requests arrive
        return await real_save(filename, slot)

    service.engine.save = save_held_open
    await ask(client, a)
    await asyncio.wait_for(saving.wait(), 10)
    asking = [asyncio.create_task(ask(client, conversation(f"busy-{n}"))) for n in range(3)]
    await until(lambda: service.fifo.waiting == 3, what="the requests waiting for the idle save")
    go_on.set()
    replies = await asyncio.gather(*asking)
    assert all(r["choices"] for r in replies)
    assert parking(client).stats.save_failures == 0 and parking(client).stats.idle_saves == 1


async def test_past_the_ram_budget_every_return_still_finds_its_state(auto_client):
    """Four conversations round robin; --cache-ram 1 holds about two of them.

    With the cache this full, an outgoing conversation parked only in RAM would
    soon be evicted and lost from both tiers: it must be saved at the switch.
    """
    client = await auto_client(engine={"cache_ram_mib": 1})
    names = ["rr-a", "rr-b", "rr-c", "rr-d"]
    for name in names:
        await ask(client, conversation(name))
    reused = [(await ask(client, conversation(name)))["timings"]["cache_n"] for name in names * 2]
    assert all(r > MIN_TOKENS for r in reused), reused


@pytest.mark.parametrize("action", ["erase", "restore"])
async def test_a_slot_action_by_hand_parks_the_held_conversation_first(auto_client, caplog, action):
    client = await auto_client()
    a, b = conversation("hand-a"), conversation("hand-b")
    await ask(client, b)
    saved = await client.post("/slots/0?action=save", json={"filename": "manual-b.bin"})
    assert saved.status == 200, await saved.text()
    await ask(client, a)  # B parked at the switch; A held, worth a file, not saved
    key_a = key_of(client, a)
    assert not is_parked(slot_dir(client), key_a) and not held(client).file_current
    saves = parking(client).stats.saves

    if action == "erase":
        resp = await client.post("/slots/0?action=erase")
    else:
        resp = await client.post("/slots/0?action=restore", json={"filename": "manual-b.bin"})
    assert resp.status == 200, await resp.text()
    # Written before the action: after it the slot no longer holds A (an erase empties it,
    # a restore puts B there), so a save then could not have held A's tokens.
    assert parking(client).stats.saves == saves + 1
    sidecar = parking(client).store.sidecar(key_a)
    assert is_parked(slot_dir(client), key_a) and sidecar is not None and sidecar.tokens > 600, sidecar
    assert any(f"auto-{key_a}.bin" in line and "(slot action)" in line for line in log_lines(caplog))

    back = await ask(client, a + [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "Go on."}])
    assert parking(client).stats.restores == 1
    assert back["timings"]["cache_n"] > 600, f"A's next turn re-read its context: {back['timings']}"


async def test_a_failed_idle_save_still_leaves_the_shutdown_save(auto_client, caplog):
    client = await auto_client(idle_save_s=0.2)
    a = conversation("idle-fail")
    await ask(client, a)
    directory = slot_dir(client)
    aside = directory.with_name(directory.name + "-aside")
    directory.rename(aside)  # the slot directory is gone while the server is idle
    try:
        deadline = asyncio.get_running_loop().time() + 10
        while parking(client).stats.save_failures == 0:
            assert asyncio.get_running_loop().time() < deadline, "the idle save never ran"
            await asyncio.sleep(0.05)
    finally:
        aside.rename(directory)
    stats = parking(client).stats
    assert stats.idle_saves == 0 and stats.saves == 0
    assert any("saving" in l and "failed" in l for l in log_lines(caplog))
    key = key_of(client, a)
    assert not is_parked(directory, key)

    await client.close()  # a normal stop, the directory back in place
    assert is_parked(directory, key), "the shutdown saved the conversation the idle save missed"
    assert any(f"auto-{key}.bin" in l and "(shutdown)" in l for l in log_lines(caplog))

    again = await auto_client()
    reply = await ask(again, a)
    assert parking(again).stats.restores == 1
    timings = reply["timings"]
    assert timings["cache_n"] >= timings["prompt_n"] + timings["cache_n"] - 2, timings


async def test_a_save_is_on_disk_before_its_name_appears(auto_client, monkeypatch):
    """With ``fsync = "at_save"``: the file's data is fsynced before the rename gives it its
    name, and the directory after it (so the rename itself survives a power cut) before the
    save is reported."""
    client = await auto_client(fsync="at_save", blocks=False)  # a whole file's fsyncs and rename
    a, b = conversation("sync-a"), conversation("sync-b")
    await ask(client, a)
    directory = slot_dir(client).resolve()
    calls: list[tuple[str, ...]] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        calls.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    def replace(src, dst, *args, **kwargs):
        calls.append(("replace", str(Path(src).resolve()), str(Path(dst).resolve())))
        return real_replace(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    await ask(client, b)  # the switch saves A
    monkeypatch.undo()
    store = parking(client).store
    target = str(store.bin_path(key_of(client, a)).resolve())
    renames = [n for n, call in enumerate(calls) if call[0] == "replace" and call[2] == target]
    assert len(renames) == 1, calls
    rename = renames[0]
    temp = calls[rename][1]
    assert ("fsync", temp) in calls[:rename], f"the data was not synced before the rename: {calls}"
    assert ("fsync", str(directory)) in calls[rename + 1:], f"the directory was not synced after it: {calls}"
    sidecar = str(store.sidecar_path(key_of(client, a)).resolve())
    sidecar_renames = [n for n, call in enumerate(calls) if call[0] == "replace" and call[2] == sidecar]
    assert sidecar_renames and all(n < rename for n in sidecar_renames), "the sidecar is in place first"
    assert ("fsync", calls[sidecar_renames[0]][1]) in calls[:sidecar_renames[0]], calls


#: How long each fsync takes in the test of a slow disk.
SLOW_FSYNC_S = 2.0



async def test_the_background_fsyncs_start_once_the_switch_is_done(auto_client, monkeypatch):
    """The fsyncs of the save a switch made start after that request's steps before the
    engine (the renames and the restore), beside the engine's work, never during them:
    a file system's journal commit would make the switch's own renames wait."""
    client = await auto_client()
    a, b = conversation("order-a"), conversation("order-b")
    await ask(client, a)
    store, steps = parking(client).store, []
    real_sync, real_restore = store.sync_written, client.app[SERVICE].engine.restore

    def sync_written():
        steps.append("fsync")
        return real_sync()

    async def restore(*args, **kwargs):
        await asyncio.sleep(0.3)  # time enough for an fsync begun with the save to run
        answer = await real_restore(*args, **kwargs)
        steps.append("restored")
        return answer

    monkeypatch.setattr(store, "sync_written", sync_written)
    monkeypatch.setattr(client.app[SERVICE].engine, "restore", restore)
    await ask(client, b)  # A saved
    await parking(client).synced()  # A's fsyncs, beside B's turn or after it on a busy machine
    assert steps == ["fsync"], steps
    await ask(client, a)  # B saved, A restored
    await parking(client).synced()
    assert steps[:2] == ["fsync", "restored"] and steps[2:] and set(steps[2:]) == {"fsync"}, steps

@pytest.mark.parametrize("fsync", ["background", "at_save"])
async def test_a_switch_does_not_wait_for_the_disk_and_a_stop_waits_for_every_fsync(auto_client, monkeypatch,
                                                                                      fsync):
    """With ``fsync = "background"`` (the default) the save's fsyncs run beside the next
    request: on a disk slow to sync (every fsync takes 2 s here) the switch is answered
    without waiting for them, and a normal stop waits until the file, its sidecar and the
    directory are synced. The control, ``at_save``, answers only after its three fsyncs."""
    client = await auto_client(fsync=fsync, blocks=False)  # a whole file's fsyncs
    a, b = conversation("disk-a"), conversation("disk-b")
    await ask(client, a)
    store = parking(client).store
    real_fsync = os.fsync
    synced: list[str] = []

    def slow_fsync(fd):
        time.sleep(SLOW_FSYNC_S)  # in a worker thread (background) or on the loop (at_save)
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        return real_fsync(fd)

    monkeypatch.setattr(os, "fsync", slow_fsync)
    began = time.monotonic()
    await ask(client, b)  # the switch saves A
    answered_s = time.monotonic() - began
    target = str(store.bin_path(key_of(client, a)).resolve())
    if fsync == "background":
        assert answered_s < SLOW_FSYNC_S, f"the switch waited {answered_s:.1f} s for the disk"
        await asyncio.wait_for(client.app[SERVICE].shutdown(), 60)
    else:
        assert answered_s >= 3 * SLOW_FSYNC_S, f"the control answered after {answered_s:.1f} s, before its fsyncs"
    monkeypatch.undo()
    sidecar = str(store.sidecar_path(key_of(client, a)).resolve())
    assert target in synced or any(Path(p).name.startswith("tmp-auto-") for p in synced), synced
    assert str(slot_dir(client).resolve()) in synced, synced
    if fsync == "background":
        assert target in synced and sidecar in synced, synced
    assert store.unsynced == 0
