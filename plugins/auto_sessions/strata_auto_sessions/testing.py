"""What a slot directory holds of parked conversations, read the way auto-sessions reads
it: for tests (this project's, a keying or store plugin's, a deployment's checks).

A conversation is parked as a whole file (``auto-<key>.bin`` beside its sidecar) or in
blocks (its sidecar and a manifest in the block store, no ``.bin``). A test that looks
for a file by its name would pass on one way of parking and fail on the other; these
ask the session store, as the plugin and ``strata-serve sessions ls`` do.
"""

from __future__ import annotations

from pathlib import Path

from strata_auto_sessions.parked_blocks import ParkedBlocks
from strata_auto_sessions.store import SessionStore

__all__ = ["all_parked_names", "is_parked", "parked_names"]


def _store(directory: Path) -> SessionStore:
    return SessionStore(directory, ParkedBlocks.existing(directory))


def is_parked(directory: Path, key: str, sibling: int = 0) -> bool:
    """Whether ``key``'s conversation (``sibling``) is parked in ``directory``: its sidecar
    and its state, as a whole file or a manifest in the block store."""
    store = _store(directory)
    return store.sidecar_path(key, sibling).is_file() and store.stage(key, sibling)


def parked_names(directory: Path, key: str) -> list[str]:
    """The names ``key``'s parked conversations go by, siblings included (``auto-<key>.bin``,
    ``auto-<key>.1.bin``...), whether each is parked whole or in blocks; sorted."""
    store = _store(directory)
    return sorted(store.bin_name(key, sidecar.sibling) for sidecar in store.siblings(key))


def all_parked_names(directory: Path, prefix: str = "auto-") -> list[str]:
    """The names of every conversation parked in ``directory``, whole or in blocks, that
    start with ``prefix``; sorted."""
    store = _store(directory)
    names = (store.bin_name(key, sidecar.sibling) for key, sidecar in store.sessions())
    return sorted(name for name in names if name.startswith(prefix))
