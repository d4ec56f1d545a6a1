"""Saves made around idleness: once a slot has been idle ``idle_save_s``, and right after
an answer on an engine that empties idle slots."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from strata_auto_sessions.mode import ParkingMode
from strata_auto_sessions.parts import Parts
from strata_auto_sessions.saving import park_slot

if TYPE_CHECKING:
    from strata_serve import Service


class IdleSaves:
    """The saves waiting for a slot to be idle, by slot (one each)."""

    def __init__(self, parts: Parts):
        self.parts = parts
        self._waiting: dict[int, Any] = {}

    async def save_if_emptied_when_idle(self, service: Service, slot: int) -> None:
        """On an engine that empties idle slots into its RAM cache when another slot gets
        a task (``engine.info.clears_idle_slots``, not known for an attached one), the
        slot's conversation is saved as soon as its answer ends, while its request
        still holds the slot: once idle, it may be gone from the slot at any moment."""
        if len(service.slots) > 1 and service.engine.info.clears_idle_slots is not False:
            await park_slot(self.parts, service, slot, reason="the engine empties idle slots")

    def schedule(self, service: Service, slot: int = 0) -> None:
        """Save the slot's conversation once the slot has been idle ``idle_save_s``."""
        in_slot = service.slots[slot]
        if (self.parts.config.idle_save_s <= 0 or in_slot.key is None or in_slot.file_current
                or in_slot.empty or self.parts.mode is ParkingMode.NOT_SAVING):
            return
        self.cancel(slot)
        # With one slot, once the whole service is idle (as ever); with several, once this
        # slot is, while the others may be busy.
        self._waiting[slot] = service.when_idle(
            self.parts.config.idle_save_s, lambda: self._save(service, slot),
            name="auto-sessions' save while idle", slot=None if len(service.slots) == 1 else slot)

    def cancel(self, slot: int) -> None:
        """A request comes to the slot: its idle save, if one waits, is not made."""
        idle = self._waiting.pop(slot, None)
        if idle is not None:
            idle.cancel()

    async def _save(self, service: Service, slot: int) -> None:
        if self.parts.mode.parks and (await park_slot(self.parts, service, slot, reason="idle")).on_file:
            self.parts.stats.idle_saves += 1
