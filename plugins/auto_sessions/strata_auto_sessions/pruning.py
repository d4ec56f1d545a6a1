"""Pruning the session files (``keep``, ``max_gb``), and counting what is on disk."""

from __future__ import annotations

import logging

from strata_auto_sessions.config import GB, AutoSessionsConfig, size_text
from strata_auto_sessions.parts import Parts
from strata_auto_sessions.siblings import SiblingIndex
from strata_auto_sessions.stats import AutoSessionsStats
from strata_auto_sessions.store import ParkingStore

log = logging.getLogger("strata_auto_sessions")


def refresh_usage(store: ParkingStore, stats: AutoSessionsStats, report: bool = False) -> None:
    """Count the files on disk (after a change, not at every read of the numbers);
    ``report`` logs each file whose sidecar is damaged."""
    try:
        stats.files_on_disk, stats.bytes_on_disk = store.usage()
        damaged = store.damaged()
    except OSError as exc:
        log.warning("[strata] auto sessions: cannot list %s: %s", store.directory, exc)
        return
    stats.damaged_files = len(damaged)
    blocks = getattr(store, "blocks", None)
    if blocks is not None:
        try:
            sizes = blocks.sizes()
            held = sum(h.own + h.shared for h in blocks.holdings().values())
        except OSError as exc:
            log.warning("[strata] auto sessions: cannot list the block store: %s", exc)
        else:
            stats.blocks_stored, stats.blocks_bytes = len(sizes), sum(sizes.values())
            stats.blocks_deduplicated_bytes = max(0, held - stats.blocks_bytes)
    for _key, path, why in damaged if report else ():
        log.warning("[strata] auto sessions: %s is left alone, never restored: its sidecar is damaged (%s)",
                    path.name, why)


async def prune_siblings(parts: Parts, key: str, spare: frozenset[int]) -> None:
    """Remove ``key``'s least recently used siblings beyond ``siblings``, sparing ``spare``
    (the one just saved, the one about to be restored)."""
    store = parts.store
    if store is None or len(parts.siblings.of(key)) <= parts.config.siblings:
        return
    try:
        async with store.lock_without_blocking(parts.config.lock_wait_s):
            removed = store.prune_siblings(key, parts.config.siblings, spare)
    except OSError as exc:  # a lock held elsewhere too long (LockTimeout) among them
        log.warning("[strata] auto sessions: pruning %s's siblings failed: %s", key, exc)
        return
    for sibling, size in removed:
        parts.siblings.removed(key, sibling)
        parts.stats.sibling_prunes += 1
        parts.stats.prunes += 1
        parts.stats.pruned_bytes += size
        log.info("[strata] auto sessions: pruned %s (%s): %s keeps %d conversation(s)",
                 store.bin_name(key, sibling), size_text(size), key, parts.config.siblings)


async def prune(store: ParkingStore, config: AutoSessionsConfig, stats: AutoSessionsStats,
                protect: frozenset[str] = frozenset(), index: SiblingIndex | None = None) -> None:
    """Remove the oldest files beyond ``keep`` and ``max_gb``, sparing ``protect`` (every
    sibling of those keys); ``index``, the siblings auto-sessions keeps in memory, is told."""
    try:
        async with store.lock_without_blocking(config.lock_wait_s):
            removed = store.prune(config.keep, int(config.max_gb * GB), protect)
    except OSError as exc:  # a lock held elsewhere too long (LockTimeout) among them
        log.warning("[strata] auto sessions: pruning failed: %s", exc)
        return
    finally:
        refresh_usage(store, stats)
    if stats.bytes_on_disk > config.max_gb * GB:
        log.warning("[strata] auto sessions: %s of session files kept, more than max_gb (%g): the newest "
                    "file and the one about to be restored are never pruned", size_text(stats.bytes_on_disk),
                    config.max_gb)
    for key, size in removed:
        stats.prunes += 1
        stats.pruned_bytes += size
        if index is not None:
            index.forget(key)  # which of its siblings went is read again when it matters
        log.info("[strata] auto sessions: pruned a file of %s (%s)", key, size_text(size))
