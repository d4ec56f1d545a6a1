"""What a slot directory holds of parked conversations, read the way auto-sessions reads it."""

from __future__ import annotations

from pathlib import Path

from strata_auto_sessions.parked_blocks import ParkedBlocks
from strata_auto_sessions.store import SessionStore


def parked_names(directory: Path, prefix: str = "auto-") -> list[str]:
    """The names of the conversations parked in ``directory`` (``auto-<key>.bin``), whole
    or in blocks (a sidecar and a manifest: no file under the name), that start with
    ``prefix``; sorted."""
    store = SessionStore(directory, ParkedBlocks.existing(directory))
    names = (store.bin_name(key, sidecar.sibling) for key, sidecar in store.sessions())
    return sorted(name for name in names if name.startswith(prefix))
