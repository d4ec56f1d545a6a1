"""ram-cache-stats against the real engine (tiny model; the RAM cache off unless a test turns it on)."""

from __future__ import annotations

import logging
import re

import pytest
from prometheus_client.parser import text_string_to_metric_families

import strata_ram_cache_stats
from strata_ram_cache_stats.exposition import summary_line
from strata_ram_cache_stats.ledger import Ledger, RamCacheStatsConfig
from strata_serve import EngineMeasures
from strata_serve.api import SERVICE
from strata_serve.config import ConfigError, Settings
from strata_serve.plugins import get_plugin_manager
from strata_serve.testing import ask, assert_openai_error, conversation


async def stats(client, headers=None) -> dict:
    resp = await client.get("/stats", headers=headers)
    assert resp.status == 200, await resp.text()
    return await resp.json()


async def metrics(client) -> dict[str, float]:
    """``/metrics`` parsed by prometheus_client's own parser: sample name (with labels) -> value."""
    resp = await client.get("/metrics")
    assert resp.status == 200
    assert resp.headers["Content-Type"].startswith("text/plain; version=")
    samples = {}
    for family in text_string_to_metric_families(await resp.text()):
        assert family.name.startswith("strata_"), family.name
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            samples[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return samples


def key_of(client, messages) -> str:
    from strata_serve.hook_types import StrataRequest

    return client.app[SERVICE].conversation_key(StrataRequest(route="chat", body={"messages": messages}))


async def test_a_repeated_conversation_shows_reuse(stats_client):
    client = await stats_client()
    for turns in (1, 2, 3):
        await ask(client, conversation("again", turns))
    numbers = await stats(client)
    assert numbers["requests_by_source"] == {"slot": 2, "ram": 0, "disk": 0, "none": 1, "unkeyed": 0}
    assert numbers["new_conversations"] == 1
    assert numbers["reused_tokens"] > 2 * 700
    assert 0.5 < numbers["reuse_ratio"] < 1
    assert numbers["prefill_tokens_per_second"] > 0 and numbers["prefill_seconds_avoided"] > 0
    [record] = numbers["conversations"]
    assert record["key"] == key_of(client, conversation("again"))
    assert record["requests"] == 3 and record["last_source"] == "slot"
    assert record["sources"] == {"none": 1, "slot": 2}


async def test_a_switch_with_auto_sessions_shows_a_disk_restore(stats_client):
    client = await stats_client(auto_sessions=True)
    a, b = conversation("disk-a"), conversation("disk-b")
    for messages in (a, b, a):
        await ask(client, messages)
    numbers = await stats(client)
    assert numbers["requests_by_source"]["disk"] == 1 and numbers["new_conversations"] == 2
    auto = numbers["plugins"]["auto_sessions"]
    assert auto["saves"] == 2 and auto["restores"] == 1 and auto["files_on_disk"] == 2
    assert numbers["engine_ram_cache"]["budget_bytes"] == 0, "the test engine runs with --cache-ram 0"
    assert numbers["engine_ram_cache"]["bytes_per_token"] == pytest.approx(auto["saved_bytes"] / auto["saved_tokens"],
                                                                           rel=1e-3)
    samples = await metrics(client)
    assert samples["strata_requests_total{source=disk}"] == 1
    assert samples["strata_auto_sessions_saves_total"] == 2
    assert samples["strata_auto_sessions_restores_total"] == 1
    assert samples["strata_auto_sessions_restore_seconds_total"] == pytest.approx(auto["restore_ms"] / 1000)
    assert samples["strata_auto_sessions_save_skips_total{reason=below_min_tokens}"] == 0
    assert samples["strata_auto_sessions_on_disk_bytes"] == auto["bytes_on_disk"] > 20_000


async def test_a_switch_with_the_ram_cache_on_shows_a_ram_hit(stats_client):
    client = await stats_client(engine={"cache_ram_mib": 256})
    a, b = conversation("ram-a"), conversation("ram-b")
    for messages in (a, b, a):
        await ask(client, messages)
    numbers = await stats(client)
    assert numbers["requests_by_source"]["ram"] == 1
    ram = numbers["engine_ram_cache"]
    assert ram["budget_bytes"] == 256 * 2**20
    assert ram["bytes_per_token"] is None, "no slot save measured it"
    assert numbers["returns_reread"] == 0


async def test_with_auto_sessions_and_the_ram_cache_a_return_comes_from_disk(stats_client):
    # Every switch parked (ram_first off: no switch left to the engine's RAM cache).
    client = await stats_client(auto_sessions={"ram_first": False}, engine={"cache_ram_mib": 256})
    a, b = conversation("both-a"), conversation("both-b")
    for messages in (a, b, a):
        await ask(client, messages)
    numbers = await stats(client)
    assert numbers["requests_by_source"]["disk"] == 1, "auto-sessions restored the return"
    ram = numbers["engine_ram_cache"]
    assert 100 < ram["bytes_per_token"] < 10_000
    samples = await metrics(client)
    assert samples["strata_engine_state_bytes_per_token"] == pytest.approx(ram["bytes_per_token"])
    assert samples["strata_engine_ram_cache_budget_bytes"] == 256 * 2**20


async def test_a_full_prefill_shows_as_a_miss(stats_client):
    client = await stats_client()
    a, b = conversation("full-a"), conversation("full-b")
    for messages in (a, b, a):
        await ask(client, messages)
    numbers = await stats(client)
    assert numbers["requests_by_source"]["none"] == 3, "two first requests and a return"
    assert numbers["returns_reread"] == 1
    assert numbers["conversations"][0]["last_source"] == "none"
    assert numbers["prefilled_tokens"] > 3 * 700 and numbers["prefill_seconds"] > 0


async def test_a_conversation_pushed_out_of_the_ram_cache_is_a_return_reread(stats_client):
    # 1 MiB holds two of these conversations (0.375 MiB each): parking the third pushes out the first.
    client = await stats_client(engine={"cache_ram_mib": 1})
    a, b, c = conversation("evict-a"), conversation("evict-b"), conversation("evict-c")
    for messages in (a, b, c):
        await ask(client, messages)
    reply = await ask(client, a)
    assert reply["timings"]["cache_n"] < 100, "the engine lost it"
    numbers = await stats(client)
    assert numbers["requests_by_source"]["none"] == 4, "three first requests and a return"
    assert numbers["returns_reread"] == 1
    assert (await metrics(client))["strata_returns_reread_total"] == 1


async def test_metrics_parse_with_prometheus_clients_own_parser(stats_client):
    client = await stats_client(auto_sessions=True)
    a, b = conversation("prom-a"), conversation("prom-b")
    for messages in (a, b, a, a):
        await ask(client, messages)
    await ask(client, [{"role": "system", "content": "no user text, no key"}])
    numbers = await stats(client)
    resp = await client.get("/metrics")
    families = {f.name: f for f in text_string_to_metric_families(await resp.text())}
    assert families["strata_requests"].type == "counter"
    assert families["strata_prefill_seconds"].type == "histogram"
    assert families["strata_reuse_ratio"].type == "gauge"
    assert families["strata_auto_sessions_saves"].type == "counter"
    samples = await metrics(client)
    for source, count in numbers["requests_by_source"].items():
        assert samples[f"strata_requests_total{{source={source}}}"] == count
    assert samples["strata_requests_total{source=unkeyed}"] == 1
    assert samples["strata_new_conversations_total"] == numbers["new_conversations"] == 2
    assert samples["strata_prompt_tokens_total"] == numbers["prompt_tokens"]
    assert samples["strata_reused_tokens_total"] == numbers["reused_tokens"]
    assert samples["strata_prefilled_tokens_total"] == numbers["prefilled_tokens"]
    assert samples["strata_prefill_seconds_count"] == 5
    assert samples["strata_prefill_seconds_sum"] == pytest.approx(numbers["prefill_seconds"], abs=1e-3)
    assert samples["strata_prefill_seconds_bucket{le=+Inf}"] == 5
    assert samples["strata_prefill_avoided_seconds_total"] == numbers["prefill_seconds_avoided"] > 0
    assert samples["strata_conversations_tracked"] == 2
    assert "strata_engine_ram_cache_budget_bytes" in samples


async def test_a_summary_line_every_n_requests(stats_client, caplog):
    client = await stats_client(auto_sessions=True, engine={"cache_ram_mib": 256}, log_every=2)
    with caplog.at_level(logging.INFO, logger="strata_ram_cache_stats"):
        for messages in (conversation("log-a"), conversation("log-b"), conversation("log-a")):
            await ask(client, messages)
    lines = [r.getMessage() for r in caplog.records
             if r.name == "strata_ram_cache_stats" and "requests, reuse" in r.getMessage()]
    assert len(lines) == 1
    assert lines[0].startswith("[strata] ram cache stats: 2 requests, reuse ")
    assert "state from slot 0, RAM 0, disk 0, full prefill 2, unkeyed 0; 2 new conversations" in lines[0]
    assert "; engine RAM cache 256.0 MiB; 0 returns re-read their context; " in lines[0]
    assert re.search(r"; auto_sessions 1 saves, 0 restores, 1 files, 0\.\d MiB on disk$", lines[0])


def test_the_summary_line_when_the_ram_budget_is_not_known():
    ledger = Ledger(RamCacheStatsConfig(), None, EngineMeasures())
    line = summary_line(ledger.snapshot(), {})
    assert line.endswith("; engine RAM cache not known; 0 returns re-read their context")


async def test_a_named_key_sees_only_its_own_conversations(stats_client):
    client = await stats_client(server={"api_keys": {"alice": "key-a", "bob": "key-b"}})
    alice, bob = {"Authorization": "Bearer key-a"}, {"Authorization": "Bearer key-b"}
    await ask(client, conversation("mine"), headers=alice)
    await ask(client, conversation("theirs"), headers=bob)
    seen = await stats(client, headers=alice)
    assert [row["key"].split("--")[0] for row in seen["conversations"]] == ["alice"]
    assert seen["requests"] == 2, "the totals are the server's"
    refused = await client.get("/metrics")
    assert_openai_error(await refused.json(), 401, refused.status)


async def test_disabled_it_exposes_nothing(strata_memory_client_factory, strata_settings_factory):
    # The plugin's switch, not the engine's work: on the in-memory engine.
    settings = strata_settings_factory(plugins={"ram_cache_stats": {"enabled": False}})
    client = await strata_memory_client_factory(strata_ram_cache_stats, settings=settings)
    await ask(client, conversation("off"))
    assert "ram_cache_stats" not in client.app[SERVICE].state
    for path in ("/metrics", "/stats"):
        resp = await client.get(path)
        assert_openai_error(await resp.json(), 404, resp.status)


def test_an_unknown_setting_refuses_to_start():
    settings = Settings(plugins={"ram_cache_stats": {"log_evry": 5}})
    with pytest.raises(ConfigError, match="plugins.ram_cache_stats.log_evry"):
        get_plugin_manager(settings, entrypoints=False, plugins=[strata_ram_cache_stats])
