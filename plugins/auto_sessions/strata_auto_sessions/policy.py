"""Whether a conversation is worth a file: ``min_tokens``, then ``min_prefill_s`` against
the speeds the core measured (``service.measures``) and the restore speed measured here."""

from __future__ import annotations

from strata_auto_sessions.config import AutoSessionsConfig
from strata_serve import EngineMeasures


class RestoreSpeed:
    """How fast restores read their files on this engine, measured from earlier restores."""

    def __init__(self) -> None:
        #: Bytes read and the milliseconds it took.
        self._read = [0, 0.0]

    def restored(self, n_read: int, ms: float) -> None:
        """A restore read ``n_read`` bytes in ``ms``."""
        if n_read and ms > 0:
            self._read[0] += n_read
            self._read[1] += ms

    def seconds(self, size: float) -> float | None:
        """How long restoring a file of ``size`` bytes takes, as measured here (None: not yet)."""
        if not self._read[1]:
            return None
        return size / (self._read[0] / self._read[1] * 1000)


def worth_a_file(tokens: int | None, config: AutoSessionsConfig, speeds: EngineMeasures,
                 restores: RestoreSpeed) -> tuple[bool, str]:
    """Whether a conversation of ``tokens`` is worth a file, and why not."""
    if tokens is None:
        return True, ""  # not known even after asking the engine: when in doubt, save
    if tokens < config.min_tokens:
        return False, f"{tokens:,} tokens is below min_tokens ({config.min_tokens:,})"
    prefill_s = speeds.prefill_seconds(tokens)
    if config.min_prefill_s <= 0 or prefill_s is None:
        return True, ""
    restore_s = 0.0
    if speeds.bytes_per_token:
        restore_s = restores.seconds(tokens * speeds.bytes_per_token) or 0.0
    if prefill_s - restore_s < config.min_prefill_s:
        return False, (f"re-reading its {tokens:,} tokens takes about {prefill_s:.1f} s here, less than "
                       f"min_prefill_s ({config.min_prefill_s:g} s) more than a restore")
    return True, ""


def describe(config: AutoSessionsConfig) -> str:
    """The thresholds, for the start's log line."""
    parts = []
    if config.min_prefill_s > 0:
        parts.append(f"{config.min_prefill_s:g} s of prefill saved")
    if config.min_tokens > 0:
        parts.append(f"{config.min_tokens:,} tokens")
    return " and ".join(parts) or "any length"
