"""What a slot directory holds of a conversation, read the way the plugin reads it."""

from __future__ import annotations

from pathlib import Path

from strata_auto_sessions.parked_blocks import ParkedBlocks
from strata_auto_sessions.store import SessionStore


def is_parked(directory: Path, key: str, sibling: int = 0) -> bool:
    """Whether ``key``'s conversation (``sibling``) is parked in ``directory``: its sidecar
    and its state, as a whole file (``auto-<key>.bin``) or a manifest in the block store."""
    store = SessionStore(directory, ParkedBlocks.existing(directory))
    return store.sidecar_path(key, sibling).is_file() and store.stage(key, sibling)


def parked_names(directory: Path, key: str) -> list[str]:
    """The names ``key``'s parked conversations go by, siblings included (``auto-<key>.bin``,
    ``auto-<key>.1.bin``...), whether each is parked whole or in blocks."""
    store = SessionStore(directory, ParkedBlocks.existing(directory))
    return sorted(store.bin_name(key, sidecar.sibling) for sidecar in store.siblings(key))


def all_parked_names(directory: Path) -> set[str]:
    """The names of every conversation parked in ``directory``, whole or in blocks."""
    store = SessionStore(directory, ParkedBlocks.existing(directory))
    return {store.bin_name(key, sidecar.sibling) for key, sidecar in store.sessions()}
