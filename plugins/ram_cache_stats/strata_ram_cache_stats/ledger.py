"""The accounting: every request's tokens and prefill, and where its conversation's state came from.

Where the state came from is the core's word on each request (``request.state_source``,
the one ``X-Strata-State`` says): ``slot``, ``disk``, ``ram``, ``none`` or ``unkeyed``
(see :data:`strata_serve.StateSource`). The prefill speed and the bytes per token of the
engine's state are the core's measurements too (``service.measures``). What this adds
is memory: per conversation, its requests and what they cost; the conversations seen
for the first time (``new_conversations``); and the returns of a known conversation
that found their state nowhere (``returns_reread``).
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import Histogram
from pydantic import BaseModel, ConfigDict, Field

from strata_serve import EngineMeasures, Outcome, StrataRequest, Timings, in_tenant

NAME = "ram_cache_stats"
#: The core's sources of a measured request (an answered one: never ``engine``).
SOURCES = ("slot", "ram", "disk", "none", "unkeyed")
#: From a cached reply to a long prompt on a small CPU (seconds).
PREFILL_BUCKETS_S = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


class RamCacheStatsConfig(BaseModel):
    """``plugins.ram_cache_stats.*``."""

    model_config = ConfigDict(extra="forbid")

    #: Per-conversation records kept; past it the least recently seen is dropped.
    max_conversations: int = Field(1000, ge=1)
    #: Log a one-line summary every this many measured requests; 0 never.
    log_every: int = Field(100, ge=0)


@dataclass
class ConversationRecord:
    """What is remembered of one conversation key."""

    key: str
    first_seen: float
    last_seen: float
    requests: int = 0
    last_source: str = "none"
    last_prompt_tokens: int = 0
    reused_tokens: int = 0
    prefilled_tokens: int = 0
    prefill_ms: float = 0.0
    sources: dict[str, int] = field(default_factory=lambda: dict.fromkeys(SOURCES, 0))

    def as_dict(self) -> dict[str, Any]:
        return {
            "key": self.key,
            "requests": self.requests,
            "last_source": self.last_source,
            "sources": {name: n for name, n in self.sources.items() if n},
            "last_prompt_tokens": self.last_prompt_tokens,
            "reused_tokens": self.reused_tokens,
            "prefilled_tokens": self.prefilled_tokens,
            "prefill_seconds": round(self.prefill_ms / 1000, 3),
            "first_seen": self.first_seen,
            "last_seen": self.last_seen,
        }


class Ledger:
    """One per service: the running totals and the conversation records.

    It keeps no model of the engine and measures nothing the core measures: where each
    request's state came from is ``request.state_source``, the prefill speed and the
    bytes per token are read from ``measures`` (the core's ``service.measures``).
    """

    def __init__(self, config: RamCacheStatsConfig, budget_bytes: int | None, measures: EngineMeasures):
        self.config = config
        #: The engine's ``--cache-ram`` as started, in bytes (0 off, None unlimited or not known).
        self.budget_bytes = budget_bytes
        self.measures = measures
        self.conversations: collections.OrderedDict[str, ConversationRecord] = collections.OrderedDict()
        self.records_dropped = 0
        self.requests = dict.fromkeys(SOURCES, 0)
        #: Requests of a conversation seen for the first time (or no longer remembered).
        self.new_conversations = 0
        self.prompt_tokens = 0
        self.reused_tokens = 0
        self.prefilled_tokens = 0
        self.prefill_ms = 0.0
        #: Per engine slot: requests measured, and tokens reused and prefilled there.
        self.by_slot: dict[int, dict[str, int]] = {}
        self.prefill_seconds = Histogram(
            "strata_prefill_seconds", "Prefill time of each request (the engine's prompt_ms)",
            buckets=PREFILL_BUCKETS_S, registry=None,
        )
        self.avoided_seconds = 0.0
        #: Returns of a known conversation that found their state nowhere (source ``none``).
        self.returns_reread = 0
        #: Reused tokens seen before the prefill speed was known; priced once it is.
        self._unpriced_tokens = 0

    @property
    def measured(self) -> int:
        return sum(self.requests.values())

    @property
    def tokens_per_second(self) -> float | None:
        """Prefill speed measured on this engine (the core's), None until measured."""
        return self.measures.prefill_tokens_per_second

    @property
    def reuse_ratio(self) -> float:
        return self.reused_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    # -- events ------------------------------------------------------------------

    def after(self, request: StrataRequest, outcome: Outcome) -> str | None:
        """Account one finished request.

        :returns: where its conversation's state came from (the core's word), or None
            when it was not measured (no timings: an engine error, a cancel mid-prefill).
        """
        source = request.state_source
        if outcome.timings is None or source not in self.requests:
            return None
        key = request.conversation_key
        if key is not None:
            if key not in self.conversations:
                self.new_conversations += 1
            elif source == "none":
                self.returns_reread += 1
        self._count(key, source, outcome.timings)
        slot = self.by_slot.setdefault(request.slot, {"requests": 0, "reused_tokens": 0, "prefilled_tokens": 0})
        slot["requests"] += 1
        slot["reused_tokens"] += outcome.timings.reused
        slot["prefilled_tokens"] += outcome.timings.prefilled
        return source

    # -- inside --------------------------------------------------------------------

    def _count(self, key: str | None, source: str, timings: Timings) -> None:
        reused, prefilled = timings.reused, timings.prefilled
        prefill_ms = timings.prefill_ms or 0.0
        self.requests[source] += 1
        self.prompt_tokens += reused + prefilled
        self.reused_tokens += reused
        self.prefilled_tokens += prefilled
        self.prefill_ms += prefill_ms
        if timings.prefill_ms is not None:  # usage alone (Anthropic's Messages) gives no time
            self.prefill_seconds.observe(prefill_ms / 1000)
        self._unpriced_tokens += reused
        speed = self.tokens_per_second
        if speed:
            self.avoided_seconds += self._unpriced_tokens / speed
            self._unpriced_tokens = 0
        if key is not None:
            self._remember(key, source, reused, prefilled, prefill_ms)

    def _remember(self, key: str, source: str, reused: int, prefilled: int, prefill_ms: float) -> None:
        now = time.time()
        record = self.conversations.pop(key, None) or ConversationRecord(key, first_seen=now, last_seen=now)
        self.conversations[key] = record  # most recently seen last
        record.requests += 1
        record.last_seen = now
        record.last_source = source
        record.sources[source] += 1
        record.last_prompt_tokens = reused + prefilled
        record.reused_tokens += reused
        record.prefilled_tokens += prefilled
        record.prefill_ms += prefill_ms
        while len(self.conversations) > self.config.max_conversations:
            self.conversations.popitem(last=False)
            self.records_dropped += 1

    # -- reading -------------------------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        """The figures, as plain numbers (``/stats`` and the Prometheus collector read these)."""
        return {
            "requests": self.measured,
            "requests_by_source": dict(self.requests),
            "new_conversations": self.new_conversations,
            "prompt_tokens": self.prompt_tokens,
            "reused_tokens": self.reused_tokens,
            "prefilled_tokens": self.prefilled_tokens,
            "reuse_ratio": round(self.reuse_ratio, 4),
            "prefill_seconds": round(self.prefill_ms / 1000, 3),
            "prefill_seconds_avoided": round(self.avoided_seconds, 3),
            "prefill_tokens_per_second": _rounded(self.tokens_per_second),
            "returns_reread": self.returns_reread,
            "engine_ram_cache": {
                "budget_bytes": self.budget_bytes,
                "bytes_per_token": _rounded(self.measures.bytes_per_token),
            },
            "conversations_tracked": len(self.conversations),
            "conversation_records_dropped": self.records_dropped,
            "slots": {str(n): dict(numbers) for n, numbers in sorted(self.by_slot.items())},
        }

    def recent_conversations(self, tenant: str | None = None) -> list[dict[str, Any]]:
        """Conversation records, most recently seen first: every one, or only ``tenant``'s."""
        return [record.as_dict() for key, record in reversed(self.conversations.items())
                if tenant is None or in_tenant(key, tenant)]


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 3)
