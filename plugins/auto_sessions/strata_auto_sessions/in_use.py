"""The conversations in use: those the slots hold and those of the requests running.

Pruning spares their files (one may be restoring its file right now), and ``strata-serve
sessions rm``, which runs in another process, reads them from beside the files
(:class:`InUseRecord`) so that it never removes a conversation a slot still holds.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from strata_auto_sessions.store import ParkingStore

if TYPE_CHECKING:
    from strata_serve import Service

__all__ = ["InUseRecord", "in_use"]

log = logging.getLogger("strata_auto_sessions")


def in_use(service: Service, *keys: str | None) -> frozenset[str]:
    """Conversations whose files pruning must spare: ``keys``, those the slots hold, and
    those of the requests running (one may be restoring its file right now)."""
    held = (state.key for state in service.slots)
    running = service.fifo.busy.values()
    return frozenset(k for k in (*keys, *held, *running) if k is not None)


class InUseRecord:
    """What was last recorded beside the files as in use (``store.record_held``); its one
    writer, written only when it changes."""

    def __init__(self, store: ParkingStore | None):
        self.store = store
        self._recorded: list[str] | None = None

    def record(self, service: Service) -> None:
        """Record the conversations the slots hold or the requests run, saved or not."""
        keys = sorted(in_use(service))
        if keys != self._recorded:
            self.write(keys)

    def write(self, keys: list[str]) -> None:
        if self.store is None:
            return
        try:
            self.store.record_held(keys)
        except OSError as exc:
            log.warning("[strata] auto sessions: cannot record the held conversations in %s: %s",
                        self.store.directory, exc)
            return
        self._recorded = keys
