"""Parking a slot: saving the conversation it holds to its file, and what came of it (:class:`Parked`)."""

from __future__ import annotations

import asyncio
import logging
import time
from enum import Enum
from typing import TYPE_CHECKING, Any, NamedTuple

from strata_serve import EngineError, EngineUnavailable, SlotState, Verdict, span

from strata_auto_sessions.config import from_slot, size_text
from strata_auto_sessions.engine_ram import Ident, Left
from strata_auto_sessions.mode import ParkingMode
from strata_auto_sessions.in_use import in_use
from strata_auto_sessions.parts import Parts
from strata_auto_sessions.pruning import prune, prune_siblings, refresh_usage
from strata_auto_sessions.restoring import failure_verdict
from strata_auto_sessions.blocks import SaveReport
from strata_auto_sessions.store import SIDECAR_VERSION, LockTimeout, SessionStore, Sidecar

if TYPE_CHECKING:
    from strata_serve import Service

log = logging.getLogger("strata_auto_sessions")


class Parked(Enum):
    """What :func:`park_slot` did with the conversation a slot holds."""

    #: Saved to its file now.
    SAVED = "saved"
    #: Its file already held what the slot holds.
    ALREADY_CURRENT = "already current"
    #: Nothing to keep: the slot is empty or holds nothing nameable, the conversation is
    #: not worth a file (or no state of this engine is), it was removed by hand, or the
    #: engine's quirks call what it held provisional.
    NOTHING_TO_KEEP = "nothing to keep"
    #: Not saved (the save failed, or the engine's quirks declined it): the state is in
    #: the slot and nowhere else, and a restore over it would lose it.
    ONLY_IN_SLOT = "only in slot"

    @property
    def on_file(self) -> bool:
        """Whether the conversation's file holds what the slot holds."""
        return self in (Parked.SAVED, Parked.ALREADY_CURRENT)


class _Saved(NamedTuple):
    tokens: int
    bytes: int
    ms: float
    #: What the save did in the block store (None: a whole file, or no blocks).
    blocks: SaveReport | None = None


async def park_slot(parts: Parts, service: Service, slot: int = 0, *, reason: str,
                    incoming: str | None = None, incoming_sibling: int | None = None) -> Parked:
    """Save the conversation the slot holds to its file, if it is worth it and not current.

    ``incoming`` names the conversation about to be restored (``incoming_sibling``, its
    file, when it is of the same key): pruning spares its file.
    """
    assert parts.store is not None
    in_slot = await service.slot(slot)
    key, sibling = in_slot.key, in_slot.sibling
    if key is None or in_slot.empty:
        return Parked.NOTHING_TO_KEEP
    if not in_slot.file_current and parts.saved_states.get(slot) == state_of(in_slot):
        # Nothing reached the slot since its file was made current; only its count was
        # asked again (the side slot's, after each request in the main slot of the side
        # lane: the engine may have emptied it, and the count says it did not).
        service.slots.file_written(slot, key)
    declined = _not_to_save(parts, service, key, in_slot)
    if declined is not None:
        if declined is Parked.ALREADY_CURRENT:
            parts.saved_states[slot] = state_of(in_slot)
        return declined
    saved = await _save(parts, service, slot, key, in_slot)
    if isinstance(saved, Parked):
        return saved
    service.slots.file_written(slot, key)
    parts.saved_states[slot] = state_of(service.slots[slot])
    if parts.uploads is not None:
        parts.uploads.saved(parts.store.bin_name(key, sibling))  # uploaded in the background
    in_blocks = _counted(parts, saved)
    log.info("[strata] auto sessions: saved %s tokens (%s) to %s%s in %.0f ms%s%s",
             f"{saved.tokens:,}", size_text(saved.bytes), parts.store.bin_name(key, sibling),
             in_blocks, saved.ms, "" if reason == "switch" else f" ({reason})", from_slot(service, slot))
    spare = {sibling} | ({incoming_sibling} if incoming == key and incoming_sibling is not None else set())
    with span("auto_sessions.prune"):
        await prune_siblings(parts, key, frozenset(spare))
        await prune(parts.store, parts.config, parts.stats, protect=in_use(service, key, incoming),
                    index=parts.siblings)
    return Parked.SAVED


