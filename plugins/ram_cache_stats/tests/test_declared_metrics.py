"""Metrics a plugin declares beside its counters reach ``/metrics`` with no table here.

On the in-memory engine double: what is shown is how declarations become Prometheus
families, which no engine behaviour changes.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

import strata_auto_sessions
import strata_ram_cache_stats
import strata_serve
from strata_auto_sessions import AutoSessionsStats
from strata_ram_cache_stats.exposition import summary_line
from strata_serve.api import SERVICE
from strata_serve.testing import chat_body, conversation


async def scrape(client) -> dict[str, object]:
    """``/metrics`` parsed by prometheus_client's own parser: family name -> family."""
    resp = await client.get("/metrics")
    assert resp.status == 200, await resp.text()
    return {family.name: family for family in text_string_to_metric_families(await resp.text())}


def sample(family, labels: dict[str, str]):
    values = [s.value for s in family.samples if s.labels == labels and not s.name.endswith("_created")]
    assert len(values) == 1, (family.name, labels, family.samples)
    return values[0]


async def test_every_counter_auto_sessions_declares_reaches_metrics_with_its_help(strata_memory_client_factory,
                                                                                  strata_settings_factory):
    settings = strata_settings_factory(plugins={"auto_sessions": {"min_tokens": 100}})
    client = await strata_memory_client_factory(strata_auto_sessions, strata_ram_cache_stats, settings=settings)
    for messages in (conversation("declared-a"), conversation("declared-b")):
        assert (await client.post("/v1/chat/completions", json=chat_body(messages=messages))).status == 200
    stats = client.app[SERVICE].state["auto_sessions"].stats
    fields = dataclasses.fields(AutoSessionsStats)
    for n, f in enumerate(fields):  # a distinct value each, so a number shown under another's name shows
        setattr(stats, f.name, n + 1)
    declared = strata_serve.metrics_of(stats)
    assert len(declared) == len(fields), "every number auto-sessions keeps is declared as a metric"
    assert {"idle_saves", "restores_diverged", "pauses", "prefix_restores"} <= {m.name for m in declared}
    families = await scrape(client)
    for metric in declared:
        family = families.get(f"strata_auto_sessions_{metric.name}")
        assert family is not None, f"{metric.name} is not at /metrics"
        assert family.type == metric.kind
        assert family.documentation == f"auto_sessions: {metric.help}"
        assert sample(family, dict(metric.labels)) == metric.value
    names = [f.name for f in fields]
    assert sample(families["strata_auto_sessions_restore_skips"], {"reason": "damaged"}) == (
        names.index("restores_refused_damaged") + 1)
    assert sample(families["strata_auto_sessions_save_seconds"], {}) == (
        names.index("save_ms") + 1) / 1000, "milliseconds are exported as seconds"


@dataclass
class WidgetNumbers:
    """A plugin ram_cache_stats has never heard of, its numbers declared where they are kept."""

    polished: int = strata_serve.counter("Widgets polished", summary="polished")
    polish_ms: float = strata_serve.counter("Time spent polishing", name="polish_seconds", unit="seconds",
                                            scale=1e-3)
    red: int = strata_serve.gauge("Widgets on the shelf, by colour", name="shelved", labels={"colour": "red"})
    blue: int = strata_serve.gauge("Widgets on the shelf, by colour", name="shelved", labels={"colour": "blue"})
    note: str = "not a metric"


class Widgets:
    strata_name = "widgets"

    def __init__(self):
        self.numbers = WidgetNumbers()

    @strata_serve.hookimpl
    def post_request(self):
        self.numbers.polished += 1
        self.numbers.polish_ms += 250

    @strata_serve.hookimpl
    def collect_metrics(self):
        return self.numbers


class Gadgets:
    """Answers with ``Metric`` values, not a dataclass."""

    strata_name = "gadgets"

    @strata_serve.hookimpl
    def collect_metrics(self):
        return [strata_serve.Metric("sprockets", "Sprockets in stock", "gauge", 7)]


class WrongAnswer:
    strata_name = "wrong_answer"

    @strata_serve.hookimpl
    def collect_metrics(self):
        return {"not": "declared"}


async def test_a_plugin_that_declares_a_counter_gets_it_exported(strata_memory_client_factory, caplog):
    widgets = Widgets()
    widgets.numbers.red, widgets.numbers.blue = 3, 4
    client = await strata_memory_client_factory(strata_ram_cache_stats, widgets, Gadgets(), WrongAnswer())
    for _ in range(2):
        assert (await client.post("/v1/chat/completions", json=chat_body())).status == 200
    families = await scrape(client)
    polished = families["strata_widgets_polished"]
    assert (polished.type, polished.documentation) == ("counter", "widgets: Widgets polished")
    assert sample(polished, {}) == 2
    assert sample(families["strata_widgets_polish_seconds"], {}) == 0.5
    shelved = families["strata_widgets_shelved"]
    assert shelved.type == "gauge" and shelved.documentation == "widgets: Widgets on the shelf, by colour"
    assert (sample(shelved, {"colour": "red"}), sample(shelved, {"colour": "blue"})) == (3, 4)
    assert sample(families["strata_gadgets_sprockets"], {}) == 7
    assert not any(name.startswith("strata_wrong_answer") for name in families)
    service = client.app[SERVICE]
    line = summary_line(service.state["ram_cache_stats"].ledger.snapshot(), strata_serve.plugin_metrics(service))
    assert line.endswith("; widgets 2 polished"), "the one number it named for summaries, in the log line"
    assert any("wrong_answer" in r.getMessage() and "collect_metrics" in r.getMessage()
               for r in caplog.records if r.levelno == logging.WARNING)


def test_ram_cache_stats_names_no_other_plugins_numbers():
    """No table of another plugin's names: its sources never spell auto-sessions' counters."""
    from pathlib import Path

    sources = "".join(p.read_text() for p in Path(strata_ram_cache_stats.__file__).parent.glob("*.py"))
    for f in dataclasses.fields(AutoSessionsStats):
        assert f'"{f.name}"' not in sources and f"'{f.name}'" not in sources, f.name
