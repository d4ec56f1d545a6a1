"""A fallback for a conversation without a file: start it from another one's, chosen by
a plugin (``auto_sessions_fallback``)."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from strata_serve import StrataRequest, first_result, in_tenant, prompt_units

from strata_auto_sessions.config import NAME
from strata_auto_sessions.parts import Parts
from strata_auto_sessions.prefix import ParkedConversation, message_chain
from strata_auto_sessions.store import incompatibility, last_use

if TYPE_CHECKING:
    from strata_serve import Service

log = logging.getLogger("strata_auto_sessions")


def choose(parts: Parts, request: StrataRequest, service: Service) -> tuple[str, int] | None:
    """The parked conversation a plugin chose for ``request``, which has no file, and
    which of its key's files (siblings): same tenant, a file this engine can use, not the
    one the slot holds (the engine reuses that from the slot). None when there is none."""
    assert parts.store is not None
    units = prompt_units(request)
    if isinstance(units, str) or not units:
        return None
    chain = message_chain(request.body, units)
    parked = _offered(parts, request)
    if not parked:
        return None
    chosen = first_result(service.pm, "auto_sessions_fallback", request=request, chain=chain,
                          parked=parked, costs=parts.costs, service=service)
    if chosen is None:
        return None
    offered = [candidate for candidate in parked if candidate.key == chosen]
    if not offered:
        log.warning("[strata] auto sessions: a fallback plugin chose %r, which was not offered; ignored", chosen)
        return None
    # A key of several files (siblings): the one sharing the most with the request, then the newest.
    sibling = max(offered, key=lambda c: (c.shared_links(chain["chain"]), c.last_used)).sibling
    in_slot = service.slots[request.slot]
    if in_slot.key == chosen and not in_slot.empty:
        log.info("[strata] auto sessions: %s starts from %s, which the slot holds: nothing to restore",
                 request.conversation_key, chosen)
        return None
    if not parts.store.stage(chosen, sibling):
        return None
    return chosen, sibling


def _offered(parts: Parts, request: StrataRequest) -> list[ParkedConversation]:
    """The parked conversations a fallback plugin may choose from for ``request``."""
    assert parts.store is not None
    parked: list[ParkedConversation] = []
    try:
        sessions = parts.store.sessions()
    except OSError as exc:
        log.warning("[strata] auto sessions: cannot list %s: %s", parts.store.directory, exc)
        return parked
    now = time.time()
    for other, sidecar in sessions:
        # Tenants never share: a file is another tenant's unless its sidecar names this one
        # (and an unnamed tenant's keys have no tenant prefix).
        if other == request.conversation_key or sidecar.tenant != request.tenant:
            continue
        if not in_tenant(other, request.tenant):
            continue
        prompt = sidecar.prompt or {}
        if not prompt.get("chain") or incompatibility(sidecar, parts.fingerprint,
                                                      build_range=parts.config.build_range):
            continue
        parked.append(ParkedConversation(key=other, tokens=sidecar.tokens, bytes=sidecar.bytes,
                                         last_used=last_use(sidecar.last_used, now=now) or 0.0,
                                         chain=list(prompt["chain"]), sizes=list(prompt.get("sizes") or []),
                                         sibling=sidecar.sibling))
    return parked


def restored_from(parts: Parts, key: str, source: str, request: StrataRequest,
                  n_restored: int, ms: float, sibling: int = 0) -> None:
    """``key``, which has no file, was started from ``source``'s (its ``sibling``): counted and logged."""
    parts.stats.prefix_restores += 1
    parts.stats.prefix_restored_tokens += n_restored
    request.state.setdefault(NAME, {}).update(restore_ms=ms, continues=False, prefix_of=source)
    log.info("[strata] auto sessions: %s has no file; restored %s tokens from %s, whose opening it "
             "shares, in %.0f ms", key, f"{n_restored:,}", parts.store.bin_name(source, sibling),  # type: ignore[union-attr]
             ms)


def reused_from(parts: Parts, request: StrataRequest, restored: int, reused: int) -> None:
    """The request that started from another conversation's file reused ``reused`` of its tokens."""
    parts.stats.prefix_reused_tokens += reused
    log.info("[strata] auto sessions: %s reused %s of the %s tokens restored from %s's file",
             request.conversation_key, f"{reused:,}", f"{restored:,}", request.state[NAME]["prefix_of"])
