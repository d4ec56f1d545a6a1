"""Bytes per token of the engine's state and its prefill speed, as auto-sessions measures them.

Bytes per token comes from auto-sessions' own saves (and, at start, from the files on
disk); prefill speed from the engine's timings of requests that prefilled enough
tokens to say.
"""

from __future__ import annotations

from strata_serve import Timings

#: Prefill speed is measured on requests that prefilled at least this many tokens.
SPEED_MIN_TOKENS = 64


class EngineSpeeds:
    """What the engine's state weighs per token and how fast it reads a prompt, measured here."""

    def __init__(self, bytes_per_token: float | None = None):
        #: Bytes per token of the engine's state, measured from our saves.
        self.bytes_per_token: float | None = bytes_per_token
        #: Prefill speed measured on this engine (tokens, ms).
        self._prefill = [0, 0.0]

    def request_ran(self, timings: Timings) -> None:
        """A request's answer ended with these ``timings``: count its prefill."""
        prefilled, prefill_ms = timings.prefilled, timings.prefill_ms or 0.0
        if prefilled >= SPEED_MIN_TOKENS and prefill_ms > 0:
            self._prefill[0] += prefilled
            self._prefill[1] += prefill_ms

    def slot_saved(self, n_saved: int, n_written: int) -> None:
        """A save wrote ``n_written`` bytes for ``n_saved`` tokens (``n_saved`` > 0)."""
        self.bytes_per_token = n_written / n_saved

    def prefill_seconds(self, tokens: int) -> float | None:
        """How long the engine takes to read ``tokens`` prompt tokens, as measured here (None: not yet)."""
        if not self._prefill[1]:
            return None
        return tokens / (self._prefill[0] / self._prefill[1] * 1000)
