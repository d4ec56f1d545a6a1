"""The one cost rule of parking: whether a conversation's state is worth keeping and
bringing back (a file, a restore by tokens, a fetch from the shared tier, a fallback
plugin's choice), from ``min_tokens``, then ``min_prefill_s`` against what the core
measured (``service.measures``: the engine's prefill and restore speeds)."""

from __future__ import annotations

from dataclasses import dataclass

from strata_auto_sessions.config import AutoSessionsConfig
from strata_serve import EngineMeasures


@dataclass(frozen=True)
class Costs:
    """What re-reading a conversation and bringing its state back cost on this engine, as
    measured; the value a fallback plugin gets (``auto_sessions_fallback(costs=...)``)."""

    speeds: EngineMeasures
    min_tokens: int = 0
    min_prefill_s: float = 0.0

    @classmethod
    def of(cls, config: AutoSessionsConfig, speeds: EngineMeasures) -> Costs:
        return cls(speeds, config.min_tokens, config.min_prefill_s)

    def prefill_seconds(self, tokens: int) -> float | None:
        """How long the engine takes to read ``tokens`` prompt tokens (None: not measured yet)."""
        return self.speeds.prefill_seconds(tokens)

    def restore_seconds(self, size: float) -> float | None:
        """How long the engine takes to restore ``size`` bytes of state (None: not measured yet)."""
        return self.speeds.restore_seconds(size)

    def worth(self, tokens: int | None, size: float | None = None, *, more_s: float = 0.0,
              more: str = "") -> tuple[bool, str]:
        """Whether ``tokens`` of state (``size`` bytes; by default as measured per token) are
        worth keeping and bringing back, at ``more_s`` besides the restore (a fetch,
        ``more`` saying what); and why not. Not measured yet: worth it (when in doubt, keep)."""
        if tokens is None:
            return True, ""  # not known even after asking the engine: when in doubt, save
        if tokens < self.min_tokens:
            return False, f"{tokens:,} tokens is below min_tokens ({self.min_tokens:,})"
        prefill_s = self.prefill_seconds(tokens)
        if self.min_prefill_s <= 0 or prefill_s is None:
            return True, ""
        if size is None and self.speeds.bytes_per_token:
            size = tokens * self.speeds.bytes_per_token
        restore_s = (self.restore_seconds(size) or 0.0) if size else 0.0
        if prefill_s - restore_s - more_s < self.min_prefill_s:
            return False, (f"re-reading its {tokens:,} tokens takes about {prefill_s:.1f} s here, less than "
                           f"min_prefill_s ({self.min_prefill_s:g} s) more than "
                           + (f"{more} ({more_s:.1f} s) and restoring it ({restore_s:.1f} s)" if more
                              else "a restore"))
        return True, ""


def describe(config: AutoSessionsConfig) -> str:
    """The thresholds, for the start's log line."""
    parts = []
    if config.min_prefill_s > 0:
        parts.append(f"{config.min_prefill_s:g} s of prefill saved")
    if config.min_tokens > 0:
        parts.append(f"{config.min_tokens:,} tokens")
    return " and ".join(parts) or "any length"
