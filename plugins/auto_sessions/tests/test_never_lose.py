"""Every way the picture of the slot went wrong before, each against the real engine.

Each test here failed on the version that inferred the slot's holder inside
auto-sessions and left conversations to the engine's RAM cache on a guess. Each runs
twice: with auto-sessions (and the test's own plugins) alone, and with every plugin a
default install loads (prefix restore, the quirk plugins, the session header, ...).
"""

from __future__ import annotations

import importlib.metadata
import logging

import pytest

import strata_auto_sessions
from strata_auto_sessions import ParkingMode

import strata_quirks_llama_cpp
import strata_serve
from strata_serve.api import SERVICE
from strata_serve.hook_types import StrataRequest, Verdict
from strata_serve.testing import ask, conversation, until

from .conftest import MIN_TOKENS
from strata_auto_sessions.testing import is_parked
from .test_auto_sessions import key_of, log_lines, parking, slot_dir

#: A return found its own state when it reused at least this much of its ~750-token opening.
OWN_STATE = 600


#: Installed for the tests as a stranger's plugins would be; a user's install has neither.
EXAMPLE_PLUGINS = ["prefix_key", "quirks_strata_metal"]


@pytest.fixture(params=["alone", "default-install"])
def auto_client(request, strata_client_factory, strata_settings_factory):
    """``await auto_client(*more_plugins, engine={...}, **plugin_config)``: auto-sessions
    alone, or every installed plugin (entry points) but the examples."""
    installed = request.param == "default-install"

    async def make(*plugins, engine=None, **plugin_config):
        settings = strata_settings_factory(plugins={"auto_sessions": {"min_tokens": MIN_TOKENS, **plugin_config}},
                                           engine=engine or {},
                                           disable_plugins=EXAMPLE_PLUGINS if installed else [])
        if not installed:
            return await strata_client_factory(strata_auto_sessions, *plugins, settings=settings)
        loaded = {entry.load() for entry in importlib.metadata.entry_points(group="strata_serve")}
        client = await strata_client_factory(*(p for p in plugins if p not in loaded), settings=settings,
                                             entrypoints=True)
        names = {name for name, plugin in client.app[SERVICE].pm.list_name_plugin() if plugin is not None}
        assert {"auto_sessions", "prefix_restore", "quirks_llama_cpp", "session_header"} <= names, names
        assert not names & set(EXAMPLE_PLUGINS), names
        return client

    return make


@pytest.fixture(autouse=True)
def plugin_logs(caplog):
    caplog.set_level(logging.INFO, logger="strata_auto_sessions")


def more(messages: list[dict], text: str) -> list[dict]:
    return messages + [{"role": "assistant", "content": "ok"}, {"role": "user", "content": text}]


async def test_a_failure_after_the_save_never_writes_one_conversation_into_anothers_file(
        auto_client, monkeypatch, caplog):
    client = await auto_client()
    a, b, c = conversation("mix-a"), conversation("mix-b"), conversation("mix-c")
    await ask(client, a)
    await ask(client, b)  # A saved, B held
    store = parking(client).store
    real_sidecar = store.sidecar

    def broken_sidecar(key, sibling=0):
        if key == key_of(client, a):
            raise RuntimeError("the restore step broke after the save")
        return real_sidecar(key, sibling)

    monkeypatch.setattr(store, "sidecar", broken_sidecar)
    await ask(client, a)  # saves B, then the restore of A raises: A runs on a full prefill
    assert any("auto_sessions failed in pre_request" in r.getMessage() or "failed in pre_request" in r.getMessage()
               for r in caplog.records), "the failure is logged with the plugin's name"
    monkeypatch.setattr(store, "sidecar", real_sidecar)
    assert client.app[SERVICE].slots[0].key == key_of(client, a), "the slot holds A, whatever the plugin did"
    await ask(client, c)  # saves what the slot holds (A) into A's file, not into B's
    back_b = await ask(client, more(b, "back to b"))
    assert back_b["timings"]["cache_n"] >= OWN_STATE, "B's file still holds B"
    back_a = await ask(client, more(a, "back to a"))
    assert back_a["timings"]["cache_n"] >= OWN_STATE, "A's file holds A"


