"""The accounting: every request's tokens and prefill, and where its conversation's state came from.

Sources, decided after each request from its key, the engine's ``timings`` and what
auto-sessions did in front of it:

- ``slot``: the same conversation as the request before; the slot still held it.
- ``ram``: a switch back to a conversation that found its state without a restore:
  the engine's RAM prompt cache brought it back.
- ``disk``: auto-sessions restored it from its file, and the engine reused it.
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

from strata_serve.exchange import Outcome, StrataRequest

from strata_serve.engine.ram_cache import EngineRamModel

NAME = "ram_cache_stats"
#: Where auto-sessions leaves ``{"restored_tokens": n, ...}`` on a request it restored.
AUTO_SESSIONS = "auto_sessions"
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
    """One per service: the running totals, the conversation records, the RAM cache model.

    ``measure_bytes_per_token`` returns the engine's bytes per token of state as
    measured from slot saves (auto-sessions' numbers), or None while unknown.
    """

    def __init__(self, config: RamCacheStatsConfig, ram: EngineRamModel | None,
                 measure_bytes_per_token: Callable[[], float | None]):
        self.config = config
        self.ram = ram
        self._measure_bytes_per_token = measure_bytes_per_token
        self.bytes_per_token: float | None = None
        self.conversations: collections.OrderedDict[str, ConversationRecord] = collections.OrderedDict()
        self.records_dropped = 0
        self.requests = dict.fromkeys(SOURCES, 0)
        self.prompt_tokens = 0
        self.reused_tokens = 0
        self.prefilled_tokens = 0
        self.prefill_ms = 0.0
        self.prefill_seconds = Histogram(
            "strata_prefill_seconds", "Prefill time of each request (the engine's prompt_ms)",
            buckets=PREFILL_BUCKETS_S, registry=None,
        )
        self.avoided_seconds = 0.0
        self.ram_misses = 0
        self._speed_tokens = 0
        self._speed_ms = 0.0
        #: Reused tokens seen before the prefill speed was known; priced once it is.
        self._unpriced_tokens = 0
        #: What the slot holds: a conversation key (or a name for an unkeyed prompt) and its tokens.
        self.held_key: str | None = None
        self.held_tokens = 0

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

    def engine_restarted(self) -> None:
        """The slot and the engine's RAM cache are empty again."""
        self.held_key, self.held_tokens = None, 0
        if self.ram is not None:
            self.ram.clear()

    def after(self, request: StrataRequest, outcome: Outcome) -> str | None:
        """Account one finished request.

        :returns: where its conversation's state came from, or None when it was not
            measured (a slot action, an engine error, a cancel before any timings).
        """
        if request.route == "slots":
            if outcome.status == "ok" and request.body.get("action") in ("restore", "erase"):
                self.held_key, self.held_tokens = None, 0  # changed by hand: we cannot name it
            return None
        if outcome.status == "error":
            return None  # the engine did not take it: the slot holds what it held
        key = request.conversation_key
        restored = int(request.state.get(AUTO_SESSIONS, {}).get("restored_tokens") or 0)
        incoming = key if key is not None else f"#unkeyed-{request.id}"
        switch = incoming != self.held_key
        was_parked = self._switch_in_ram(key, restored) if switch else False
        self.held_key, self.held_tokens = incoming, outcome.context_tokens or 0
        if not outcome.timings:
            return None
        source = self._source(key, switch, restored, outcome, was_parked)
        self._count(key, source, outcome.timings)
        return source

    # -- inside --------------------------------------------------------------------

    def _switch_in_ram(self, key: str | None, restored: int) -> bool:
        """Play the engine's RAM cache for a switch; True if the incoming one was parked there."""
        # Saves happen on switches, so a switch is when the measure can have changed.
        self.bytes_per_token = self._measure_bytes_per_token() or self.bytes_per_token
        if self.ram is None or restored:
            return False  # a restore overwrote the slot: nothing was parked, nothing taken
        if self.held_key is not None and self.held_tokens > 0:
            self.ram.park(self.held_key, self.held_tokens, self.bytes_per_token)
        return key is not None and self.ram.take(key)

    def _source(self, key: str | None, switch: bool, restored: int, outcome: Outcome,
                was_parked: bool) -> str:
        if key is None:
            return "unkeyed"
        prompt = outcome.prompt_tokens or 0
        reused = int(outcome.timings.get("cache_n", 0))  # type: ignore[union-attr]
        record = self.conversations.get(key)
        if restored:
            return "disk" if reused >= self.config.hit_ratio * min(prompt, restored) else "none"
        if record is None:
            return "new"
        if reused >= self.config.hit_ratio * min(prompt, record.last_prompt_tokens):
            return "ram" if switch else "slot"
        if was_parked:
            self.ram_misses += 1
        return "none"

    def _count(self, key: str | None, source: str, timings: dict[str, Any]) -> None:
        reused, prefilled = int(timings.get("cache_n", 0)), int(timings.get("prompt_n", 0))
        prefill_ms = float(timings.get("prompt_ms", 0.0))
        self.requests[source] += 1
        self.prompt_tokens += reused + prefilled
        self.reused_tokens += reused
        self.prefilled_tokens += prefilled
        self.prefill_ms += prefill_ms
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
        ram = self.ram
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
            "engine_ram_cache": {
                "budget_bytes": ram.budget if ram is not None else 0,
                "bytes_per_token": _rounded(self.bytes_per_token),
                "estimated_tokens": ram.tokens if ram is not None else 0,
                "estimated_bytes": ram.estimated_bytes(self.bytes_per_token) if ram is not None else 0,
                "conversations": len(ram.entries) if ram is not None else 0,
                "misses": self.ram_misses,
            },
            "conversations_tracked": len(self.conversations),
            "conversation_records_dropped": self.records_dropped,
        }

    def recent_conversations(self, key_prefix: str = "") -> list[dict[str, Any]]:
        """Conversation records, most recently seen first (only keys starting with ``key_prefix``)."""
        return [record.as_dict() for key, record in reversed(self.conversations.items())
                if key.startswith(key_prefix)]


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 3)
