"""The Strata Metal quirk: each verdict, the plugin on and off, and its effect on auto-sessions.

The end-to-end tests run on ``StrataMetalBeforeFixDouble`` (see conftest.py).
"""

from __future__ import annotations

import asyncio
import logging

import aiohttp
import pytest

import strata_quirks_strata_metal
from strata_serve import EngineError, Verdict
from strata_serve.api import SERVICE
from strata_serve.config import ConfigError, Settings
from strata_serve.plugins import first_result, get_plugin_manager
from strata_serve.testing import ask, conversation

MIN_TOKENS = 100  # as in conftest.py: conversations here are longer, and parked
REFUSAL = "invalid checkpoint running-state payload"


async def cancel_mid_answer(client, messages) -> None:
    """Start a long streamed answer, read its first bytes, go away; wait until the server is idle."""
    body = {"messages": messages, "max_tokens": 3000, "ignore_eos": True, "temperature": 0, "stream": True}
    async with aiohttp.ClientSession() as session:
        resp = await session.post(client.make_url("/v1/chat/completions"), json=body)
        assert resp.status == 200
        await resp.content.readany()
        resp.close()
    service = client.app[SERVICE]
    for _ in range(200):
        if service.engine.cancelled_last and service.fifo.idle:
            return
        await asyncio.sleep(0.05)
    raise AssertionError("the cancelled request never finished")


def save_error(status=500, message=REFUSAL, op="save") -> EngineError:
    return EngineError(op=op, status=status, message=message)


# -- each verdict -------------------------------------------------------------

def test_refused_save_of_a_cancelled_state_is_provisional():
    assert strata_quirks_strata_metal.engine_verdict("save", save_error()) == Verdict.PROVISIONAL


@pytest.mark.parametrize("op, error", [
    ("save", None),                                           # asked before the call
    ("restore", None),
    ("restore", save_error(op="restore")),                    # the message, but not a save
    ("save", save_error(status=400)),                         # another status: not this refusal
    ("save", save_error(message="failed to open file")),      # another failure of a save
    ("save", EngineError(op="save", message=REFUSAL)),        # no answer at all (no status)
], ids=["before-save", "before-restore", "restore", "status-400", "other-message", "no-status"])
def test_anything_else_is_not_mine(op, error):
    assert strata_quirks_strata_metal.engine_verdict(op, error) is None


# -- on and off, through the plugin manager --------------------------------------

@pytest.mark.parametrize("plugins_config, expected", [
    ({}, Verdict.PROVISIONAL),
    ({"quirks_strata_metal": {"enabled": False}}, None),
])
def test_registered_it_answers_disabled_it_does_not(plugins_config, expected):
    pm = get_plugin_manager(Settings(plugins=plugins_config), entrypoints=False,
                            plugins=[strata_quirks_strata_metal])
    answer = first_result(pm, "engine_verdict", op="save", error=save_error(), engine=None, held_tokens=500,
                          service=None)
    assert answer == expected


def test_an_unknown_setting_is_refused():
    with pytest.raises(ConfigError, match=r"plugins\.quirks_strata_metal\.provisional: unknown key"):
        get_plugin_manager(Settings(plugins={"quirks_strata_metal": {"provisional": True}}),
                           entrypoints=False, plugins=[strata_quirks_strata_metal])


# -- end to end: what auto-sessions does with the verdict ---------------------------

async def test_with_the_plugin_auto_sessions_restores_over_the_provisional_state(metal_client, caplog):
    caplog.set_level(logging.INFO, logger="strata_auto_sessions")
    client = await metal_client(strata_quirks_strata_metal)
    service = client.app[SERVICE]
    parking = service.state["auto_sessions"]
    a, b = conversation("metal-a"), conversation("metal-b")
    await ask(client, b)
    await ask(client, a)  # B is saved, A is held
    await cancel_mid_answer(client, a)  # A's slot now holds a cancelled request's state

    reply = await ask(client, b)
    assert service.engine.refused_saves == 1
    assert parking.stats.save_failures == 1
    assert parking.stats.restores == 1 and parking.stats.restores_withheld == 0
    assert reply["timings"]["cache_n"] > MIN_TOKENS, "B came back from its file"
    assert any("held only provisional state" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("plugins, plugins_config", [
    ((), {}),
    ((strata_quirks_strata_metal,), {"quirks_strata_metal": {"enabled": False}}),
], ids=["not-installed", "disabled"])
async def test_without_the_plugin_the_restore_is_withheld(metal_client, plugins, plugins_config):
    client = await metal_client(*plugins, **plugins_config)
    service = client.app[SERVICE]
    parking = service.state["auto_sessions"]
    a, b = conversation("plain-a"), conversation("plain-b")
    await ask(client, b)
    await ask(client, a)
    await cancel_mid_answer(client, a)

    reply = await ask(client, b)
    assert service.engine.refused_saves == 1
    assert parking.stats.save_failures == 1
    assert parking.stats.restores == 0 and parking.stats.restores_withheld == 1
    assert reply["timings"]["cache_n"] < MIN_TOKENS, "B was prefilled (all but the shared template start)"


async def test_the_llama_cpp_quirks_installed_too_leave_this_verdict_alone(metal_client):
    quirks_llama_cpp = pytest.importorskip("strata_quirks_llama_cpp")
    client = await metal_client(quirks_llama_cpp, strata_quirks_strata_metal)
    parking = client.app[SERVICE].state["auto_sessions"]
    a, b = conversation("both-a"), conversation("both-b")
    await ask(client, b)
    await ask(client, a)
    await cancel_mid_answer(client, a)
    await ask(client, b)
    assert parking.stats.save_failures == 1 and parking.stats.restores == 1