async def test_a_ram_cache_set_in_extra_args_is_not_assumed_on(auto_client):
    """`--cache-ram 0` given in extra_args: strata cannot see it, and must not guess."""
    client = await auto_client(engine={"cache_ram_mib": None, "extra_args": ["--cache-ram", "0"]})
    a, b = conversation("extra-a"), conversation("extra-b")
    await ask(client, a)
    await ask(client, b)
    back = await ask(client, more(a, "again"))
    assert back["timings"]["cache_n"] >= OWN_STATE, back["timings"]
    assert parking(client).stats.restores == 1


async def test_two_conversations_with_the_same_opening_never_stop_parking(auto_client):
    """Both open with "Hello" (one default key): restores that go unused say nothing of the engine.

    Kept to one file a key (``siblings = 1``), each restores the other's state; by default
    each would have a file of its own (``test_siblings.py``)."""
    client = await auto_client(strata_quirks_llama_cpp, siblings=1)
    opening = [{"role": "user", "content": "Hello"}]
    x = more(opening, "Tell me about ships. " + " ".join(f"ship{n} sea" for n in range(120)))
    y = more(opening, "Tell me about trees. " + " ".join(f"tree{n} wood" for n in range(120)))
    other = conversation("hello-other")
    for _ in range(3):
        await ask(client, x)
        await ask(client, other)
        await ask(client, y)
        await ask(client, other)
    stats = parking(client).stats
    assert stats.restores_diverged >= 2 and stats.restores_not_reused == 0
    assert parking(client).mode is ParkingMode.ON, "parking goes on"
    back = await ask(client, more(other, "and then?"))
    assert back["timings"]["cache_n"] >= OWN_STATE


async def test_unreused_restores_of_continued_conversations_pause_parking_and_it_resumes(
        auto_client, monkeypatch, caplog):
    """Evidence that the engine cannot reuse restores pauses parking; it tries again later."""
    client = await auto_client(strata_quirks_llama_cpp, retry_after_s=0.2)
    service = client.app[SERVICE]
    real_restore = service.engine.restore
    a, b = conversation("pause-a"), conversation("pause-b")
    await ask(client, a)
    await ask(client, b)

    async def forgetful_restore(filename, slot=0):
        # An engine that reports a restore as done and keeps nothing (a hybrid model's way).
        answer = await real_restore(filename, slot)
        await service.engine.erase(slot)
        return answer

    monkeypatch.setattr(service.engine, "restore", forgetful_restore)
    a, b = more(a, "a1"), more(b, "b1")
    await ask(client, a)
    await ask(client, b)
    stats = parking(client).stats
    assert stats.restores_not_reused == 2 and stats.pauses == 1
    assert parking(client).mode is ParkingMode.PAUSED
    assert any("parking paused" in line for line in log_lines(caplog))
    monkeypatch.setattr(service.engine, "restore", real_restore)
    await until(lambda: parking(client).mode is ParkingMode.ON, what="the pause's end (retry_after_s 0.2)")
    assert any("parking resumes" in line for line in log_lines(caplog))


async def test_a_normal_stop_under_steady_traffic_leaves_every_conversation_on_disk(auto_client):
    """RAM cache at its default, no idle moment: A, B and C all reach disk by the stop."""
    client = await auto_client(engine={"cache_ram_mib": None}, idle_save_s=0)
    chats = [conversation(name) for name in ("stop-a", "stop-b", "stop-c")]
    for messages in chats:
        await ask(client, messages)
    directory = slot_dir(client)
    await client.close()
    for messages in chats:
        assert is_parked(directory, key_of(client, messages))


