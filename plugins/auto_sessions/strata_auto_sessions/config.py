"""auto-sessions' settings (``plugins.auto_sessions.*``), its name, and how its log lines
name sizes and slots."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, model_validator

if TYPE_CHECKING:
    from strata_serve import Service

NAME = "auto_sessions"
GB = 1024**3


class SharedConfig(BaseModel):
    """``plugins.auto_sessions.shared.*``: a tier of parked conversations several servers
    share (see docs/several-servers.md)."""

    model_config = ConfigDict(extra="forbid")

    #: ``file:///mnt/strata`` (a directory every server mounts) or ``s3://bucket/prefix``
    #: (endpoint and credentials from the usual AWS variables).
    url: str
    #: Each call on a head, a listing or a removal gives up after this long.
    timeout_s: float = Field(5.0, gt=0)
    #: Each file's upload or fetch gives up after this long.
    transfer_timeout_s: float = Field(300.0, gt=0)
    #: Uploads that failed (the store down) are tried again this often.
    retry_s: float = Field(30.0, gt=0)
    #: Conversations not saved by any server for this long are expired from the shared tier.
    max_age_days: float = Field(30.0, gt=0)
    #: An upload's objects outlive the head that stopped naming them by this long, so a
    #: server fetching them then still finishes; more than ``transfer_timeout_s``.
    lease_s: float = Field(900.0, gt=0)
    #: A directory tier's lock file is broken by another server after this long.
    lock_expiry_s: float = Field(30.0, gt=0)
    #: S3 addressing: ``path`` for most S3 look-alikes on a custom endpoint.
    addressing_style: Literal["auto", "path", "virtual"] = "auto"
    #: Conversations parked in blocks go to the tier as blocks (a manifest, and only the
    #: blocks the tier lacks); off: as whole files, their blocks joined.
    blocks: bool = True

    @model_validator(mode="after")
    def _url_and_lease(self) -> SharedConfig:
        parts = urlsplit(self.url)
        if parts.scheme == "file":
            if not parts.path.startswith("/") or parts.netloc not in ("", "localhost"):
                raise ValueError(f"shared.url {self.url!r}: a file:// URL names an absolute path (file:///mnt/strata)")
        elif parts.scheme == "s3":
            if not parts.netloc:
                raise ValueError(f"shared.url {self.url!r}: an s3:// URL names a bucket (s3://bucket/prefix)")
        else:
            raise ValueError(f"shared.url {self.url!r}: file:// or s3:// only")
        if self.lease_s <= self.transfer_timeout_s:
            raise ValueError(f"shared.lease_s ({self.lease_s:g}) must exceed shared.transfer_timeout_s "
                             f"({self.transfer_timeout_s:g}): a fetch must end before its objects may go")
        return self


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
    #: Conversations kept apart under one key (its siblings, a file each): clients
    #: without ids that open alike share a key. The least recently used are pruned first.
    #: A key that names one conversation (a client's session id) keeps one.
    siblings: int = Field(4, ge=1)
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
    #: When a save's file, its sidecar and the directory are fsynced: ``background`` (the
    #: default) right after the save, beside the next request, so a switch does not wait
    #: for the disk; ``at_save`` before the save is reported, as earlier versions did. A
    #: normal stop waits for them either way; after a power cut a file whose data had not
    #: reached the disk is refused by its size and digest, never handed to the engine.
    fsync: Literal["background", "at_save"] = "background"
    #: While the engine's RAM prompt cache has room, leave a switch to it: the outgoing
    #: conversation stays in the engine's RAM, the incoming one comes back from there, and
    #: nothing is saved or restored on the request's path (docs/sessions.md, "The engine's
    #: RAM cache"). Off: every switch parks to disk. Never with a shared tier.
    ram_first: bool = True
    #: Park conversations as blocks of tokens (docs/sessions.md, "Blocks"): a block two
    #: conversations of a tenant share is stored once, and a save writes only the blocks
    #: the store lacks. Off: whole files, as earlier versions did (states the engine's
    #: format does not cover are kept whole either way; earlier versions' files are
    #: restored, and cut into blocks at their next save).
    blocks: bool = True
    #: Tokens a block holds (64: measured best by bench/blocks.py, bench/results/blocks.md).
    block_tokens: int = Field(64, ge=1, le=1 << 20)
    #: With blocks: a directory in memory (tmpfs) the engine's saves are staged in while
    #: they are cut, so the whole file never reaches the disk (nor does a state joined from
    #: blocks for a restore, made there too), and where the newest states
    #: are kept whole so that a switch back to them is as fast as a whole file's
    #: (docs/sessions.md, "Blocks"). None: a private directory under /dev/shm, for an
    #: engine strata-serve started (an engine it attached to saves to the slot directory).
    stage_dir: Path | None = None
    #: MiB of the newest states kept whole in the stage directory, least recently used
    #: out first; None: an eighth of the machine's memory, at most 4 GiB; 0: none kept
    #: (a restore then joins its blocks).
    stage_keep_mb: int | None = Field(None, ge=0)
    #: A tier of parked conversations several servers share (``[plugins.auto_sessions.shared]``);
    #: None: the slot directory alone.
    shared: SharedConfig | None = None

    @model_validator(mode="after")
    def _min_tokens_alone(self) -> AutoSessionsConfig:
        if "min_tokens" in self.model_fields_set and "min_prefill_s" not in self.model_fields_set:
            self.min_prefill_s = 0.0
        return self


def size_text(n: int) -> str:
    """``n`` bytes as a log line says it: GB, or MB below a hundredth of one."""
    return f"{n / GB:.2f} GB" if n >= GB / 100 else f"{n / 1024**2:.2f} MB"


def from_slot(service: Service, slot: int, word: str = "from") -> str:
    """Which slot, for a log line; nothing when the engine has one."""
    return f" ({word} slot {slot})" if len(service.slots) > 1 else ""
