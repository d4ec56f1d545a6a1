"""The examples of docs/writing-plugins.md, run for real (the doc pulls its code from here)."""

import logging
import sys
from pathlib import Path

import pytest

from strata_serve import EngineError, Verdict
from strata_serve.testing import chat_body

EXAMPLES = Path(__file__).resolve().parent.parent / "docs" / "examples"


@pytest.fixture(autouse=True)
def examples_importable(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES))
    yield
    for name in ("token_log", "header_key", "quirk_verdict", "uptime_route", "declared_metrics"):
        sys.modules.pop(name, None)


async def test_token_log_example(strata_client_factory, strata_settings_factory, caplog):
    import token_log

    settings = strata_settings_factory(plugins={"token_log": {"prefix": "reuse"}})
    client = await strata_client_factory(token_log, settings=settings)
    with caplog.at_level(logging.INFO, logger="token_log"):
        for _ in range(2):
            resp = await client.post("/v1/chat/completions", json=chat_body("Count my tokens"))
            assert resp.status == 200
    lines = [r.getMessage() for r in caplog.records if r.name == "token_log"]
    assert len(lines) == 2 and all(line.startswith("reuse: ") for line in lines)
    assert " reused 0 of " in lines[0] and " reused 0 of " not in lines[1]


async def test_header_key_example(strata_memory_client_factory, recorder):
    import header_key

    client = await strata_memory_client_factory(header_key, recorder)
    await client.post("/v1/chat/completions", json=chat_body(), headers={"X-Conversation": "abc123"})
    await client.post("/v1/chat/completions", json=chat_body())
    await client.post("/v1/chat/completions", json=chat_body(), headers={"X-Conversation": "../bad"})
    default_key = recorder.keys[1]
    assert recorder.keys[0] == "abc123"
    assert default_key != "abc123" and len(default_key) == 16
    assert recorder.keys[2] == default_key, "an unusable header defers to the default"


def test_quirk_verdict_example():
    import quirk_verdict

    assert quirk_verdict.engine_verdict("save", None, None, 0) == Verdict.SKIP
    assert quirk_verdict.engine_verdict("save", None, None, 500) is None
    refused = EngineError(op="save", status=500, message="invalid checkpoint running-state payload")
    assert quirk_verdict.engine_verdict("save", refused, None, 500) == Verdict.PROVISIONAL
    other = EngineError(op="save", status=500, message="disk full")
    assert quirk_verdict.engine_verdict("save", other, None, 500) is None


async def test_uptime_route_example(strata_memory_client_factory):
    import uptime_route

    client = await strata_memory_client_factory(uptime_route)
    resp = await client.get("/uptime")
    assert resp.status == 200
    assert (await resp.json())["uptime_s"] >= 0


async def test_declared_metrics_example(strata_memory_client_factory):
    import declared_metrics
    import strata_ram_cache_stats

    client = await strata_memory_client_factory(declared_metrics, strata_ram_cache_stats)
    for _ in range(2):
        assert (await client.post("/v1/chat/completions", json=chat_body())).status == 200
    text = await (await client.get("/metrics")).text()
    assert "# HELP strata_declared_metrics_answers_total declared_metrics: Answers sent" in text
    assert "strata_declared_metrics_answers_total 2.0" in text
    assert "# TYPE strata_declared_metrics_answer_seconds_total counter" in text