class SkipEverySave:
    """A third-party quirk plugin: "do not attempt this save"."""

    strata_name = "skip_every_save"

    @strata_serve.hookimpl
    def engine_verdict(self, op, error):
        return Verdict.SKIP if op == "save" and error is None else None


async def test_a_skipped_save_never_lets_a_restore_replace_the_unsaved_state(auto_client):
    client = await auto_client()
    a, b = conversation("skip-a"), conversation("skip-b")
    await ask(client, a)
    await ask(client, b)
    await ask(client, a)  # both have files now; A held, A's file current after the restore...
    a = more(a, "a changes")
    await ask(client, a)  # ...no longer: A's newest turn is in the slot only
    service = client.app[SERVICE]
    service.pm.register(SkipEverySave(), name="skip_every_save")
    restores = parking(client).stats.restores
    await ask(client, more(b, "b returns"))
    stats = parking(client).stats
    assert stats.save_skips_verdict == 1
    assert stats.restores == restores and stats.restores_withheld == 1, "B's file was not loaded over A"
    service.pm.unregister(name="skip_every_save")
    back = await ask(client, more(a, "and a again"))
    assert back["timings"]["cache_n"] >= OWN_STATE, "A's newest state survived"


async def test_post_request_sees_a_client_that_left_during_the_switch(auto_client, monkeypatch):
    import asyncio

    outcomes = []

    class Watcher:
        strata_name = "watcher"

        @strata_serve.hookimpl
        def post_request(self, request, outcome):
            outcomes.append((request.conversation_key, outcome.status))

    client = await auto_client(Watcher())
    service = client.app[SERVICE]
    a, b = conversation("post-a"), conversation("post-b")
    await ask(client, a)
    real_save = service.engine.save
    saving, saved_on = asyncio.Event(), asyncio.Event()

    async def slow_save(filename, slot=0):
        saving.set()
        await saved_on.wait()  # at work until the client has left
        return await real_save(filename, slot)

    monkeypatch.setattr(service.engine, "save", slow_save)
    body = {"messages": b, "max_tokens": 8, "temperature": 0}
    leaving = asyncio.create_task(client.post("/v1/chat/completions", json=body))
    await asyncio.wait_for(saving.wait(), 10)
    leaving.cancel()
    await asyncio.gather(leaving, return_exceptions=True)
    saved_on.set()
    deadline = asyncio.get_running_loop().time() + 10
    while len(outcomes) < 2:
        assert asyncio.get_running_loop().time() < deadline, outcomes
        await asyncio.sleep(0.02)
    assert outcomes[1] == (key_of(client, b), "cancelled")
    assert parking(client).stats.saves == 1


def _request(messages):
    return StrataRequest(route="chat", body={"messages": messages})


async def test_a_model_replaced_in_place_before_a_restart_gets_no_file_of_the_old_one(
        auto_client, tmp_path, caplog):
    import asyncio
    import os
    import shutil
    import signal
    from strata_serve.demo_model import write_demo_model

    model = tmp_path / "model.gguf"
    write_demo_model(model, size="tiny")
    client = await auto_client(engine={"model": str(model)})
    a, b = conversation("swap-a"), conversation("swap-b")
    await ask(client, a)
    await ask(client, b)  # A's file: made by the first model
    other = write_demo_model(tmp_path / "other.gguf", size="tiny", seed=7)
    shutil.copyfile(other, model)  # the same path, another model
    engine = client.app[SERVICE].engine
    generation = engine.generation
    os.kill(engine.pid, signal.SIGKILL)
    deadline = asyncio.get_running_loop().time() + 60
    while engine.generation == generation or not engine.ready:
        assert asyncio.get_running_loop().time() < deadline, "the engine did not come back"
        await asyncio.sleep(0.05)
    reply = await ask(client, a)
    stats = parking(client).stats
    assert stats.restores == 0 and stats.restores_refused_other_model == 1
    assert reply["timings"]["cache_n"] < 50


