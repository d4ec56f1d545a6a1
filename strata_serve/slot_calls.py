"""The service's slot calls and its picture of the slots: save, restore, erase, a check
against the engine's ``GET /slots``, and the engine's generation.

:class:`SlotCalls` is one of :class:`~strata_serve.Service`'s bases (its attributes are
the service's): plugins call ``service.save_slot``, ``restore_slot``, ``erase_slot``,
``slot`` and ``check_slots``. Each call is timed on the request it works for and
recorded in ``service.slots``, whose one writer is the service (this module and
``service.py``).
"""

from __future__ import annotations

import logging
import time

from strata_serve.config import Settings
from strata_serve.engine.base import Engine, EngineUnavailable, SlotErased, SlotRestored, SlotSaved
from strata_serve.hook_types import EngineError, StrataRequest
from strata_serve.measures import EngineMeasures
from strata_serve.side_lane import MAIN, SIDE
from strata_serve.slot_state import SlotRegistry, SlotState
from strata_serve.timing import span

log = logging.getLogger("strata_serve.service")


class SlotCalls:
    """The slot calls of :class:`~strata_serve.Service` (one of its bases)."""

    settings: Settings
    engine: Engine
    #: What each engine slot holds: recorded here for every slot call.
    slots: SlotRegistry
    #: Engine facts measured once: bytes per token from every slot file saved or restored.
    measures: EngineMeasures

    @property
    def side_lane(self) -> bool:
        """Whether the engine runs a side slot beside the main one (``engine.side_slot_tokens``)."""
        return self.settings.engine.side_lane and len(self.slots) == 2

    def sync_generation(self) -> None:
        """Forget what the slots held when the engine has (re)started since."""
        if any(slot.generation != self.engine.generation for slot in self.slots):
            self.slots.engine_started(self.engine.generation)

    async def slot(self, slot: int = 0) -> SlotState:
        """What the slot holds, asking the engine first when the picture is not sure."""
        self.sync_generation()
        state = self.slots[slot]
        if state.tokens is None:
            await self.check_slots()
        return self.slots[slot]

    async def check_slots(self) -> None:
        """Compare the picture with the engine's ``GET /slots`` (its token counts win)."""
        actions = self.slots.actions()
        try:
            with span("slots"):
                answer = await self.engine.slots()
        except (EngineError, EngineUnavailable) as exc:
            log.info("[strata] could not ask the engine what its slots hold: %s", exc)
            return
        self.sync_generation()
        self.slots.adopt_engine_counts(answer, actions)

    async def save_slot(self, filename: str, *, slot: int = 0) -> SlotSaved:
        """Save a slot to ``filename`` in the slot directory, and record it."""
        with self.slots.acting(slot), span("engine_save"):
            answer = await self.engine.save(filename, slot)
        self.slots.saved(slot, answer.tokens)
        self.measures.state_file(answer.tokens, answer.bytes)
        return answer

    async def restore_slot(self, filename: str, *, slot: int = 0, key: str | None = None,
                           tenant: str | None = None, request: StrataRequest | None = None,
                           sibling: int = 0, own_file: bool = True) -> SlotRestored:
        """Load ``filename`` into a slot; it then holds ``key`` (None: a file by hand), the
        conversation its plugin numbers ``sibling`` among those under ``key`` (``SlotState.sibling``).

        ``request``, when given, is the request the restore is made for. ``own_file``: the
        file is the state of ``key``'s own file, so that file is current for the slot; False
        when it is only part of one, or made of others' (a prefix restored for a prompt).
        """
        began = time.monotonic()
        try:
            with self.slots.acting(slot), span("engine_restore"):
                try:
                    answer = await self.engine.restore(filename, slot)
                except EngineError as exc:
                    if not await self._room_made_for_restore(slot, exc):
                        raise
                    answer = await self.engine.restore(filename, slot)
        except BaseException:
            # A failed restore may have cleared the slot, or not: nothing nameable is held.
            self.slots.unknown(slot, nameable=False)
            raise
        self.slots.restored(slot, key, tenant, answer.tokens, from_own_file=own_file and key is not None,
                            sibling=sibling)
        self.measures.state_file(answer.tokens, answer.bytes)
        self.measures.restored(answer.bytes, (time.monotonic() - began) * 1000)
        if request is not None:
            request.restored_tokens = answer.tokens
        return answer

    async def _room_made_for_restore(self, slot: int, failure: EngineError) -> bool:
        """After a restore into the main slot that the engine refused: the side slot emptied
        when it held tokens, so that the restore may be tried once more.

        The engine's restore takes cells from the one KV pool and, unlike a decode, never
        purges an idle slot to find them ("no available space in KV cache"): a side slot
        that filled its room beside a shorter main conversation (or the main conversation
        at its full context beside a side answer) leaves a restore of the main conversation
        no room. A decode would purge that idle side slot itself; emptying it here does the
        same before the restore instead of after a full re-read.
        """
        if not self.side_lane or slot != MAIN or failure.status != 400:
            return False
        if self.slots[SIDE].tokens is None:
            await self.check_slots()
        side = self.slots[SIDE].tokens
        if side == 0:
            return False  # the pool was not the matter: the file was
        log.info("[strata] the engine had no room to restore the main slot beside the side slot's %s tokens: "
                 "the side slot is emptied (as the engine empties an idle slot for room) and the restore tried again",
                 "unknown" if side is None else f"{side:,}")
        await self.erase_slot(SIDE)
        return True

    async def erase_slot(self, slot: int = 0) -> SlotErased:
        try:
            with self.slots.acting(slot), span("engine_erase"):
                answer = await self.engine.erase(slot)
        except BaseException:
            self.slots.unknown(slot)
            raise
        self.slots.emptied(slot)
        return answer
