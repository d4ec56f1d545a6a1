"""The conversations in use: those the slots hold and those of the requests running.

Pruning spares their files (one may be restoring its file right now), and ``strata-serve
sessions rm``, which runs in another process, reads them from beside the files
(:class:`InUseRecord`) so that it never removes a conversation a slot still holds.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
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
    writer, written only when it changes.

    ``left_in_ram``: the conversations left to the engine's RAM cache
    (:mod:`strata_auto_sessions.engine_ram`), recorded too. They are the server's and may
    have no file yet, so ``sessions rm`` must find them (it drops their save at the stop);
    and with them, a switch between conversations the server already holds changes nothing
    to record: short chats taking turns through the RAM cache cost no write per request.
    """

    def __init__(self, store: ParkingStore | None):
        self.store = store
        self._recorded: list[str] | None = None
        self.left_in_ram: Callable[[], Iterable[str]] = tuple

    def record(self, service: Service) -> None:
        """Record the conversations the slots hold or the requests run, and those left to
        the engine's RAM cache, saved or not."""
        keys = sorted(in_use(service).union(self.left_in_ram()))
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
