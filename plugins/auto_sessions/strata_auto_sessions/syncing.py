"""Saves made durable off the request's path (``fsync = "background"``).

A save commits its files without waiting for the disk; their fsyncs run in a thread,
beside the requests that follow, one run at a time (a save meanwhile makes it run once
more). A request's steps before the engine hold them (:meth:`BackgroundSyncs.held`): the
renames and removals of a switch would otherwise wait for them (the file system's
journal commits). A normal stop waits for all of them (:meth:`BackgroundSyncs.synced`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterator

from strata_auto_sessions.stats import AutoSessionsStats
from strata_auto_sessions.store import ParkingStore

__all__ = ["BackgroundSyncs"]

log = logging.getLogger("strata_auto_sessions")


class BackgroundSyncs:
    """The fsyncs of the saves made without them, under way; their one writer."""

    def __init__(self, store: ParkingStore | None, stats: AutoSessionsStats):
        self.store, self.stats = store, stats
        self._syncing: asyncio.Task[None] | None = None
        self._again = False
        #: Requests within :meth:`held`; a sync asked for meanwhile.
        self._holding = 0
        self._held = False

    @property
    def _later(self) -> bool:
        return bool(getattr(self.store, "sync_later", False))

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """The fsyncs of saves made meanwhile start at the end (a request's steps before the
        engine): they then run beside the engine's work on the request, not beside the
        renames, writes and removals of the switch itself."""
        self._holding += 1  # one per request in its steps before the engine
        try:
            yield
        finally:
            self._holding -= 1
            if self._held and not self._holding:
                self._held = False
                self.soon()

    def soon(self) -> None:
        """fsync what the last saves committed without it, in a thread, beside the requests
        that follow (one at a time; a call while one runs makes it run once more)."""
        if not self._later:
            return
        if self._holding:
            self._held = True
            return
        if self._syncing is not None and not self._syncing.done():
            self._again = True
            return
        self._syncing = asyncio.get_running_loop().create_task(self._sync(), name="auto-sessions fsync")

    async def _sync(self) -> None:
        while True:
            self._again = False
            try:
                await asyncio.to_thread(self.store.sync_written)  # type: ignore[union-attr]
            except OSError as exc:
                self.stats.sync_failures += 1
                log.warning("[strata] auto sessions: syncing saved files to disk failed: %s", exc)
            if not self._again:
                return

    async def synced(self) -> None:
        """Until every save so far is on disk (a normal stop waits for it)."""
        if self._syncing is not None:
            await asyncio.shield(self._syncing)
        if self._later and self.store.unsynced:  # type: ignore[union-attr]
            await self._sync()