def _count_blocks(parts: Parts, report: SaveReport | None) -> str:
    """What a save committed did in the block store (``blocks = true``), counted; for its
    log line: where it went when in blocks."""
    if report is None:
        return ""
    if report.refused is not None:
        parts.stats.count_kept_whole(report.refused.reason)
        return f" (whole: {report.refused.reason})"
    parts.stats.block_saves += 1
    parts.stats.block_written_bytes += report.bytes_written
    parts.stats.block_state_bytes += report.state_bytes
    return (f" in blocks ({report.blocks_written} of {report.blocks} new, {size_text(report.bytes_written)} "
            "written)")


def state_of(in_slot: SlotState) -> tuple[Any, ...]:
    """What tells one state of a slot from another without asking the engine: its
    conversation, the last request it ran, when it began holding it (a restore), its
    count and the engine process. Equal: the same tokens in the slot."""
    return (in_slot.key, in_slot.tenant, in_slot.sibling, in_slot.tokens, in_slot.last_request, in_slot.since,
            in_slot.generation)


def _not_to_save(parts: Parts, service: Service, key: str, in_slot: SlotState) -> Parked | None:
    """Why the conversation ``key`` the slot holds is not saved now (counted, and logged
    where it is news), or None when it is to be saved."""
    if in_slot.file_current:
        if _file_kept(parts, key, in_slot.sibling):
            parts.stats.save_skips_unchanged += 1
            _touch_if_used(parts, key, in_slot.sibling)
            return Parked.ALREADY_CURRENT
        # Its file went since it was made (`strata-serve sessions prune`, or by hand):
        # the slot holds the only copy, so it is saved like any other.
        log.info("[strata] auto sessions: %s's file is gone since it was saved: saving it again", key)
        service.slots.file_gone(in_slot.id)
    if parts.mode is ParkingMode.NOT_SAVING:
        parts.stats.save_skips_swa += 1  # said once, at start: no file would be of use
        return Parked.NOTHING_TO_KEEP
    worth, why_not = parts.costs.worth(in_slot.tokens)
    if not worth:
        parts.stats.save_skips_below_min += 1
        log.info("[strata] auto sessions: not saving %s: %s", key, why_not)
        return Parked.NOTHING_TO_KEEP
    verdict = service.verdict("save", None, in_slot.tokens)
    if verdict in (Verdict.SKIP, Verdict.UNSUPPORTED):
        parts.stats.save_skips_verdict += 1
        log.info("[strata] auto sessions: not saving %s: the engine quirk check says %s", key, verdict.value)
        if verdict == Verdict.UNSUPPORTED:
            parts.status.stop("the engine cannot save slots")
        # Unsaved state must not be replaced by a restore unless there is none.
        return Parked.NOTHING_TO_KEEP if in_slot.tokens == 0 else Parked.ONLY_IN_SLOT
    return None


async def save_from_engine_ram(parts: Parts, service: Service, slot: int, ident: Ident, left: Left,
                               timeout: float) -> bool:
    """At a normal stop: a conversation left in the engine's RAM cache
    (:mod:`strata_auto_sessions.engine_ram`) brought back into ``slot`` by its last request
    sent again for one token (the engine loads it from RAM), then saved. False when not saved."""
    tenant, key, sibling = ident
    body = left.replay()
    worth, _ = parts.costs.worth(left.tokens)
    if body is None or left.path is None or not worth:
        return False
    try:
        async with asyncio.timeout(timeout):
            status, answer = await service.engine.request("POST", left.path, json=body, op="completion",
                                                          resend=False)
    except (TimeoutError, EngineError, EngineUnavailable) as exc:
        log.warning("[strata] auto sessions: %s, left to the engine's RAM cache, could not be brought back to be "
                    "saved: %s", key, exc or "no answer in time")
        return False
    if status != 200:
        log.warning("[strata] auto sessions: %s, left to the engine's RAM cache, could not be brought back to be "
                    "saved: the engine answered %d", key, status)
        return False
    if left.prompt is not None:
        parts.prompts.restored(key, left.prompt)
    in_slot = SlotState(id=slot, key=key, tenant=tenant, tokens=left.tokens, since=left.since, sibling=sibling)
    saved = await _save(parts, service, slot, key, in_slot)
    if isinstance(saved, Parked):
        return False
    in_blocks = _counted(parts, saved)
    log.info("[strata] auto sessions: saved %s tokens (%s) to %s%s in %.0f ms (brought back from the engine's RAM "
             "cache at the stop)", f"{saved.tokens:,}", size_text(saved.bytes),
             parts.store.bin_name(key, sibling), in_blocks, saved.ms)  # type: ignore[union-attr]
    return True


