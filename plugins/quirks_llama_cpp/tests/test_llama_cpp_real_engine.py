"""The llama.cpp quirks against the real llama-server, and what auto-sessions does with them."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

import strata_auto_sessions
import strata_quirks_llama_cpp
import strata_serve
from strata_serve import EngineError, Verdict
from strata_serve.api import SERVICE
from strata_serve.testing import ask, conversation

MIN_TOKENS = 100


def behind_a_system_prompt(messages: list[dict], text: str) -> list[dict]:
    """The same conversation (same key) with a system prompt in front: a restore of it matches little."""
    return [{"role": "system", "content": text * 3}, *messages]


@pytest.fixture
def parked_client(strata_client_factory, strata_settings_factory):
    """``await parked_client(*quirk_plugins, **plugins_config)``: auto-sessions on the real engine."""

    async def make(*plugins, **plugins_config):
        settings = strata_settings_factory(plugins={"auto_sessions": {"min_tokens": MIN_TOKENS}, **plugins_config})
        return await strata_client_factory(strata_auto_sessions, *plugins, settings=settings)

    return make


# -- a refused filename: a plain error, never a crash ---------------------------------

async def test_engine_refusing_a_filename_is_a_plain_error(llama_server_factory):
    engine = await llama_server_factory()
    with pytest.raises(EngineError) as refused:
        await engine.save("../outside.bin")
    assert (refused.value.status, refused.value.message) == (400, "Invalid filename")
    verdict = strata_quirks_llama_cpp.engine_verdict(op="save", error=refused.value, engine=engine, held_tokens=None,
                                                     service=SimpleNamespace(state={}))
    assert verdict is None
    assert await engine.health()
    assert (await engine.save("inside.bin")).raw["filename"] == "inside.bin", "the engine carries on"


async def test_auto_sessions_meets_a_refused_filename_and_carries_on(parked_client, monkeypatch):
    client = await parked_client(strata_quirks_llama_cpp)
    parking = client.app[SERVICE].state["auto_sessions"]
    a, b = conversation("name-a"), conversation("name-b")
    await ask(client, a)
    monkeypatch.setattr(parking.store, "temp_name", lambda key: "../refused.bin")
    reply = await ask(client, b)  # the save of A is refused by the engine itself
    # A plain error: the held state is kept (not restored over), nothing is given up.
    assert parking.stats.save_failures == 1 and parking.stats.restores_withheld == 1
    assert reply["choices"][0]["message"]["content"] is not None
    assert parking.mode.parks, "a refused name is no reason to stop parking"
    assert (await client.get("/health")).status == 200


# -- a slot call the engine does not support: unsupported, said once -------------------

@pytest.mark.parametrize("with_quirks", [True, False], ids=["with-quirks", "without"])
async def test_slot_files_the_engine_does_not_support(
    llama_server_factory, strata_client_factory, strata_settings_factory, tmp_path, caplog, with_quirks
):
    # A real 501 "not supported": an engine started without --slot-save-path, attached
    # by URL. Builds affected by llama.cpp issue 21133 answer a multimodal slot the same way.
    bare = await llama_server_factory(slot_save_path=None)
    settings = strata_settings_factory(engine={"url": bare.info.url, "slot_save_path": str(tmp_path / "ours"),
                                               "api_key": bare.api_key.get_secret_value()},
                                       plugins={"auto_sessions": {"min_tokens": MIN_TOKENS}})
    plugins = (strata_quirks_llama_cpp,) if with_quirks else ()
    client = await strata_client_factory(strata_auto_sessions, *plugins, settings=settings)
    parking = client.app[SERVICE].state["auto_sessions"]
    a, b = conversation("refused-a"), conversation("refused-b")
    for messages in (a, b, a, b):
        await ask(client, messages)
    said = [r.getMessage() for r in caplog.records if r.name == "strata_quirks_llama_cpp"]
    if with_quirks:
        assert parking.stats.save_failures == 1 and not parking.mode.parks, "one failed call, then no more"
        assert len(said) == 1 and "HTTP 501" in said[0]
    else:
        assert parking.stats.save_failures >= 2 and parking.mode.parks, "it keeps failing at switches"
        assert not said


# -- restores that are not reused --------------------------------------------------

def continued(messages: list[dict], n: int) -> list[dict]:
    return messages + [{"role": "assistant", "content": "ok"}, {"role": "user", "content": f"go on {n}"}]


@pytest.fixture
def forgetful_engine(monkeypatch):
    """Make a server's engine report restores as done and keep nothing: what llama-server
    does on hybrid, recurrent and SWA models (llama.cpp issues 25913, 28194), which the
    demo model is not. A named test double over the real engine's own restore."""

    def install(client):
        engine = client.app[SERVICE].engine
        real_restore = engine.restore

        async def restore_then_forget(filename, slot=0):
            answer = await real_restore(filename, slot)
            await engine.erase(slot)
            return answer

        monkeypatch.setattr(engine, "restore", restore_then_forget)

    return install


