"""The shared tier's upkeep: the sweep of expired conversations and unreferenced objects; removal by hand.

No server owns the shared tier: each sweeps it now and then (its heads by
compare-and-swap, so one saved meanwhile stays), and ``strata-serve sessions rm`` writes
tombstones over a key's heads rather than deleting them, so that no server's later
upload of a state begun before brings the conversation back. Objects go only once
``lease_s`` has passed since they were written: a fetch or an upload under way ends
first.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable
from typing import Any, TypeVar

from strata_auto_sessions.config import SharedConfig
from strata_auto_sessions.naming import PREFIX, file_key
from strata_auto_sessions.shared.blocks import MANIFEST_MARK, held_blocks
from strata_auto_sessions.shared.ledger import sidecar_name
from strata_auto_sessions.shared.tier import ConditionFailed, DamagedHead, Head, SharedTier, writer_name

__all__ = ["remove_by_hand", "sweep"]

log = logging.getLogger("strata_auto_sessions")

T = TypeVar("T")


async def sweep(tier: SharedTier, config: SharedConfig, call: Any, stats: Any = None) -> tuple[int, int]:
    """Forget conversations no server saved for ``max_age_days`` (their heads, by
    compare-and-swap: one saved meanwhile stays), tombstones as old, objects no head
    names once ``lease_s`` has passed since they were written (a fetch or an upload
    under way ends sooner), and what uploads that never ended left (a killed server's
    partial object or open multipart upload) once as old. A damaged head is logged,
    counted (``stats.shared_damaged_heads``) and passed over, its conversation's objects
    kept: it never stops the sweep. Returns (heads, objects) removed."""
    now = time.time()
    max_age = config.max_age_days * 86400
    live: set[str] = set()
    unknown: list[str] = []  # the objects' names of conversations whose head is damaged begin so
    heads_removed = 0
    for name in await call(tier.heads(PREFIX)):
        if not name.endswith(".bin"):
            continue
        try:
            current = await call(tier.head(name))
        except DamagedHead as exc:
            unknown.append(name[: -len(".bin")] + ".")
            if stats is not None:
                stats.shared_damaged_heads += 1
            log.warning("[strata] auto sessions: shared tier: %s: damaged head passed over by the sweep, its "
                        "objects kept: %s", name, exc)
            continue
        if current is None:
            continue
        head, version = current
        if now - head.written > max_age:
            try:
                await call(tier.delete_head(name, version))
                heads_removed += 1
                continue
            except ConditionFailed:
                current = await call(tier.head(name))
                if current is None:
                    continue
                head = current[0]
        objects = head.objects(name, sidecar_name(name))
        live.update(objects or ())
    objects_removed = 0
    manifests = []
    for listed in await call(tier.list(PREFIX)):
        if listed.name not in live and not listed.name.startswith(tuple(unknown)) \
                and now - listed.modified > config.lease_s:
            await call(tier.delete(listed.name))
            objects_removed += 1
        elif MANIFEST_MARK in listed.name:
            manifests.append(listed.name)
    if callable(getattr(tier, "blocks", None)):
        objects_removed += await _sweep_blocks(tier, config, call, manifests, now)
    remove_partial = getattr(tier, "remove_partial", None)  # a tier of a plugin's may have none
    if remove_partial is not None:
        objects_removed += await call(remove_partial(config.lease_s))
    if heads_removed or objects_removed:
        log.info("[strata] auto sessions: shared tier: expired %d conversation file(s), removed %d object(s) no "
                 "head names", heads_removed, objects_removed)
    return heads_removed, objects_removed


async def _sweep_blocks(tier: SharedTier, config: SharedConfig, call: Any, manifests: list[str], now: float) -> int:
    """Remove the blocks no manifest object left in the tier names (those of heads, of
    uploads under way and of damaged heads alike: all stay until their lease is over),
    once older than ``lease_s`` (an upload puts its blocks before its manifest). None is
    removed when a manifest cannot be read: what it holds is unknown."""
    held = await held_blocks(tier, manifests, call)
    if held is None:
        log.warning("[strata] auto sessions: shared tier: a manifest could not be read; no block removed by this sweep")
        return 0
    removed = 0
    for listed in await call(tier.blocks()):
        if listed.name not in held and now - listed.modified > config.lease_s:
            await call(tier.delete_block(listed.name))
            removed += 1
    return removed


async def remove_by_hand(tier: SharedTier, config: SharedConfig, keys: list[str]) -> list[str]:
    """``strata-serve sessions rm``: a tombstone over each shared file of ``keys`` (its
    objects go at the next sweep), so no server's later upload of a state begun before
    now brings it back. Returns the names removed."""
    removed = []
    now = time.time()

    async def call(work: Awaitable[T]) -> T:
        return await asyncio.wait_for(work, config.timeout_s)

    for key in keys:
        for name in await call(tier.heads(f"{PREFIX}{file_key(key)}.")):
            if not name.endswith(".bin"):
                continue
            for _attempt in range(5):
                current = await call(tier.head(name))
                generation = current[0].generation if current is not None else 0
                try:
                    await call(tier.put_head(name, Head(generation=generation + 1, upload=None, removed=now,
                                                        writer=writer_name()),
                                             current[1] if current is not None else None))
                    removed.append(name)
                    break
                except ConditionFailed:
                    continue  # a server saved it meanwhile: over that one too
    return removed
