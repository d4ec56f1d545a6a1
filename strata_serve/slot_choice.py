"""Which slot a request runs in, on an engine whose slots are equal.

A request claims the FIFO (:func:`claim_for`): for its conversation, placed by
:func:`choose_slot` once a slot it may use is free; or, on a multi-slot engine and a
route the backend cannot place in a given slot (``Engine.pinned_routes``), every slot,
since the engine chooses. Such a request is recorded in the slot the engine most likely
takes (:func:`slot_for`), then located once it ran (:func:`locate`): the slot whose
last task (``SlotReport.task``) is the newest ran it.

Everything here answers; nothing writes. The service records what the answers say: the
request's placement (``request.slot``, ``request.pinned``) and the registry of slots
(:mod:`strata_serve.slot_state`). With a side lane the slot is chosen in
:mod:`strata_serve.side_lane` instead; the FIFO (``ServiceFIFO``) only grants the claim.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from collections.abc import Callable

from strata_serve.engine.base import Engine, EngineUnavailable, SlotReport
from strata_serve.engine.results import EngineError
from strata_serve.hook_types import StrataRequest
from strata_serve.slot_state import Located, SlotRegistry

log = logging.getLogger("strata_serve.service")


@dataclass(frozen=True)
class Claim:
    """What a holder of the FIFO asks for.

    ``key``: the conversation (tenant-qualified) it runs; two claims of one key never
    hold at once. ``slot``: one slot by number (a slot action by hand, a save while
    that slot is idle). ``exclusive``: every slot (work that needs the engine to
    itself: ``on_shutdown``, plugins' work while the service is idle, a request the
    engine places itself). ``pinned``: False when the engine, not the service, places
    the request (the service records it on the request).
    """

    key: str | None = None
    slot: int | None = None
    exclusive: bool = False
    pinned: bool = True


#: Chooses the slot for a claim among the free ones (None: wait). See :func:`choose_slot`.
SlotChooser = Callable[[Claim, list[int]], "int | None"]


def claim_for(request: StrataRequest, engine: Engine, slots: int, *, one_at_a_time: bool = False) -> Claim:
    """How ``request`` claims the FIFO of an engine running ``slots`` slots.

    Every slot, for a request relayed to an engine path the backend cannot place in a
    given slot (``pinned`` False in the claim: the engine places it), and for every request
    with ``one_at_a_time`` (the side lane: its two slots share one pool, and the room a side
    request may take is what the idle main slot leaves); otherwise its conversation's.
    """
    pinned: frozenset[str] = getattr(engine, "pinned_routes", frozenset())
    if slots > 1 and (request.api is None or request.api.engine_path not in pinned):
        return Claim(exclusive=True, pinned=False)
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


async def locate(engine: Engine, slots: SlotRegistry, tasks_before: dict[int, int] | None) -> Located:
    """Which slots the engine used for a request it was not told where to run.

    The slot whose last task is the newest (``SlotReport.task``) ran it. A request the
    engine split into several tasks (embeddings of several inputs) ran in several slots:
    every other slot whose last task changed ran part of it. When the tasks before are not
    known, every other slot may have. The service records the answer
    (:meth:`~strata_serve.slot_state.SlotRegistry.located`).
    """
    actions = slots.actions()
    try:
        answer = await engine.slots()
    except (EngineError, EngineUnavailable) as exc:
        log.info("[strata] could not ask the engine which slot ran a request: %s", exc)
        return Located(reports=None, actions=actions)
    tasks = _tasks(answer, len(slots))
    if not tasks:
        return Located(reports=answer, actions=actions)
    ran = max(tasks, key=lambda slot: tasks[slot])
    touched = frozenset(slot for slot in range(len(slots))
                        if slot != ran and (tasks_before is None or tasks.get(slot) != tasks_before.get(slot)))
    return Located(reports=answer, actions=actions, ran=ran, touched=touched)


def _tasks(reports: list[SlotReport], count: int) -> dict[int, int]:
    """slot -> its last task's number, from the engine's slot reports."""
    return {r.id: r.task for r in reports if r.task is not None and 0 <= r.id < count}