@pytest.mark.parametrize("step", ["save", "slots read", "restore"])
async def test_a_client_leaving_at_any_await_of_the_plugin_steps_leaves_a_true_picture(
        auto_client, monkeypatch, step):
    """The client leaves while the request's steps before the engine wait on the engine:
    auto-sessions' save of the held conversation, the read of the slots' last tasks (a
    route the engine places itself, on two slots), the restore of the incoming one.

    Each wait is held open just after the engine did its part (the file written, the
    state loaded), the moment a cut would do harm. Then: no temporary file, the picture
    names what the engine holds, post_request ran with the request cancelled, and both
    conversations come back with their own state."""
    import asyncio

    outcomes = []

    class Watcher:
        strata_name = "watcher"

        @strata_serve.hookimpl
        def post_request(self, request, outcome):
            outcomes.append((request.conversation_key, outcome.status, outcome.error))

    two_slots = step == "slots read"
    engine = {"parallel": 2, "ctx_size": 4096} if two_slots else None
    client = await auto_client(Watcher(), engine=engine, idle_save_s=0)
    service = client.app[SERVICE]
    directory = slot_dir(client)
    a, b = conversation(f"gone-a-{step}"), conversation(f"gone-b-{step}")
    await ask(client, b)
    await ask(client, a)  # one slot: B parked, A held unsaved; two slots: one each
    key_a, key_b = key_of(client, a), key_of(client, b)
    reached, release = asyncio.Event(), asyncio.Event()

    def held_open(real):
        async def call(*args, **kwargs):
            answer = await real(*args, **kwargs)
            reached.set()
            await release.wait()
            return answer
        return call

    if step == "save":
        monkeypatch.setattr(service.engine, "save", held_open(service.engine.save))
    elif step == "restore":
        monkeypatch.setattr(service.engine, "restore", held_open(service.engine.restore))
    else:
        from strata_serve import service as service_module

        monkeypatch.setattr(service_module, "last_tasks", held_open(service_module.last_tasks))
    if two_slots:  # llama-server's /v1/messages ignores id_slot: the engine places it
        path, body = "/v1/messages", {"model": "m", "max_tokens": 4, "messages": more(b, "back")}
    else:
        path, body = "/v1/chat/completions", {"messages": more(b, "back"), "max_tokens": 4}
    leaving = asyncio.create_task(client.post(path, json=body))
    await asyncio.wait_for(reached.wait(), 30)
    seen, running = len(outcomes), set(service._tasks)
    assert len(running) == 1
    leaving.cancel()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 10
    # The server saw it leave: the request's task is being cancelled (a shielded step
    # holds it), or it already ended (the slots read is not shielded).
    while not any(task.cancelling() or task.done() for task in running):
        assert loop.time() < deadline, "the server never saw the client leave"
        await asyncio.sleep(0.01)
    release.set()
    while len(outcomes) == seen:
        assert loop.time() < deadline, f"post_request never ran: {outcomes}"
        await asyncio.sleep(0.02)
    monkeypatch.undo()

    assert outcomes[-1] == (key_b, "cancelled", "the client went away before the engine was asked")
    assert not list(directory.glob("tmp-*")), "a temporary file was left behind"
    assert is_parked(directory, key_a)
    pictured = {state.key: state for state in service.slots}
    assert set(pictured) == ({key_a, key_b} if two_slots else {key_b}), list(service.slots)
    if two_slots:
        assert pictured[key_a].file_current, "A was parked before the engine's pick"
    else:
        assert pictured[key_b].file_current and parking(client).stats.restores == 1
    await service.check_slots()
    assert service.slots.corrections == 0, "the engine's token counts disagree with the picture"
    for messages in (b, a):
        back = await ask(client, more(messages, "and again"))
        assert back["timings"]["cache_n"] >= OWN_STATE, back["timings"]
