"""The in-memory engine double, chosen by a plugin through ``engine_backend``: no core edit.

It stands for a second backend (the core drives it like llama-server) and is the test
kit's fast engine for plugin unit tests. What the real engine does is tested against
the real engine elsewhere.
"""

from __future__ import annotations

import time

import strata_auto_sessions
import strata_session_header
from strata_serve.api import SERVICE
from strata_serve.testing import KeyRecorder, chat_body, conversation
from strata_serve.testing_engine import MemoryEngine


def body(messages, **extra):
    return {"messages": messages, "max_tokens": 3, "temperature": 0, **extra}


async def test_a_backend_from_a_plugin_runs_parking_in_milliseconds(strata_memory_client_factory,
                                                                   strata_settings_factory):
    settings = strata_settings_factory(plugins={"auto_sessions": {"min_tokens": 100}})
    began = time.monotonic()
    client = await strata_memory_client_factory(strata_auto_sessions, settings=settings)
    service = client.app[SERVICE]
    assert isinstance(service.engine, MemoryEngine), "the plugin's backend, not llama-server"
    a, b = conversation("mem-a"), conversation("mem-b")
    for messages in (a, b):
        assert (await client.post("/v1/chat/completions", json=body(messages))).status == 200
    back = await client.post("/v1/chat/completions", json=body(a, stream=True))
    assert back.status == 200 and back.headers["X-Strata-State"] == "disk"
    await back.read()
    stats = service.state["auto_sessions"].stats
    assert stats.saves == 2 and stats.restores == 1, "A saved at the switch to B, B at the way back"
    await service.check_slots()
    assert service.slots.corrections == 0 and service.slots[0].tokens == len(service.engine.slot)
    assert time.monotonic() - began < 5


async def test_a_keying_plugins_unit_test_needs_no_real_engine(strata_memory_client_factory):
    keys = KeyRecorder()
    client = await strata_memory_client_factory(strata_session_header, keys)
    for session in ("one", "two", "one"):
        resp = await client.post("/v1/chat/completions", json=chat_body(), headers={"X-Session-Id": session})
        assert resp.status == 200
    assert keys.seen == ["one", "two", "one"]


async def test_parking_is_off_on_a_backend_without_slot_files(strata_memory_client_factory,
                                                             strata_settings_factory, monkeypatch, caplog):
    monkeypatch.setattr(MemoryEngine, "capabilities", frozenset({"slots"}))
    settings = strata_settings_factory(plugins={"auto_sessions": {"min_tokens": 100}})
    client = await strata_memory_client_factory(strata_auto_sessions, settings=settings)
    assert not client.app[SERVICE].state["auto_sessions"].active
    assert any("cannot save and restore slots" in r.getMessage() for r in caplog.records)
