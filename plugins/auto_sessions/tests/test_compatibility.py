"""Files the running engine cannot use are refused before it sees them, with the reason;
a harmless difference is not. Real engine, tiny model: each test saves a conversation
with one engine, stops it, and asks again of an engine started otherwise."""

from __future__ import annotations

import json
import logging

import pytest

import strata_auto_sessions
import strata_ram_cache_stats
from strata_serve.api import SERVICE
from strata_serve.testing import conversation

from .test_auto_sessions import ask, key_of, log_lines, parking, slot_dir


@pytest.fixture(autouse=True)
def plugin_logs(caplog):
    caplog.set_level(logging.INFO, logger="strata_auto_sessions")


async def saved_with(strata_client_factory, auto_settings, messages, engine) -> dict:
    """Answer ``messages`` on an engine started with ``engine`` settings, stop it (the stop
    saves the conversation) and return the file's sidecar."""
    first = await strata_client_factory(strata_auto_sessions, settings=auto_settings(engine))
    await ask(first, messages)
    key = key_of(first, messages)
    directory = slot_dir(first)
    await first.close()
    return json.loads((directory / f"auto-{key}.json").read_text())


@pytest.mark.parametrize("then, now, reason", [
    ({"extra_args": ["-ctk", "f32"]}, {}, "cache_type"),
    ({"extra_args": ["-fa", "on"]}, {"extra_args": ["-fa", "off"]}, "flash_attn"),
], ids=["ctk", "flash_attn"])
async def test_a_file_saved_with_another_layout_is_refused_with_its_reason(
        strata_client_factory, auto_settings, caplog, then, now, reason):
    a = conversation("layout")
    sidecar = await saved_with(strata_client_factory, auto_settings, a, then)
    assert sidecar["version"] == 2 and sidecar["fingerprint"]["layout"]["cache_type_k"] in ("f16", "f32")

    client = await strata_client_factory(strata_auto_sessions, strata_ram_cache_stats,
                                         settings=auto_settings(now))
    reply = await ask(client, a)
    stats = parking(client).stats
    assert getattr(stats, f"restores_refused_{reason}") == 1
    assert stats.restores == 0 and stats.restore_failures == 0, "the engine never saw the file"
    assert reply["timings"]["cache_n"] < 40, "only the chat template's opening is shared"
    assert any(f"not restoring auto-{key_of(client, a)}.bin ({reason})" in line for line in log_lines(caplog))
    metrics = await (await client.get("/metrics")).text()
    assert f'strata_auto_sessions_restore_skips_total{{reason="{reason}"}} 1.0' in metrics


async def test_a_context_smaller_than_the_saved_tokens_is_refused(strata_client_factory, auto_settings, caplog):
    a = conversation("context")
    sidecar = await saved_with(strata_client_factory, auto_settings, a, {})
    smaller = sidecar["tokens"] // 256 * 256  # the engine rounds its context to 256 tokens
    client = await strata_client_factory(strata_auto_sessions, settings=auto_settings({"ctx_size": smaller}))
    assert client.app[SERVICE].engine.info.n_ctx < sidecar["tokens"]
    resp = await client.post("/v1/chat/completions", json={"messages": a, "max_tokens": 2, "temperature": 0})
    assert resp.status < 500, await resp.text()
    stats = parking(client).stats
    assert stats.restores_refused_context == 1 and stats.restore_failures == 0
    assert any("(context)" in line and f"{sidecar['tokens']:,} tokens" in line for line in log_lines(caplog))


async def test_another_model_is_refused_by_its_reason(strata_client_factory, auto_settings, tmp_path, caplog):
    from strata_serve.demo_model import write_demo_model

    other = write_demo_model(tmp_path / "other.gguf", size="tiny", seed=7)
    a = conversation("model")
    await saved_with(strata_client_factory, auto_settings, a, {"model": str(other)})
    client = await strata_client_factory(strata_auto_sessions, settings=auto_settings({}))
    await ask(client, a)
    assert parking(client).stats.restores_refused_other_model == 1
    assert any("(other_model)" in line for line in log_lines(caplog))


async def test_gpu_layers_and_a_larger_context_are_harmless(strata_client_factory, auto_settings, caplog):
    a = conversation("harmless")
    await saved_with(strata_client_factory, auto_settings, a, {"extra_args": ["-ngl", "0"]})
    client = await strata_client_factory(
        strata_auto_sessions, settings=auto_settings({"extra_args": ["-ngl", "99"], "ctx_size": 8192}))
    reply = await ask(client, a)
    stats = parking(client).stats
    assert stats.restores == 1
    assert sum(getattr(stats, f"restores_refused_{r}") for r in strata_auto_sessions.store.REFUSAL_REASONS) == 0
    assert reply["timings"]["cache_n"] > 600, "the restored state was reused"


async def test_a_file_saved_by_the_earlier_sidecar_format_still_restores(strata_client_factory, auto_settings):
    """Sidecars written before the layout, the build and the tenant were recorded."""
    a = conversation("older")
    sidecar = await saved_with(strata_client_factory, auto_settings, a, {})
    for field in ("layout", "build", "ftype"):
        del sidecar["fingerprint"][field]
    for field in ("tenant", "version"):
        del sidecar[field]
    client = await strata_client_factory(strata_auto_sessions, settings=auto_settings({}))
    path = slot_dir(client) / f"auto-{key_of(client, a)}.json"
    path.write_text(json.dumps(sidecar))
    reply = await ask(client, a)
    assert parking(client).stats.restores == 1
    assert reply["timings"]["cache_n"] > 600
