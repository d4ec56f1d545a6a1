"""Strict tenant isolation: no request reuses state another tenant left in the slot.

With ``server.tenant_isolation = "strict"``, before a request of tenant T reaches the
engine, or T's slot action by hand, a slot holding another tenant's state is erased. It runs ``trylast``, after
auto-sessions has parked the outgoing conversation (and perhaps restored T's own, which
the core's picture then names as T's and is kept), so nothing is lost that a switch
would not lose anyway. The rest of strict mode is the core's: the engine's RAM prompt
cache off and a single slot (``config.py``), and the server-wide ``/slots``, ``/stats``
and ``/metrics`` kept to the plain ``server.api_key``.
"""

from __future__ import annotations

import logging

import strata_serve
from strata_serve.engine.base import EngineUnavailable
from strata_serve.hook_types import EngineError, StrataRequest
from strata_serve.service import Service

log = logging.getLogger("strata_serve.tenant_isolation")


def _strict(service: Service) -> bool:
    return service.settings.server.tenant_isolation == "strict"


@strata_serve.hookimpl
def on_startup(service):
    if not _strict(service):
        return
    if not service.settings.server.api_keys:
        log.warning("[strata] tenant isolation: strict, but no named keys (server.api_keys): "
                    "every request is the same tenant, there is nothing to keep apart")
    else:
        log.info("[strata] tenant isolation: strict: the slot is erased when another tenant's request "
                 "comes; the engine's RAM cache is off")


@strata_serve.hookimpl(trylast=True)
async def pre_request(request: StrataRequest, service: Service) -> None:
    if not _strict(service):
        return
    failed = await _erase_others(service, request.slot, request.tenant)
    if failed is not None:
        # The request must not see the other tenant's state: it reuses nothing instead.
        log.error("[strata] tenant isolation: erasing the slot before a request of another tenant "
                  "failed (%s); this request reuses no cached prompt", failed)
        request.body["cache_prompt"] = False


@strata_serve.hookimpl
def may_go_ahead(service: Service) -> bool:
    # Only strict isolation acts on the slot before a request.
    return not _strict(service)


@strata_serve.hookimpl(trylast=True)
async def pre_slot_action(slot: int, tenant: str | None, service: Service) -> None:
    # A save by hand must not write another tenant's state into the caller's file.
    if not _strict(service):
        return
    failed = await _erase_others(service, slot, tenant)
    if failed is not None:
        log.error("[strata] tenant isolation: erasing the slot before a slot action of another tenant "
                  "failed (%s)", failed)


async def _erase_others(service: Service, slot: int, tenant: str | None) -> Exception | None:
    """Erase ``slot`` unless it holds only ``tenant``'s state (or nothing); the failure, if any."""
    # The core's picture, checked against the engine when it is not sure; a slot whose
    # count is still unknown may hold something, so only an empty one is left as is.
    held = await service.slot(slot)
    # An attached engine may run more slots than strata-serve sends to (llama-server's
    # default is 4) and picks one by its contents: every one of them is erased whenever
    # the tenant changes, so all they hold is ever the last tenant's.
    unseen = range(len(service.slots), service.engine.info.parallel)
    if held.tenant == tenant and not (held.empty and unseen):
        return None
    if held.empty and not unseen:
        return None
    try:
        await service.erase_slot(slot)
        for other in unseen:
            await service.engine.erase(other)
    except (EngineError, EngineUnavailable) as exc:
        return exc
    log.debug("[strata] tenant isolation: slot erased before a request of %s", tenant or "the unnamed tenant")
    return None