async def measure_state(parts: Parts, service: Service, slot: int, key: str) -> None:
    """Have the engine save the slot once, only to learn how many bytes a token of its state
    takes (the core's ``service.measures``), and remove the file: for a conversation not
    worth a file of its own, when no state has been saved yet. The switches left to the
    engine's RAM cache need that size to keep within the cache's room."""
    assert parts.store is not None
    temp = parts.store.temp_name(key)
    try:
        await service.save_slot(temp, slot=slot)
    except (EngineError, EngineUnavailable, OSError) as exc:
        log.info("[strata] auto sessions: the engine's state could not be measured (%s): its switches are parked "
                 "to disk until a state is", exc)
    finally:
        _discard(parts, temp)


def _counted(parts: Parts, saved: _Saved) -> str:
    """A save made: its fsyncs started (beside the next request, with ``fsync = "background"``)
    and it counted; for its log line, where it went when in blocks."""
    parts.syncs.soon()
    parts.stats.saves += 1
    parts.stats.saved_tokens += saved.tokens
    parts.stats.saved_bytes += saved.bytes
    parts.stats.save_ms += saved.ms
    return _count_blocks(parts, saved.blocks)


async def _save(parts: Parts, service: Service, slot: int, key: str, in_slot: SlotState) -> _Saved | Parked:
    """Have the engine save the slot to a temporary file (once more after a failure its
    quirks call passing), then commit it as ``key``'s file with its sidecar."""
    assert parts.store is not None
    sidecar, prompt = parts.store.sidecar(key, in_slot.sibling), parts.prompts.get(key)
    for attempt in range(2):
        temp = parts.store.temp_name(key)
        began = time.monotonic()
        try:
            answer = await service.save_slot(temp, slot=slot)
            n_saved, n_written = answer.tokens, answer.bytes
            if n_saved == 0:
                # The slot was empty after all: such a file is worthless, and
                # restoring one has crashed the engine.
                _discard(parts, temp)
                log.info("[strata] auto sessions: not keeping %s: the engine's slot was empty", key)
                return Parked.NOTHING_TO_KEEP
            kept, report = await _commit(parts, temp, key, in_slot, sidecar, prompt, n_saved, n_written)
            break
        except LockTimeout as exc:  # the commit's: the engine's calls take no lock
            _discard(parts, temp)
            parts.stats.save_failures += 1
            log.warning("[strata] auto sessions: saving %s given up: %s; it stays in the slot", key, exc)
            return Parked.ONLY_IN_SLOT
        except (EngineError, EngineUnavailable, OSError) as exc:
            staging = parts.staging
            if staging is not None and not isinstance(exc, OSError):
                # The engine's save into memory failed: the next try goes to the slot
                # directory. (An OSError is the commit's: the slot directory's disk.)
                staging.failed(parts.store.directory / temp, exc)
            _discard(parts, temp)
            verdict = failure_verdict("save", exc, service, in_slot.tokens)
            if verdict == Verdict.RETRY and attempt == 0:
                log.info("[strata] auto sessions: saving %s failed (%s); trying once more", key, exc)
                continue
            return _save_failed(parts, key, exc, verdict, service, slot)
    ms = (time.monotonic() - began) * 1000
    if kept is False:
        await _removed_by_hand(parts, key, slot, service)
        return Parked.NOTHING_TO_KEEP
    return _Saved(n_saved, n_written, ms, report)