async def switch_back_unreused(client, a, b, times: int) -> tuple[list, list]:
    """Make ``times`` restores of A go unused, A and B continued each time."""
    await ask(client, a)
    await ask(client, b)
    for n in range(times):
        a, b = continued(a, n), continued(b, n)
        await ask(client, a)
        await ask(client, b)
    return a, b


async def test_two_unreused_restores_pause_parking_for_the_model(parked_client, forgetful_engine, caplog):
    caplog.set_level(logging.INFO)
    client = await parked_client(strata_quirks_llama_cpp)
    forgetful_engine(client)
    parking = client.app[SERVICE].state["auto_sessions"]
    a, b = conversation("reuse-a"), conversation("reuse-b")
    await ask(client, a)
    await ask(client, b)
    await ask(client, continued(a, 0))
    assert parking.stats.restores_not_reused == 1 and parking.mode.parks, "one case says nothing yet"

    await ask(client, continued(b, 0))
    assert parking.stats.restores_not_reused == 2
    assert not parking.mode.parks
    saves, files = parking.stats.saves, sorted(parking.store.directory.iterdir())
    for messages in (continued(a, 1), continued(b, 1), continued(a, 2)):
        await ask(client, messages)
    assert parking.stats.saves == saves and sorted(parking.store.directory.iterdir()) == files
    why = [r.getMessage() for r in caplog.records if r.name == "strata_quirks_llama_cpp"]
    assert len(why) == 1 and "parking pauses for this model" in why[0]
    assert any("parking paused" in r.getMessage() for r in caplog.records if r.name == "strata_auto_sessions")


async def test_an_edited_system_prompt_never_stops_parking(parked_client, caplog):
    """Restores of a conversation that changed (same key) go unused; that says nothing of the engine.

    One file a key (``siblings = 1``): by default the edited conversation would be a
    sibling of its own, and nothing of it restored from the other."""
    client = await parked_client(strata_quirks_llama_cpp, auto_sessions={"min_tokens": MIN_TOKENS, "siblings": 1})
    parking = client.app[SERVICE].state["auto_sessions"]
    a, b = conversation("edit-a"), conversation("edit-b")
    await ask(client, a)
    await ask(client, b)
    for n in range(3):
        await ask(client, behind_a_system_prompt(a, f"System prompt number {n}, brand new. "))
        await ask(client, b)
    assert parking.stats.restores_diverged >= 3 and parking.stats.restores_not_reused == 0
    assert parking.mode.parks


@pytest.mark.parametrize("plugins, plugins_config", [
    ((), {}),
    ((strata_quirks_llama_cpp,), {"quirks_llama_cpp": {"enabled": False}}),
], ids=["not-installed", "disabled"])
async def test_without_the_plugin_parking_goes_on(parked_client, forgetful_engine, plugins, plugins_config):
    client = await parked_client(*plugins, **plugins_config)
    forgetful_engine(client)
    parking = client.app[SERVICE].state["auto_sessions"]
    a, b = await switch_back_unreused(client, conversation("reuse-a"), conversation("reuse-b"), times=1)
    assert parking.stats.restores_not_reused == 2
    assert parking.mode.parks
    saves = parking.stats.saves
    await ask(client, continued(a, 5))
    assert parking.stats.saves == saves + 1


# -- an empty slot -----------------------------------------------------------------

class ShutdownSaver:
    """A plugin of the kind the SKIP verdict protects: it saves the slot at shutdown.

    It knows how many tokens the slot holds from the requests it saw, and asks
    the quirk plugins before the call, as every caller should.
    """

    strata_name = "shutdown_saver"

    def __init__(self):
        self.held_tokens = 0
        self.saved = None

    @strata_serve.hookimpl
    def post_request(self, outcome):
        if outcome.status == "ok" and outcome.context_tokens is not None:
            self.held_tokens = outcome.context_tokens

    @strata_serve.hookimpl
    async def on_shutdown(self, service):
        if service.verdict("save", None, self.held_tokens) == Verdict.SKIP:
            return
        self.saved = await service.engine.save("at-shutdown.bin")


@pytest.mark.parametrize("plugins, expected_saved", [
    ((strata_quirks_llama_cpp,), None),
    ((), 0),
], ids=["with-quirks", "without"])
async def test_an_empty_slot_is_not_saved_at_shutdown(strata_client_factory, plugins, expected_saved):
    saver = ShutdownSaver()
    client = await strata_client_factory(saver, *plugins)
    await client.close()  # right after the start: the slot holds nothing
    saved = saver.saved.tokens if saver.saved else None
    assert saved == expected_saved, "without the quirk plugin the engine writes a state file of 0 tokens"


async def test_a_slot_with_tokens_is_saved_at_shutdown(strata_client_factory):
    saver = ShutdownSaver()
    client = await strata_client_factory(saver, strata_quirks_llama_cpp)
    await ask(client, conversation("full"))
    await client.close()
    assert saver.saved.tokens > MIN_TOKENS
