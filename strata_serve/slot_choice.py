"""Which slot a request runs in, decided in one place.

A request claims the FIFO (:func:`claim_for`): for its conversation, placed by
:func:`choose_slot` once a slot it may use is free; or, on a multi-slot engine and a
route the backend cannot place in a given slot (``Engine.pinned_routes``), every slot,
since the engine chooses. Such a request is recorded in the slot the engine most likely
takes (:func:`slot_for`), then located once it ran (:func:`locate`): the slot whose
last task (``SlotReport.task``) is the newest ran it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from collections.abc import Callable

from strata_serve.engine.base import Engine, EngineUnavailable, SlotReport
from strata_serve.hook_types import EngineError, StrataRequest
from strata_serve.slot_state import SlotRegistry

log = logging.getLogger("strata_serve.service")


@dataclass(frozen=True)
class Claim:
    """What a holder of the FIFO asks for.

    ``key``: the conversation (tenant-qualified) it runs; two claims of one key never
    hold at once. ``slot``: one slot by number (a slot action by hand, a save while
    that slot is idle). ``exclusive``: every slot (work that needs the engine to
    itself: ``on_shutdown``, plugins' work while the service is idle, a request the
    engine places itself).
    """

    key: str | None = None
    slot: int | None = None
    exclusive: bool = False


#: Chooses the slot for a claim among the free ones (None: wait). See :func:`choose_slot`.
SlotChooser = Callable[[Claim, list[int]], "int | None"]


def claim_for(request: StrataRequest, engine: Engine, slots: int, *, one_at_a_time: bool = False) -> Claim:
    """How ``request`` claims the FIFO of an engine running ``slots`` slots.

    Every slot, for a request relayed to an engine path the backend cannot place in a
    given slot (then ``request.pinned`` is set False), and for every request with
    ``one_at_a_time`` (the side lane: its two slots share one pool, and the room a side
    request may take is what the idle main slot leaves); otherwise its conversation's.
    """
    pinned: frozenset[str] = getattr(engine, "pinned_routes", frozenset())
    if slots > 1 and (request.api is None or request.api.engine_path not in pinned):
        request.pinned = False
        return Claim(exclusive=True)
    if one_at_a_time:
        return Claim(key=request.conversation_key, exclusive=True)
    return Claim(key=request.conversation_key)


def choose_slot(slots: SlotRegistry, claim: Claim, free: list[int]) -> int | None:
    """The slot a request runs in, among the ``free`` ones (None: wait for another).

    The slot that holds its conversation, when one does (and if it is busy, the
    request waits for it: a conversation is never in two slots). Otherwise the free
    slot whose state is the least valuable: an empty one, then one holding nothing
    nameable, then one whose conversation's file is current (displacing it costs
    nothing), then the least recently used. A plugin parks the displaced
    conversation in ``pre_request``.
    """
    if claim.key is not None:
        for state in slots:
            if state.key == claim.key and not state.empty:
                return state.id if state.id in free else None

    def cost(slot: int) -> tuple[int, int]:
        state = slots[slot]
        if state.empty:
            return (0, 0)
        if state.key is None:
            return (1, 0)
        if state.file_current:
            return (2, state.last_request or 0)
        return (3, state.last_request or 0)

    return min(free, key=cost)


def slot_for(slots: SlotRegistry, request: StrataRequest, granted: int) -> int:
    """The slot to record ``request`` in, granted ``granted`` by the FIFO.

    -1 (every slot: the engine will choose) is the slot the engine most likely takes:
    the one holding the conversation, else the cheapest to displace, as here.
    """
    if granted != -1:
        return granted
    slot = choose_slot(slots, Claim(key=request.conversation_key), list(range(len(slots))))
    assert slot is not None
    return slot


async def last_tasks(engine: Engine, count: int) -> dict[int, int] | None:
    """Each slot's last task, as the engine says; None if it cannot."""
    try:
        answer = await engine.slots()
    except (EngineError, EngineUnavailable) as exc:
        log.info("[strata] could not ask the engine what its slots last ran: %s", exc)
        return None
    return _tasks(answer, count)


async def locate(engine: Engine, slots: SlotRegistry, request: StrataRequest,
                 tasks_before: dict[int, int] | None) -> None:
    """Which slots the engine used for a request it was not told where to run.

    The slot whose last task is the newest (``SlotReport.task``) ran it; the registry moves
    the request's record there (and ``request.slot`` with it). The slot chosen
    beforehand keeps its tokens with no name: a conversation is never recorded in two
    slots. A request the engine split into several tasks (embeddings of several
    inputs) ran in several slots: every other slot whose last task changed holds
    nothing nameable any more. When the tasks before are not known, no other slot's
    name can be trusted.
    """
    actions = slots.actions()
    try:
        answer = await engine.slots()
    except (EngineError, EngineUnavailable) as exc:
        log.info("[strata] could not ask the engine which slot ran request %d: %s", request.id, exc)
        for slot in range(len(slots)):
            slots.unknown(slot, nameable=False)
        return
    tasks = _tasks(answer, len(slots))
    if tasks:
        ran = max(tasks, key=lambda slot: tasks[slot])
        if ran != request.slot:
            slots.moved(request.slot, ran)
            request.slot = ran
        for slot in range(len(slots)):
            touched = tasks_before is None or tasks.get(slot) != tasks_before.get(slot)
            if slot != ran and touched and slots[slot].key is not None:
                log.info("[strata] slot %d ran part of request %d: it no longer holds %s",
                         slot, request.id, slots[slot].key)
                slots.unknown(slot, nameable=False)
    slots.adopt_engine_counts(answer, actions)


def _tasks(reports: list[SlotReport], count: int) -> dict[int, int]:
    """slot -> its last task's number, from the engine's slot reports."""
    return {r.id: r.task for r in reports if r.task is not None and 0 <= r.id < count}
