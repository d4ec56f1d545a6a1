"""Engine facts measured once, by the core, and read by everyone.

The service records them as the engine answers (``service.measures``): the prefill
speed from every answer's timings, the bytes per token of the engine's state from
every slot file saved or restored through it, and, for every request, where its
conversation's state came from (``request.state_source``), which the client reads in
``X-Strata-State`` and a stats plugin counts. One writer: the service (``service.py``,
``slot_calls.py``) alone calls :meth:`EngineMeasures.answered` and :meth:`EngineMeasures.state_file`. No
plugin measures the engine itself; a plugin may measure what only it does (auto-sessions
the speed of its own restores and of its fetches from a shared tier).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from strata_serve.hook_types import Timings

#: Where a request's conversation state came from: ``slot`` (the slot held it), ``disk``
#: (a plugin restored it from its file), ``ram`` (neither, yet the engine reused most of
#: the prompt: its RAM prompt cache), ``none`` (the prompt was read anew), ``unkeyed``
#: (a request without a conversation key), ``engine`` (not known yet: a streamed answer's
#: headers leave before the engine says whether it is ``ram`` or ``none``).
StateSource = Literal["slot", "disk", "ram", "none", "unkeyed", "engine"]
#: A prompt reused at least this much without the slot or a restore came from the RAM cache.
RAM_REUSE_SHARE = 0.5
#: Prefill speed is measured on answers that prefilled at least this many tokens
#: (shorter ones are dominated by fixed costs).
PREFILL_SPEED_MIN_TOKENS = 64


def state_source(request: Any, timings: Timings | None) -> StateSource:
    """Where a request's conversation state came from (see :data:`StateSource`).

    ``slot``, ``disk`` and ``unkeyed`` are known once the request is sent (what the
    core and the plugins did); ``ram`` and ``none`` once the engine's ``timings`` say
    what it reused (before that: ``engine``).
    """
    if request.conversation_key is None:
        return "unkeyed"
    if request.restored_tokens:
        return "disk"
    if request.found_in_slot:
        return "slot"
    if timings is None:
        return "engine"
    prompt = timings.prompt_tokens
    return "ram" if prompt and timings.reused >= RAM_REUSE_SHARE * prompt else "none"


@dataclass
class EngineMeasures:
    """What the engine was measured to do, since the service started."""

    #: Tokens and milliseconds of the prefills long enough to time (:data:`PREFILL_SPEED_MIN_TOKENS`).
    prefill_tokens: int = 0
    prefill_ms: float = 0.0
    #: Tokens and bytes of the slot files the engine wrote (saves) and read (restores).
    state_tokens: int = 0
    state_bytes: int = 0
    #: Bytes the engine read in restores and the milliseconds they took.
    restore_bytes: int = 0
    restore_ms: float = 0.0

    # -- what the service records ------------------------------------------------------

    def answered(self, timings: Timings) -> None:
        """The engine answered a request with these ``timings``."""
        if timings.prefilled >= PREFILL_SPEED_MIN_TOKENS and timings.prefill_ms:
            self.prefill_tokens += timings.prefilled
            self.prefill_ms += timings.prefill_ms

    def state_file(self, tokens: int, nbytes: int) -> None:
        """The engine wrote or read a slot file: ``tokens`` of state in ``nbytes``."""
        if tokens > 0 and nbytes > 0:
            self.state_tokens += tokens
            self.state_bytes += nbytes

    def restored(self, nbytes: int, ms: float) -> None:
        """The engine restored a slot file of ``nbytes`` in ``ms``."""
        if nbytes > 0 and ms > 0:
            self.restore_bytes += nbytes
            self.restore_ms += ms

    # -- what everyone reads -----------------------------------------------------------

    @property
    def prefill_tokens_per_second(self) -> float | None:
        """The engine's prefill speed, None until a long enough prefill was timed."""
        return self.prefill_tokens / self.prefill_ms * 1000 if self.prefill_ms > 0 else None

    def prefill_seconds(self, tokens: int) -> float | None:
        """How long the engine takes to read ``tokens`` prompt tokens (None: not measured yet)."""
        speed = self.prefill_tokens_per_second
        return None if speed is None else tokens / speed

    def restore_seconds(self, nbytes: float) -> float | None:
        """How long the engine takes to restore a file of ``nbytes`` (None: not measured yet)."""
        if not self.restore_ms:
            return None
        return nbytes / (self.restore_bytes / self.restore_ms * 1000)

    @property
    def bytes_per_token(self) -> float | None:
        """Bytes per token of the engine's state, from its slot files (None before one)."""
        return self.state_bytes / self.state_tokens if self.state_tokens else None
