"""The accounting: every request's tokens and prefill, and where its conversation's state came from.

Sources, decided after each request from its key, the engine's ``timings`` and what
the core recorded of it (``request.found_in_slot``, ``request.restored_tokens``):

- ``slot``: the slot held the conversation when the request was sent, and it was reused.
- ``ram``: a switch back to a conversation that found its state without a restore:
  the engine's RAM prompt cache brought it back (seen in ``cache_n``, not guessed).
- ``disk``: a plugin restored it from its file, and the engine reused it.
- ``none``: a returning conversation that reused little: it paid a full prefill.
- ``new``: a conversation seen for the first time (or no longer remembered).
- ``unkeyed``: a request without a conversation key; nothing to compare it with.

A conversation "found its state" when it reused (``cache_n``) at least ``hit_ratio``
of what it could have: the smaller of its prompt now and its prompt last time (or,
after a restore, the tokens restored).
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from prometheus_client import Histogram
from pydantic import BaseModel, ConfigDict, Field

from strata_serve import Outcome, StrataRequest, Timings, in_tenant

NAME = "ram_cache_stats"
SOURCES = ("slot", "ram", "disk", "none", "new", "unkeyed")
#: From a cached reply to a long prompt on a small CPU (seconds).
PREFILL_BUCKETS_S = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


class RamCacheStatsConfig(BaseModel):
    """``plugins.ram_cache_stats.*``."""

    model_config = ConfigDict(extra="forbid")

    #: Per-conversation records kept; past it the least recently seen is dropped.
    max_conversations: int = Field(1000, ge=1)
    #: Log a one-line summary every this many measured requests; 0 never.
    log_every: int = Field(100, ge=0)
    #: A returning conversation found its state when it reused at least this share
    #: of the tokens it could have reused.
    hit_ratio: float = Field(0.5, gt=0, le=1)
    #: Prefill speed is measured on requests that prefilled at least this many tokens
    #: (shorter ones are dominated by fixed costs).
    speed_min_tokens: int = Field(32, ge=1)


@dataclass
class ConversationRecord:
    """What is remembered of one conversation key."""

    key: str
    first_seen: float
    last_seen: float
    requests: int = 0
    last_source: str = "new"
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

    It keeps no model of the engine: what the slot held comes from the core's record
    of each request. ``measure_bytes_per_token`` returns the engine's bytes per token
    of state as measured from slot saves (the core's ``service.slots.bytes_per_token``), or None while unknown.
    """

    def __init__(self, config: RamCacheStatsConfig, budget_bytes: int | None,
                 measure_bytes_per_token: Callable[[], float | None]):
        self.config = config
        #: The engine's ``--cache-ram`` as started, in bytes (0 off, None unlimited or not known).
        self.budget_bytes = budget_bytes
        self._measure_bytes_per_token = measure_bytes_per_token
        self.bytes_per_token: float | None = None
        self.conversations: collections.OrderedDict[str, ConversationRecord] = collections.OrderedDict()
        self.records_dropped = 0
        self.requests = dict.fromkeys(SOURCES, 0)
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
        #: Returns of a known conversation, without a restore, that re-read their context.
        self.returns_reread = 0
        self._speed_tokens = 0
        self._speed_ms = 0.0
        #: Reused tokens seen before the prefill speed was known; priced once it is.
        self._unpriced_tokens = 0

    @property
    def measured(self) -> int:
        return sum(self.requests.values())

    @property
    def tokens_per_second(self) -> float | None:
        """Prefill speed measured on this engine, None until a long enough prefill was seen."""
        return self._speed_tokens / self._speed_ms * 1000 if self._speed_ms > 0 else None

    @property
    def reuse_ratio(self) -> float:
        return self.reused_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    # -- events ------------------------------------------------------------------

    def after(self, request: StrataRequest, outcome: Outcome) -> str | None:
        """Account one finished request.

        :returns: where its conversation's state came from, or None when it was not
            measured (a slot action, or no timings: an engine error, a cancel mid-prefill).
        """
        if request.route == "slots" or outcome.timings is None:
            return None
        key = request.conversation_key
        source = self._source(key, request, outcome)
        self._count(key, source, outcome.timings)
        slot = self.by_slot.setdefault(request.slot, {"requests": 0, "reused_tokens": 0, "prefilled_tokens": 0})
        slot["requests"] += 1
        slot["reused_tokens"] += outcome.timings.reused
        slot["prefilled_tokens"] += outcome.timings.prefilled
        return source

    # -- inside --------------------------------------------------------------------

    def _source(self, key: str | None, request: StrataRequest, outcome: Outcome) -> str:
        if key is None:
            return "unkeyed"
        prompt = outcome.prompt_tokens or 0
        reused = outcome.timings.reused if outcome.timings is not None else 0
        restored = request.restored_tokens
        if restored:
            return "disk" if reused >= self.config.hit_ratio * min(prompt, restored) else "none"
        record = self.conversations.get(key)
        if record is None:
            return "new"
        if reused >= self.config.hit_ratio * min(prompt, record.last_prompt_tokens):
            return "slot" if request.found_in_slot else "ram"
        self.returns_reread += 1
        return "none"

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
        if prefilled >= self.config.speed_min_tokens and prefill_ms > 0:
            self._speed_tokens += prefilled
            self._speed_ms += prefill_ms
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
        self.bytes_per_token = self._measure_bytes_per_token() or self.bytes_per_token
        return {
            "requests": self.measured,
            "requests_by_source": dict(self.requests),
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
                "bytes_per_token": _rounded(self.bytes_per_token),
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
