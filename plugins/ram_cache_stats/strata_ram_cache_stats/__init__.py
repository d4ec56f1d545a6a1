"""ram-cache-stats: what the engine's RAM cache and the parking are doing, in numbers.

After every request (``post_request``, FIFO held) it records the engine's timings and
where the conversation's state came from, as the core decided it (``request.state_source``,
what ``X-Strata-State`` says): the slot, the engine's RAM prompt cache, a disk restore
by auto-sessions, or nowhere (a full prefill). It shows the totals,
derived figures and every plugin's declared metrics (``collect_metrics``) at
``GET /metrics`` (Prometheus), ``GET /stats`` (JSON), and in a log line every
``log_every`` requests.

The per-service object is at ``service.state["ram_cache_stats"]``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from aiohttp import web
from prometheus_client import CollectorRegistry

import strata_serve

from strata_ram_cache_stats import exposition
from strata_ram_cache_stats.ledger import NAME, Ledger, RamCacheStatsConfig

if TYPE_CHECKING:
    from strata_serve import Service

__all__ = ["Ledger", "RamCacheStats", "RamCacheStatsConfig"]

log = logging.getLogger("strata_ram_cache_stats")

#: The plugin's name when registered by hand (tests); the entry point gives the same.
strata_name = NAME


@dataclass
class RamCacheStats:
    """One per service: the settings, the ledger, and a Prometheus registry of its own.

    Never the global registry: one process may run several servers (tests do).
    """

    config: RamCacheStatsConfig
    ledger: Ledger
    registry: CollectorRegistry

    @classmethod
    def start(cls, config: RamCacheStatsConfig, service: Service) -> RamCacheStats:
        mib = service.engine.info.cache_ram_mib
        budget = None if mib is None or mib < 0 else mib * 2**20
        ledger = Ledger(config, budget, service.measures)  # the core measures the engine
        registry = CollectorRegistry(auto_describe=False)
        registry.register(exposition.LedgerCollector(ledger, service))
        shown = ("off" if budget == 0 else "not known (the engine's default, or attached)" if mib is None
                 else "no limit" if budget is None else f"{budget // 2**20:,} MiB")
        log.info("[strata] ram cache stats: on (GET /metrics, GET /stats); engine RAM cache budget %s", shown)
        return cls(config, ledger, registry)

    def after(self, request: Any, outcome: Any, service: Service) -> None:
        if self.ledger.after(request, outcome) is None:
            return
        every = self.config.log_every
        if every and self.ledger.measured % every == 0:
            log.info("%s", exposition.summary_line(self.ledger.snapshot(), strata_serve.plugin_metrics(service)))


def _stats(service: Service) -> RamCacheStats | None:
    return service.state.get(NAME)


@strata_serve.hookimpl
def on_config(settings):
    settings.plugin_config(NAME, RamCacheStatsConfig)


@strata_serve.hookimpl
def on_startup(service):
    config = service.plugin_config(NAME, RamCacheStatsConfig)
    service.state[NAME] = RamCacheStats.start(config, service)


@strata_serve.hookimpl
def post_request(request, outcome, service):
    stats = _stats(service)
    if stats is not None:
        stats.after(request, outcome, service)


@strata_serve.hookimpl
def may_go_ahead():
    # Counting needs nothing of the slot: a request may reach the engine ahead of its turn.
    return True


@strata_serve.hookimpl
def register_routes(service):
    return [web.get("/metrics", exposition.metrics), web.get("/stats", exposition.stats)]
