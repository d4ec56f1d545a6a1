"""The numbers shown three ways: Prometheus text at ``/metrics``, JSON at ``/stats``, a log line."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any
from collections.abc import Iterator

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from strata_serve import SERVICE, TENANT
from strata_serve import APIError, plugin_metrics

from strata_ram_cache_stats.ledger import NAME, Ledger
from strata_ram_cache_stats.peers import plugin_numbers

if TYPE_CHECKING:
    from strata_serve import Service

log = logging.getLogger("strata_ram_cache_stats")

MIB = 1024**2
GIB = 1024**3


class LedgerCollector:
    """A Prometheus collector reading the ledger (and every plugin's declared metrics) at scrape time."""

    def __init__(self, ledger: Ledger, service: Service):
        self.ledger = ledger
        self.service = service

    def collect(self) -> Iterator[Metric]:
        numbers = self.ledger.snapshot()
        yield from self._own(numbers)
        yield from self._slots(numbers["slots"])
        for plugin, declared in plugin_metrics(self.service).items():
            yield from plugin_families(plugin, declared)

    def _own(self, numbers: dict[str, Any]) -> Iterator[Metric]:
        by_source = CounterMetricFamily(
            "strata_requests", "Requests measured, by where their conversation's state came from",
            labels=["source"])
        for source, count in numbers["requests_by_source"].items():
            by_source.add_metric([source], count)
        yield by_source
        yield CounterMetricFamily("strata_new_conversations",
                                  "Requests of a conversation seen for the first time (or no longer remembered)",
                                  value=numbers["new_conversations"])
        yield CounterMetricFamily("strata_prompt_tokens", "Prompt tokens of every request",
                                  value=numbers["prompt_tokens"])
        yield CounterMetricFamily("strata_reused_tokens", "Prompt tokens the engine reused (cache_n)",
                                  value=numbers["reused_tokens"])
        yield CounterMetricFamily("strata_prefilled_tokens", "Prompt tokens the engine prefilled (prompt_n)",
                                  value=numbers["prefilled_tokens"])
        yield from self.ledger.prefill_seconds.collect()
        yield CounterMetricFamily("strata_prefill_avoided_seconds",
                                  "Prefill time the reused tokens would have cost at this engine's speed",
                                  value=numbers["prefill_seconds_avoided"])
        yield GaugeMetricFamily("strata_reuse_ratio", "Reused tokens over prompt tokens, since start",
                                value=numbers["reuse_ratio"])
        if numbers["prefill_tokens_per_second"] is not None:
            yield GaugeMetricFamily("strata_prefill_tokens_per_second", "Prefill speed measured on this engine",
                                    value=numbers["prefill_tokens_per_second"])
        yield GaugeMetricFamily("strata_conversations_tracked", "Conversation records kept",
                                value=numbers["conversations_tracked"])
        yield CounterMetricFamily("strata_conversation_records_dropped",
                                  "Conversation records dropped past max_conversations",
                                  value=numbers["conversation_records_dropped"])
        yield CounterMetricFamily("strata_returns_reread",
                                  "Returns of a known conversation that found their state nowhere: re-read",
                                  value=numbers["returns_reread"])
        ram = numbers["engine_ram_cache"]
        if ram["budget_bytes"] is not None:
            yield GaugeMetricFamily("strata_engine_ram_cache_budget_bytes",
                                    "The engine's RAM prompt cache budget (--cache-ram); 0 when off",
                                    value=ram["budget_bytes"])
        if ram["bytes_per_token"] is not None:
            yield GaugeMetricFamily("strata_engine_state_bytes_per_token",
                                    "Bytes per token of the engine's state, measured from slot saves",
                                    value=ram["bytes_per_token"])


    def _slots(self, by_slot: dict[str, dict[str, int]]) -> Iterator[Metric]:
        """Per engine slot: what ran there (the ledger) and what it holds now (the core's picture)."""
        families = {
            stat: CounterMetricFamily(f"strata_slot_{stat}", doc, labels=["slot"])
            for stat, doc in (("requests", "Requests measured, by the engine slot they ran in"),
                              ("reused_tokens", "Prompt tokens the engine reused (cache_n), by slot"),
                              ("prefilled_tokens", "Prompt tokens the engine prefilled (prompt_n), by slot"))
        }
        for slot, numbers in by_slot.items():
            for stat, family in families.items():
                family.add_metric([slot], numbers[stat])
        yield from families.values()
        held = GaugeMetricFamily("strata_slot_tokens", "Tokens each engine slot holds, as last known",
                                 labels=["slot"])
        busy = GaugeMetricFamily("strata_slot_busy", "1 while a request runs in the slot", labels=["slot"])
        for state in self.service.slots:
            if state.tokens is not None:
                held.add_metric([str(state.id)], state.tokens)
            busy.add_metric([str(state.id)], 1 if state.id in self.service.fifo.busy
                            or self.service.fifo.exclusive else 0)
        yield held
        yield busy


def plugin_families(plugin: str, declared: list[Any]) -> Iterator[Metric]:
    """A plugin's declared metrics (``strata_serve.Metric``) as ``strata_<plugin>_<name>`` families.

    Metrics sharing a name are one family, one sample per label set; one that does not
    fit the family begun under its name (another kind, unit or label names) is logged
    and left out.
    """
    families: dict[str, tuple[Any, CounterMetricFamily | GaugeMetricFamily]] = {}
    for metric in declared:
        labels = sorted(metric.labels)
        begun = families.get(metric.name)
        if begun is None:
            family_type = CounterMetricFamily if metric.kind == "counter" else GaugeMetricFamily
            new_family: CounterMetricFamily | GaugeMetricFamily = family_type(
                f"strata_{plugin}_{metric.name}", f"{plugin}: {metric.help}", labels=labels, unit=metric.unit)
            begun = families[metric.name] = (metric, new_family)
        first, family = begun
        if (metric.kind, metric.unit, labels) != (first.kind, first.unit, sorted(first.labels)):
            log.warning("[strata] ram cache stats: %s's metric %s does not fit the family of that name "
                        "(kind, unit or labels differ); not exported", plugin, metric.name)
            continue
        family.add_metric([metric.labels[label] for label in labels], metric.value)
    for _first, family in families.values():
        yield family


def summary_line(numbers: dict[str, Any], declared: dict[str, list[Any]]) -> str:
    """One line for the log: what the parking and the engine's RAM cache did so far, then
    each plugin's numbers it declared for summaries (``summary=`` on ``strata_serve.counter``)."""
    by = numbers["requests_by_source"]
    ram = numbers["engine_ram_cache"]
    parts = [
        f"{numbers['requests']:,} requests, reuse {numbers['reuse_ratio']:.0%}",
        f"prefill {numbers['prefill_seconds']:,.1f} s spent, ~{numbers['prefill_seconds_avoided']:,.1f} s avoided",
        f"state from slot {by['slot']:,}, RAM {by['ram']:,}, disk {by['disk']:,}, "
        f"full prefill {by['none']:,}, unkeyed {by['unkeyed']:,}",
        f"{numbers['new_conversations']:,} new conversations",
    ]
    if ram["budget_bytes"] != 0:
        budget = "not known" if ram["budget_bytes"] is None else _size(ram["budget_bytes"])
        parts.append(f"engine RAM cache {budget}; {numbers['returns_reread']:,} returns re-read their context")
    for plugin, metrics in declared.items():
        shown = [f"{_shown(metric)} {metric.summary}" for metric in metrics if metric.summary]
        if shown:
            parts.append(f"{plugin} " + ", ".join(shown))
    return "[strata] ram cache stats: " + "; ".join(parts)


def _shown(metric: Any) -> str:
    if metric.unit == "bytes":
        return _size(metric.value)
    if metric.unit == "seconds":
        return f"{metric.value:,.1f} s"
    return f"{metric.value:,.0f}" if float(metric.value).is_integer() else f"{metric.value:,.2f}"


def _size(n: float) -> str:
    return f"{n / GIB:.2f} GiB" if n >= GIB else f"{n / MIB:.1f} MiB"


def _stats_of(request: web.Request) -> Any:
    """This server's stats, for a caller allowed to see server-wide figures.

    :raises APIError: 403 for a named tenant under strict tenant isolation (the figures
        add up every tenant's requests), 503 before the plugin has started.
    """
    service = request.app[SERVICE]
    if not service.settings.server.sees_every_tenant(request.get(TENANT)):
        raise APIError(403, f"with strict tenant isolation {request.path} is shown only to the plain "
                       "server.api_key: its figures add up every tenant's requests", code="strict_isolation")
    stats = service.state.get(NAME)
    if stats is None:
        raise APIError(503, "ram cache stats are not ready (the server is still starting)")
    return stats


async def metrics(request: web.Request) -> web.Response:
    """``GET /metrics``: Prometheus text format."""
    body = generate_latest(_stats_of(request).registry)
    response = web.Response(body=body)
    response.headers["Content-Type"] = CONTENT_TYPE_LATEST
    return response


async def stats(request: web.Request) -> web.Response:
    """``GET /stats``: the figures, the conversation records and every plugin's numbers, as JSON.

    A caller holding a named API key sees only its own conversations.
    """
    ledger = _stats_of(request).ledger
    tenant = request.get(TENANT)
    return web.json_response({
        **ledger.snapshot(),
        "conversations": ledger.recent_conversations(tenant),
        "plugins": plugin_numbers(request.app[SERVICE]),
        # Where requests' time went outside the engine, in all (strata_serve.timing).
        "phases": request.app[SERVICE].phases.snapshot(),
    })
