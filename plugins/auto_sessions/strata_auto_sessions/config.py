"""auto-sessions' settings (``plugins.auto_sessions.*``), its name, and how its log lines
name sizes and slots."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

NAME = "auto_sessions"
GB = 1024**3


class AutoSessionsConfig(BaseModel):
    """``plugins.auto_sessions.*``."""

    model_config = ConfigDict(extra="forbid")

    #: A conversation is worth a file when re-reading it would take at least this many
    #: seconds more than restoring it: prefill speed measured from the engine's own
    #: timings, restore speed from earlier restores. Until they are measured, every
    #: conversation of ``min_tokens`` or more is (when in doubt, save).
    min_prefill_s: float = Field(2.0, ge=0)
    #: Conversations shorter than this are never worth a file. Set alone (without
    #: ``min_prefill_s``), it is the only threshold, as in earlier versions.
    min_tokens: int = Field(0, ge=0)
    #: Keep at most this many session files...
    keep: int = Field(12, ge=1)
    #: ...and at most this many GB of them.
    max_gb: float = Field(100, gt=0)
    #: The slot directory; default: the engine's ``slot_save_path``.
    slot_dir: Path | None = None
    #: After a restore, a next request reusing less than this share of the restored
    #: tokens is reported as "restore not reused".
    reuse_warn_ratio: float = Field(0.5, ge=0, le=1)
    #: Save the held conversation once the server has been idle this long (0: never),
    #: so a later switch need not wait for its save.
    idle_save_s: float = Field(2.0, ge=0)
    #: After restores of continued conversations went unused (the engine cannot reuse
    #: restored state for this model), parking pauses this long, then tries again;
    #: each further pause is twice as long.
    retry_after_s: float = Field(600.0, gt=0)
    #: Files saved by an engine build at most this many llama.cpp builds apart from the
    #: running one are restored; farther apart they are refused.
    build_range: int = Field(1000, ge=0)
    #: Wait at most this long for the slot directory's lock, which another server or
    #: ``strata-serve sessions`` may hold; then the save, restore or prune is given up
    #: (logged) and the request goes on without it.
    lock_wait_s: float = Field(10.0, gt=0)

    @model_validator(mode="after")
    def _min_tokens_alone(self) -> AutoSessionsConfig:
        if "min_tokens" in self.model_fields_set and "min_prefill_s" not in self.model_fields_set:
            self.min_prefill_s = 0.0
        return self


def size_text(n: int) -> str:
    """``n`` bytes as a log line says it: GB, or MB below a hundredth of one."""
    return f"{n / GB:.2f} GB" if n >= GB / 100 else f"{n / 1024**2:.2f} MB"


def from_slot(service: Any, slot: int, word: str = "from") -> str:
    """Which slot, for a log line; nothing when the engine has one."""
    return f" ({word} slot {slot})" if len(service.slots) > 1 else ""