async def _commit(parts: Parts, temp: str, key: str, in_slot: SlotState, sidecar: Sidecar | None,
                  prompt: dict[str, Any] | None, n_saved: int,
                  n_written: int) -> tuple[bool | None, SaveReport | None]:
    """Put the saved ``temp`` in place as ``key``'s file, beside its new sidecar (under the
    directory's lock): False when ``key`` was removed by hand since its state began; with
    what it did in the block store, when in blocks."""
    assert parts.store is not None
    now = time.time()
    written = Sidecar(
        key=key, fingerprint=parts.fingerprint, tokens=n_saved, bytes=n_written,
        # A file's state began with its first file; a state with none, when the
        # slot began holding it: a removal by hand since then drops the save.
        created=sidecar.created if sidecar else (in_slot.since or now), last_used=now,
        digest="", prompt=prompt, tenant=in_slot.tenant, version=SIDECAR_VERSION, sibling=in_slot.sibling,
    )
    blocks = parts.blocks
    if blocks is not None:
        blocks.take_report(key, in_slot.sibling)  # an earlier one, whose save failed after the cut
    with span("auto_sessions.commit"):
        async with parts.store.lock_without_blocking(parts.config.lock_wait_s):
            if isinstance(parts.store, SessionStore):
                # In a thread: cutting a state and writing its new blocks takes time (a
                # first save of a long context, seconds), and the event loop serves the
                # other requests' answers, health checks and metrics meanwhile. The
                # directory's lock is shared with the thread, the block store locks its
                # own, and a prune meanwhile leaves this conversation alone. (A store of
                # a plugin's is called on the loop, as ever: its protocol says nothing of
                # threads.)
                kept: bool | None = await asyncio.to_thread(parts.store.commit, temp, key, written)
            else:
                kept = parts.store.commit(temp, key, written)
    if kept is not False:
        parts.siblings.written(key, written)
        parts.restored.written(key, in_slot.sibling)  # its last use: now
    return kept, None if blocks is None else blocks.take_report(key, in_slot.sibling)


def _touch_if_used(parts: Parts, key: str, sibling: int) -> None:
    """The file goes back to disk unchanged: if it was restored since its sidecar was
    written, the sidecar now says it was used (pruning goes by it)."""
    if not parts.restored.take(key, sibling):
        return
    try:
        with span("auto_sessions.touch"):
            parts.store.touch(key, sibling)  # type: ignore[union-attr]
    except OSError as exc:
        log.warning("[strata] auto sessions: could not update %s's sidecar: %s", key, exc)


def _file_kept(parts: Parts, key: str, sibling: int) -> bool:
    """Whether the store still has the conversation's file (its sidecar describes it)."""
    try:
        return parts.store.sidecar(key, sibling) is not None  # type: ignore[union-attr]
    except OSError:
        return False


async def _removed_by_hand(parts: Parts, key: str, slot: int, service: Service) -> None:
    """The session was removed by hand (``strata-serve sessions rm``) while the slot held
    it: its save was dropped, and the slot is erased so the engine forgets it too."""
    parts.prompts.forget(key)
    parts.siblings.forget(key)
    log.info("[strata] auto sessions: %s was removed by hand: its save is dropped and the slot erased", key)
    try:
        await service.erase_slot(slot)
    except (EngineError, EngineUnavailable) as exc:
        log.warning("[strata] auto sessions: erasing the slot after %s was removed failed: %s", key, exc)
    refresh_usage(parts.store, parts.stats)  # type: ignore[arg-type]
    parts.in_use.record(service)


def _discard(parts: Parts, temp: str) -> None:
    try:
        parts.store.discard(temp)  # type: ignore[union-attr]
    except OSError as exc:  # e.g. the directory itself is gone
        log.warning("[strata] auto sessions: could not remove %s: %s", temp, exc)


def _save_failed(parts: Parts, key: str, exc: Exception, verdict: Verdict | None, service: Service,
                 slot: int) -> Parked:
    parts.stats.save_failures += 1
    message = exc.message if isinstance(exc, EngineError) else str(exc)
    if verdict == Verdict.PROVISIONAL:
        log.info("[strata] auto sessions: %s held only provisional state (%s); "
                 "restoring over it is safe", key, message)
        service.slots.nothing_durable(slot)
        return Parked.NOTHING_TO_KEEP
    if verdict == Verdict.UNSUPPORTED:
        parts.status.stop(f"the engine cannot save slots ({message})")
    log.warning("[strata] auto sessions: saving %s failed: %s", key, exc)
    return Parked.ONLY_IN_SLOT
