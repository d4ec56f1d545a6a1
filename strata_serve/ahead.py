"""A request sent to the engine ahead of its turn: when it needs no switch, it need not wait
for the answer before it to end.

On an engine that runs one request at a time, the FIFO gives the next request its turn
once the answer before it has ended and that request's ``post_request`` has run; the
engine stands idle meanwhile, and for the next request's own ``pre_request`` and its
sending. The engine alone has the next request queued already. When the next request
needs nothing done to the slot first (its conversation is the one the slot holds, or
nothing is to be saved or restored around it), every plugin that acts around requests
says so (the ``may_go_ahead`` hook) and the service sends it at once: the engine runs it
right after the answer before it. It keeps its place in the FIFO, its turn comes as
before, and its ``pre_request`` and ``post_request`` run in that turn, in order.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import pluggy

from strata_serve.hook_calls import call_each_sync
from strata_serve.hook_types import Outcome, StrataRequest
from strata_serve.slot_state import SlotState

if TYPE_CHECKING:
    from typing import Any

#: The hooks whose implementations act around a request: each of their plugins must agree.
ACTING_HOOKS = ("pre_request", "post_request")


@dataclass
class InLine:
    """A request waiting for its turn on an engine that runs one request at a time: the
    request at the engine sends it ahead once that answer has begun (its ``ahead``), when
    it needs no switch; ``closed`` once its turn came or its client left."""

    request: StrataRequest
    send: Callable[[Outcome], Awaitable[None]]
    place: asyncio.Future[int]
    ahead: Ahead | None = None
    closed: bool = False


@dataclass
class Ahead:
    """A request sent ahead of its turn: the outcome its send fills in, the send itself,
    and its place in the FIFO's line (taken when it was sent)."""

    outcome: Outcome
    task: asyncio.Future[None]
    place: asyncio.Future[int]


def may_go_ahead(pm: pluggy.PluginManager, request: StrataRequest, held: SlotState, service: Any) -> bool:
    """Whether every plugin implementing ``pre_request`` or ``post_request`` answers True to
    ``may_go_ahead`` for ``request`` (one that does not implement it, or fails in it, is a no)."""
    acting = {impl.plugin_name for hook in ACTING_HOOKS for impl in getattr(pm.hook, hook).get_hookimpls()}
    if not acting:
        return True
    agreed = {name for name, answer in call_each_sync(pm, "may_go_ahead", request=request, held=held,
                                                      service=service) if answer is True}
    return acting <= agreed
