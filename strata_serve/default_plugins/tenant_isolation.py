"""Strict tenant isolation: no request reuses state another tenant left in the slot.

With ``server.tenant_isolation = "strict"``, before a request of tenant T reaches the
engine, a slot holding another tenant's state is erased. It runs ``trylast``, after
auto-sessions has parked the outgoing conversation (and perhaps restored T's own), so
nothing is lost that a switch would not lose anyway. The rest of strict mode is the
core's: the engine's RAM prompt cache off and a single slot (``config.py``), and the
server-wide ``/slots``, ``/stats`` and ``/metrics`` kept to the plain ``server.api_key``.

Whose state the slot holds is read from the core's picture of the slots
(``service.slots[0]``) when there is one; otherwise this plugin keeps track itself,
from the requests it sees.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import strata_serve
from strata_serve.engine.base import EngineUnavailable
from strata_serve.exchange import EngineError, Outcome, StrataRequest
from strata_serve.service import tenant_of_key

log = logging.getLogger("strata_serve.tenant_isolation")

NAME = "tenant_isolation"
#: auto-sessions' note on a request whose conversation it restored from disk (tracking
#: without the core's picture only).
AUTO_SESSIONS = "auto_sessions"


@dataclass
class Holder:
    """Whose state the slot holds, as far as this plugin saw (without the core's picture)."""

    #: True when the slot holds nothing (start, restart, after an erase).
    empty: bool = True
    tenant: str | None = None
    generation: int | None = None


def _strict(service: Any) -> bool:
    return service.settings.server.tenant_isolation == "strict"


def _picture(service: Any) -> Any:
    slots = getattr(service, "slots", None)
    return slots[0] if slots else None


def _holder(service: Any) -> Holder:
    holder = service.state.setdefault(NAME, Holder())
    if holder.generation != service.engine.generation:  # a (re)started engine holds nothing
        holder.empty, holder.tenant, holder.generation = True, None, service.engine.generation
    return holder


def holds_another_tenant(request: StrataRequest, service: Any) -> bool:
    """Whether the slot may hold state of a tenant other than ``request.tenant``."""
    slot = _picture(service)
    if slot is not None:
        if not slot.tokens:
            return False
        # The key names its tenant's namespace; a keyless state belongs to whoever ran it.
        owner = tenant_of_key(slot.key) if slot.key is not None else slot.tenant
        return owner != request.tenant
    holder = _holder(service)
    if request.state.get(AUTO_SESSIONS, {}).get("restored_tokens"):
        # auto-sessions just restored this request's own conversation over the slot.
        holder.empty, holder.tenant = False, request.tenant
    return not holder.empty and holder.tenant != request.tenant


@strata_serve.hookimpl
def on_startup(service):
    if not _strict(service):
        return
    settings = service.settings
    if not settings.server.api_keys:
        log.warning("[strata] tenant isolation: strict, but no named keys (server.api_keys): "
                    "every request is the same tenant, there is nothing to keep apart")
    else:
        log.info("[strata] tenant isolation: strict: the slot is erased when another tenant's request "
                 "comes; the engine's RAM cache is off")


@strata_serve.hookimpl(trylast=True)
async def pre_request(request: StrataRequest, service: Any) -> None:
    if not _strict(service) or not holds_another_tenant(request, service):
        return
    try:
        await service.engine.erase()
    except (EngineError, EngineUnavailable) as exc:
        # The request must not see the other tenant's state: it reuses nothing instead.
        log.error("[strata] tenant isolation: erasing the slot before a request of another tenant "
                  "failed (%s); this request reuses no cached prompt", exc)
        if request.route != "slots":
            request.body["cache_prompt"] = False
        request.state[NAME] = {"erase_failed": True}
        return
    slot = _picture(service)
    if slot is not None:
        slot.record_erase()
    else:
        holder = _holder(service)
        holder.empty, holder.tenant = True, None
    log.debug("[strata] tenant isolation: slot erased before a request of %s",
              request.tenant or "the unnamed tenant")


@strata_serve.hookimpl
def post_request(request: StrataRequest, outcome: Outcome, service: Any) -> None:
    if not _strict(service) or _picture(service) is not None:
        return
    if request.state.get(NAME, {}).get("erase_failed"):
        return  # the other tenant's state may still be there: the next request tries again
    holder = _holder(service)
    if request.route == "slots":
        action = request.body.get("action")
        if action == "erase" and outcome.status == "ok":
            holder.empty, holder.tenant = True, None
        elif action == "restore":
            # Restored (the tenant's own file), or failed part-way: nobody else's either way.
            holder.empty, holder.tenant = outcome.status != "ok", request.tenant
        return
    # Whatever came back (even an error or a cancelled stream), the slot holds nothing
    # but this tenant's state now: another's was erased before.
    holder.empty, holder.tenant = False, request.tenant
