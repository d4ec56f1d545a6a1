"""The in-memory engine double, chosen by a plugin through ``engine_backend``: no core edit.

It stands for a second backend (the core drives it like llama-server) and is the test
kit's fast engine for plugin unit tests. What the real engine does is tested against
the real engine elsewhere.
"""

from __future__ import annotations

import logging
import time

import strata_auto_sessions
import strata_session_header
import strata_serve
from strata_serve import Timings
from strata_serve.api import SERVICE
from strata_serve.testing import KeyRecorder, chat_body, conversation
from strata_serve.memory_engine import MemoryEngine


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


class OutcomeRecorder:
    strata_name = "outcome_recorder"

    def __init__(self) -> None:
        self.timings: list = []

    @strata_serve.hookimpl
    def post_request(self, outcome) -> None:
        self.timings.append(outcome.timings)


async def test_the_backend_reads_its_own_numbers_for_the_core(strata_memory_client_factory):
    """The double reports its work in a shape only it knows; plugins see it in the core's terms."""
    recorder = OutcomeRecorder()
    client = await strata_memory_client_factory(recorder)
    messages = conversation("numbers")
    first = await (await client.post("/v1/chat/completions", json=body(messages))).json()
    numbers = first[MemoryEngine.numbers_key]
    assert "timings" not in first and numbers["read"] > 0, "not llama-server's shape"
    again = await client.post("/v1/chat/completions", json=body(messages, stream=True))
    await again.read()
    before, after = recorder.timings
    assert before == Timings(reused=0, prefilled=numbers["read"], generated=3,
                             prefill_ms=numbers["read_us"] / 1000, generate_ms=0.03)
    assert after.reused == before.prompt_tokens - 1 and after.raw["kept"] == after.reused, "the slot was reused"
    assert client.app[SERVICE].slots[0].tokens == after.prompt_tokens + after.generated - 1


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
    assert not client.app[SERVICE].state["auto_sessions"].mode.parks
    assert any("cannot save and restore slots" in r.getMessage() for r in caplog.records)


async def test_min_prefill_s_parks_only_what_takes_long_to_read_again(strata_memory_client_factory,
                                                                      strata_settings_factory, caplog):
    """The double prefills 100,000 tokens/s: 0.005 s is worth a file from 500 tokens on."""
    caplog.set_level(logging.INFO, logger="strata_auto_sessions")
    settings = strata_settings_factory(plugins={"auto_sessions": {"min_prefill_s": 0.005}})
    client = await strata_memory_client_factory(strata_auto_sessions, settings=settings)
    parking = client.app[SERVICE].state["auto_sessions"]
    short, long_, other = [{"role": "user", "content": "hi " * 40}], conversation("long"), conversation("other")
    for messages in (short, long_, other):
        assert (await client.post("/v1/chat/completions", json=body(messages))).status == 200
    assert parking.stats.saves == 1 and parking.stats.save_skips_below_min == 1
    assert any("less than min_prefill_s (0.005 s)" in r.getMessage() for r in caplog.records)


def test_min_tokens_alone_is_the_only_threshold():
    from strata_auto_sessions import AutoSessionsConfig

    assert AutoSessionsConfig().min_prefill_s == 2.0 and AutoSessionsConfig().min_tokens == 0
    alone = AutoSessionsConfig(min_tokens=4000)
    assert alone.min_prefill_s == 0 and alone.min_tokens == 4000
    both = AutoSessionsConfig(min_tokens=4000, min_prefill_s=3)
    assert both.min_prefill_s == 3


async def test_a_route_the_backend_does_not_serve_is_not_supported_in_the_apis_shape(strata_memory_client_factory):
    from strata_serve.testing import assert_openai_error

    client = await strata_memory_client_factory()
    assert (await client.post("/v1/chat/completions", json=chat_body())).status == 200, "a route it serves"
    for path, body in (("/v1/embeddings", {"input": "hello"}), ("/tokenize", {"content": "hello"}),
                       ("/v1/responses", {"input": "hello"})):
        resp = await client.post(path, json=body)
        error = await resp.json()
        assert_openai_error(error, 404, resp.status)
        assert error["error"]["code"] == "not_supported" and path in error["error"]["message"]
    resp = await client.post("/v1/messages", json={"model": "m", "max_tokens": 4,
                                                   "messages": [{"role": "user", "content": "hello"}]})
    error = await resp.json()
    assert resp.status == 404 and error["type"] == "error", "Anthropic's shape on its route"
    assert "/v1/messages is not supported" in error["error"]["message"]
    assert client.app[SERVICE].engine.requests[-1]["messages"][0]["content"] == "Hello there", \
        "nothing of the unserved requests reached the engine"
    # The OpenAPI document describes what this server answers: the routes its engine serves.
    paths = (await (await client.get("/openapi.json")).json())["paths"]
    assert "/v1/chat/completions" in paths and "/slots/{slot_id}" in paths
    assert not {"/v1/embeddings", "/tokenize", "/v1/responses", "/v1/messages"} & set(paths)


def test_the_engine_routes_are_every_route_relayed_to_the_engine():
    from strata_serve import ENGINE_ROUTES
    from strata_serve.api.builtin import builtin
    from strata_serve.engine import LlamaServer

    assert {api.engine_path for api in builtin()} == ENGINE_ROUTES and MemoryEngine.routes < ENGINE_ROUTES
    assert LlamaServer.routes == ENGINE_ROUTES, "llama-server serves every one"
    assert ENGINE_ROUTES == {
        "/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/embeddings", "/v1/models",
        "/v1/messages", "/v1/messages/count_tokens",
        "/infill", "/tokenize", "/detokenize", "/apply-template", "/props",
    }


def test_both_backends_have_every_member_of_the_engine_protocol():
    from strata_serve import Engine, LlamaServer
    from strata_serve.config import EngineSettings

    members = {name for name in (*Engine.__annotations__, *vars(Engine)) if not name.startswith("_")}
    assert {"slots", "save", "read_timings", "read_overflow", "numbers_key", "info"} <= members
    for engine in (MemoryEngine(), LlamaServer(EngineSettings(url="http://127.0.0.1:1"))):
        missing = sorted(name for name in members if not hasattr(engine, name))
        assert not missing, f"{type(engine).__name__} lacks {missing}"
