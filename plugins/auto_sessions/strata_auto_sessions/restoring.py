"""Restoring a conversation's state into the slot, and whether the next request reused it.

With blocks (``blocks = true``), what comes back is decided by tokens: the request's
prompt, tokenized by the engine, is matched against every stored chain of blocks of its
tenant (:meth:`BlockStore.longest_prefix`); where a chain holds more of the prompt than
the conversation's own state under its key (a sibling's, another session's opening, or
its own after an edit), that chain is restored. Otherwise the conversation named by its
key and sibling comes back, as without blocks.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from strata_serve import (EngineError, EngineUnavailable, Outcome, StateRefusal, StrataRequest, Verdict, api_of,
                          first_result, span)

from strata_auto_sessions import fallback
from strata_auto_sessions.config import NAME, from_slot
from strata_auto_sessions.blocks import Chain, Manifest
from strata_auto_sessions.parked_blocks import CorruptBlock, ParkedBlocks
from strata_auto_sessions.parts import Parts
from strata_auto_sessions.prompts import continues
from strata_auto_sessions.store import LockTimeout, Refusal, Sidecar, incompatibility

if TYPE_CHECKING:
    from strata_serve import Service

    from strata_auto_sessions.siblings import Choice

log = logging.getLogger("strata_auto_sessions")


def failure_verdict(op: str, exc: Exception, service: Service, tokens: int | None) -> Verdict | None:
    """What the engine's quirk plugins say about a failed save or restore."""
    error = exc if isinstance(exc, EngineError) else EngineError(op=op, message=str(exc))
    return service.verdict(op, error, tokens)


async def restore(parts: Parts, key: str, request: StrataRequest, service: Service,
                  choice: Choice | None = None) -> bool:
    """Restore ``key``'s file, its sibling ``choice.source`` (or a fallback's, when it has
    none) into the request's slot.

    :returns: whether a file was restored.
    """
    assert parts.store is not None
    # Locked from the choice of file to the engine's read: `strata-serve sessions rm`
    # never removes a file between the checks and the restore.
    try:
        async with parts.store.lock_without_blocking(parts.config.lock_wait_s):
            return await _restore_locked(parts, key, request, service, choice)
    except LockTimeout as exc:
        log.warning("[strata] auto sessions: not restoring %s: %s; the request is answered by a full "
                    "prefill", key, exc)
        return False


async def _restore_locked(parts: Parts, key: str, request: StrataRequest, service: Service,
                          choice: Choice | None) -> bool:
    chain = await _chain_by_tokens(parts, key, request, service, choice)
    if isinstance(chain, Chain):
        return await _restore_chain(parts, key, request, service, choice, chain)
    with span("auto_sessions.restore_checks"):
        chosen = _file_to_restore(parts, key, request, service, choice)
        if chosen is None:
            return False
        source, sibling, path = chosen  # whose file is restored: the conversation's own, or a fallback's
        sidecar = _restorable(parts, source, sibling, path)
    if sidecar is None:
        return False
    if await _leaves_window(parts, request, service, source, sibling, path, sidecar):
        parts.stats.restores_refused_swa += 1
        log.info("[strata] auto sessions: not restoring %s%s: the prompt leaves its sliding-window state before "
                 "the state's end, and the engine would read on from a window that lacks the cells masked when "
                 "it was saved; the request is answered by a full prefill", path.name,
                 "" if source == key else f" for {key}")
        return False
    if not _engine_restores(parts, request, service):
        return False
    loaded = await _load(parts, key, source, sibling, path, request, service)
    if loaded is None:
        return False
    n_restored, n_read, ms = loaded
    _count_restore(parts, n_restored, n_read, ms)
    if source != key:
        fallback.restored_from(parts, key, source, request, n_restored, ms, sibling)
        return True
    request.state.setdefault(NAME, {}).update(restore_ms=ms, continues=continues(sidecar.prompt, request))
    parts.prompts.restored(key, sidecar.prompt)  # what the slot holds now
    # Its sidecar's last use is written when the conversation leaves the slot (by its next
    # save, or a touch if it goes back unchanged); meanwhile the slot holds it, and
    # pruning spares what a slot holds.
    parts.restored.restored(key, sibling)
    parts.siblings.used(key, sibling)
    if choice is not None and choice.sibling != sibling:
        log.info("[strata] auto sessions: restored %s tokens from %s in %.0f ms%s, whose first %d message(s) "
                 "this conversation shares: its own file will be %s", f"{n_restored:,}", path.name, ms,
                 from_slot(service, request.slot, "into"), choice.shared,
                 parts.store.bin_name(key, choice.sibling))  # type: ignore[union-attr]
        return True
    log.info("[strata] auto sessions: restored %s tokens from %s in %.0f ms%s",
             f"{n_restored:,}", path.name, ms, from_slot(service, request.slot, "into"))
    return True


def _engine_restores(parts: Parts, request: StrataRequest, service: Service) -> bool:
    """Whether the engine's quirk plugins let a restore into the request's slot go ahead
    (one saying the engine cannot restore stops parking)."""
    verdict = service.verdict("restore", None, service.slots[request.slot].tokens)
    if verdict == Verdict.UNSUPPORTED:
        parts.status.stop("the engine cannot restore slots")
    return verdict not in (Verdict.SKIP, Verdict.UNSUPPORTED)


def _count_restore(parts: Parts, tokens: int, n_read: int, ms: float) -> None:
    parts.stats.restores += 1
    parts.stats.restored_tokens += tokens
    parts.stats.restored_bytes += n_read
    parts.stats.restore_ms += ms


async def _chain_by_tokens(parts: Parts, key: str, request: StrataRequest, service: Service,
                           choice: Choice | None) -> Chain | None:
    """With blocks: the stored chain that holds the most of the request's prompt, when it
    holds more than the conversation's own state (``choice.source``) and more than the slot
    holds already, and is worth a restore (:meth:`~strata_auto_sessions.policy.Costs.worth`); None: restore as named.
    An own sliding-window state the prompt leaves more than a token before its end counts
    as holding none of it (:func:`_leaves_window`).

    A conversation kept as a whole file, a prompt the engine cannot tokenize alone (media,
    an API it does not render), and a failed tokenizing all leave the choice to the key.
    """
    store, blocks = parts.store, parts.blocks
    api = api_of(request)
    if blocks is None or "tokens" not in service.engine.capabilities or api is None or not api.engine_path:
        return None
    sibling = None if choice is None else choice.source
    if sibling is not None and store.restorable(key, sibling):  # type: ignore[union-attr]
        return None  # its whole file: restored as it is
    in_slot = service.slots[request.slot]
    if sibling is not None and in_slot.key == key and in_slot.sibling == sibling and not in_slot.empty:
        return None  # the slot holds it: the engine reuses it from there
    try:
        with span("auto_sessions.tokenize"):
            tokens = await service.prompt_tokens(request)  # asked ahead as it arrived, mostly
    except (EngineError, EngineUnavailable) as exc:
        log.debug("[strata] auto sessions: the prompt of request %d was not tokenized (%s): restoring by "
                  "its key", request.id, exc)
        return None
    if not tokens:
        return None
    with span("auto_sessions.longest_prefix"):
        chain = await asyncio.to_thread(blocks.longest_prefix, request.tenant, tokens)
        own = await asyncio.to_thread(_own_match, blocks, key, sibling, tokens) if sibling is not None else 0
        # What the slot holds already (the conversation just parked from it), which the
        # engine reuses without a restore.
        kept = 0
        if in_slot.key is not None and not in_slot.empty and in_slot.file_current and in_slot.tenant == request.tenant:
            kept = await asyncio.to_thread(blocks.matched, in_slot.key, in_slot.sibling, tokens)
    if chain is None or chain.tokens <= max(own, kept):
        return None
    worth, _why = parts.costs.worth(chain.tokens)
    return chain if worth else None


def _own_match(blocks: ParkedBlocks, key: str, sibling: int, tokens: list[int]) -> int:
    """How many of ``tokens`` the conversation's own state holds: 0 when it may not be
    restored (:func:`_leaves_window`)."""
    matched = blocks.matched(key, sibling, tokens)
    return 0 if _window_left(blocks.manifest(key, sibling), matched) else matched


def _window_left(manifest: Manifest | None, matched: int) -> bool:
    """Whether a state in blocks is a sliding-window one (``manifest.window``) that a
    prompt it holds ``matched`` tokens of leaves more than a token before its end."""
    return manifest is not None and manifest.window is not None and matched < manifest.tokens - 1


async def _leaves_window(parts: Parts, request: StrataRequest, service: Service, source: str, sibling: int,
                         path: Path, sidecar: Sidecar) -> bool:
    """Whether ``source``'s state, about to be restored whole, is a sliding-window state
    (``--swa-full``) the request's prompt leaves more than a token before its end.

    Such a state holds its sliding layers' cells for the window before its end only. The
    engine, with ``--swa-full``, takes a restored window as complete and reads the prompt
    on from where it leaves the state: the window then lacks the cells masked when the
    state was saved, and the answer changes (docs/state-blocks.md, "A sliding-window
    model's window"). So it is not restored: not the conversation's own (a regenerate),
    whole file or blocks, and not another's a fallback chose. A prompt whose tokens are
    not known (media, an API the engine does not render, a failed tokenizing) is not judged.
    """
    fp = sidecar.fingerprint
    if not fp.get("sliding_window") or not (fp.get("layout") or {}).get("swa_full"):
        return False  # no window (a window kept alone is never saved: see saving)
    try:
        tokens = await service.prompt_tokens(request)  # asked once a request: the same answer as by blocks
    except (EngineError, EngineUnavailable):
        return False
    if not tokens:
        return False
    with span("auto_sessions.window_check"):
        return await asyncio.to_thread(_state_leaves_window, parts, service, source, sibling, path, tokens)


def _state_leaves_window(parts: Parts, service: Service, source: str, sibling: int, path: Path,
                         tokens: list[int]) -> bool:
    store, blocks = parts.store, parts.blocks
    assert store is not None
    if blocks is not None and not store.restorable(source, sibling):  # type: ignore[attr-defined]
        return _window_left(blocks.manifest(source, sibling), blocks.matched(source, sibling, tokens))
    state_format = service.engine.state_format
    if state_format is None:
        return False
    held = state_format.tokens(path)  # a whole file: windowed, as its fingerprint says
    if isinstance(held, StateRefusal):
        return False
    matched = next((i for i, (a, b) in enumerate(zip(held, tokens)) if a != b), min(len(held), len(tokens)))
    return matched < len(held) - 1


async def _restore_chain(parts: Parts, key: str, request: StrataRequest, service: Service,
                         choice: Choice | None, chain: Chain) -> bool:
    """Restore ``chain`` (found by the prompt's tokens) into the request's slot, which then
    holds a prefix of this request's conversation under its key."""
    assert parts.store is not None
    if not _engine_restores(parts, request, service):
        return False
    sibling = 0 if choice is None else choice.sibling
    began = time.monotonic()
    try:
        with span("auto_sessions.join"):
            name = await asyncio.to_thread(parts.store.joined_chain, chain)  # type: ignore[attr-defined]
    except (CorruptBlock, ValueError, OSError) as exc:
        parts.stats.restores_refused_damaged += 1
        log.warning("[strata] auto sessions: not restoring %s by its tokens: its blocks do not join (%s)", key, exc)
        return False
    try:
        # A prefix of blocks, the conversation's own or another's: its file is not current.
        answer = await service.restore_slot(name, slot=request.slot, key=key, tenant=request.tenant,
                                            request=request, sibling=sibling, own_file=False)
    except (EngineError, EngineUnavailable) as exc:
        _restore_failed(parts, key, exc, failure_verdict("restore", exc, service, None))
        return False
    finally:
        parts.store.discard(name)
    ms = (time.monotonic() - began) * 1000
    _count_restore(parts, answer.tokens, answer.bytes, ms)
    parts.stats.restores_by_tokens += 1
    # The chain prefixes the prompt as the engine tokenized it: the request continues what
    # was restored (a low reuse then says the tokenizing differed, not that the engine failed).
    request.state.setdefault(NAME, {}).update(restore_ms=ms, continues=True, by_tokens=True)
    source = chain.source.rpartition("#")[0] if chain.source else "?"
    log.info("[strata] auto sessions: restored %s tokens for %s in %.0f ms%s: the longest stored prefix of its "
             "prompt, %d block(s) of %s's", f"{answer.tokens:,}", key, ms,
             from_slot(service, request.slot, "into"), len(chain.names), "its own" if source == key else source)
    return True


def _file_to_restore(parts: Parts, key: str, request: StrataRequest, service: Service,
                     choice: Choice | None) -> tuple[str, int, Path] | None:
    """Whose file to restore for ``key``, which sibling, and where it is: its own (the
    sibling ``choice`` names) when it has one, else the one a fallback plugin chose; None
    when there is none, or the slot holds the chosen one already."""
    assert parts.store is not None
    sibling = 0 if choice is None else choice.source
    if sibling is None and choice is not None and parts.store.stage(key, choice.sibling):
        # A file under the request's own name that no sibling knows: one whose sidecar is
        # refused (damaged). It goes through the checks, which refuse it, counted.
        sibling = choice.sibling
    if sibling is not None:
        in_slot = service.slots[request.slot]
        if in_slot.key == key and in_slot.sibling == sibling and not in_slot.empty:
            return None  # the slot holds it: the engine reuses it from there
        path = parts.store.bin_path(key, sibling)
        if parts.store.stage(key, sibling):
            return key, sibling, path
        if path.is_symlink():
            log.warning("[strata] auto sessions: not restoring %s: it is a symlink, never followed", path.name)
            return None
        parts.siblings.removed(key, sibling)  # gone since (pruned or removed by another process)
    chosen = fallback.choose(parts, request, service)
    if chosen is None:
        return None
    source, source_sibling = chosen
    return source, source_sibling, parts.store.bin_path(source, source_sibling)


def _restorable(parts: Parts, source: str, sibling: int, path: Path) -> Sidecar | None:
    """The sidecar of ``source``'s file when the file may go to this engine; None when it
    is refused (damaged, or for this engine), counted by reason and logged."""
    assert parts.store is not None
    sidecar = parts.store.sidecar(source, sibling)
    problem = parts.store.sidecar_problem(source, sibling) if sidecar is None else None
    if problem is not None:
        parts.stats.restores_refused_damaged += 1
        log.warning("[strata] auto sessions: not restoring %s: its sidecar is damaged (%s)", path.name, problem)
        return None
    refusal = incompatibility(sidecar, parts.fingerprint, build_range=parts.config.build_range)
    if refusal is not None:
        count_refusal(parts, path.name, refusal)
        return None
    assert sidecar is not None  # a missing sidecar is refused as unjudged
    if not parts.store.intact(source, sidecar):
        parts.stats.restores_refused_damaged += 1
        log.warning("[strata] auto sessions: not restoring %s: it is truncated or damaged "
                    "(size or digest differs from when it was saved)", path.name)
        return None
    return sidecar


def count_refusal(parts: Parts, name: str, refusal: Refusal) -> None:
    """The file ``name`` cannot go to this engine (``refusal``): counted by reason and logged."""
    parts.stats.count_refusal(refusal.reason)
    log.warning("[strata] auto sessions: not restoring %s (%s): %s", name, refusal.reason, refusal.detail)


async def _load(parts: Parts, key: str, source: str, sibling: int, path: Path, request: StrataRequest,
                service: Service) -> tuple[int, int, float] | None:
    """Have the engine read the file (once more after a failure its quirks call passing):
    the tokens restored, the bytes read and the milliseconds; None when it failed."""
    # The slot then holds the file's conversation, the incoming one's or the fallback's,
    # until the request changes it: one the engine refuses, or whose client leaves first,
    # never does, and no save under the incoming key may hold the rest of another's.
    # (Nothing nameable when another slot holds the fallback: never recorded in two.)
    holder: str | None = source
    if source != key and any(state.key == source for state in service.slots if state.id != request.slot):
        holder = None
    began = time.monotonic()
    joined = await _join(parts, source, sibling, path)
    if joined is False:
        return None
    try:
        for attempt in range(2):
            try:
                answer = await service.restore_slot(joined or path.name, slot=request.slot, key=holder,
                                                    tenant=request.tenant, request=request, sibling=sibling)
                break
            except (EngineError, EngineUnavailable) as exc:
                verdict = failure_verdict("restore", exc, service, None)
                if verdict == Verdict.RETRY and attempt == 0:
                    log.info("[strata] auto sessions: restoring %s failed (%s); trying once more", key, exc)
                    continue
                _restore_failed(parts, key, exc, verdict)
                return None
    finally:
        if joined:
            parts.store.discard(joined)  # type: ignore[union-attr]
    ms = (time.monotonic() - began) * 1000
    return answer.tokens, answer.bytes, ms


async def _join(parts: Parts, source: str, sibling: int, path: Path) -> str | None | Literal[False]:
    """A conversation in blocks: its blocks joined into a temporary file the engine reads
    from the slot directory (made in memory where saves are staged, behind a link), its
    name (None: its whole file is there); False when a block is missing or damaged
    (counted; the damaged block is gone, so a next save writes it again)."""
    store = parts.store
    if parts.blocks is None or store.restorable(source, sibling):  # type: ignore[union-attr]
        return None  # a whole file: the engine reads it as it is
    staging = parts.staging
    hits = staging.hits if staging is not None else 0
    try:
        with span("auto_sessions.join"):
            name = await asyncio.to_thread(store.joined, source, sibling)  # type: ignore[union-attr]
        if staging is not None and staging.hits > hits:
            parts.stats.restores_kept_whole += 1
        return name
    except (CorruptBlock, ValueError, OSError) as exc:
        parts.stats.restores_refused_damaged += 1
        log.warning("[strata] auto sessions: not restoring %s: its blocks do not join (%s)", path.name, exc)
        return False


def _restore_failed(parts: Parts, key: str, exc: Exception, verdict: Verdict | None) -> None:
    parts.stats.restore_failures += 1
    if verdict == Verdict.UNSUPPORTED:
        message = exc.message if isinstance(exc, EngineError) else str(exc)
        parts.status.stop(f"the engine cannot restore slots ({message})")
    # The file stays: it is pruned like any other, and never deleted on a guess.
    log.warning("[strata] auto sessions: restoring %s failed: %s; the request is answered by a full "
                "prefill", parts.store.bin_name(key), exc)  # type: ignore[union-attr]


def check_reuse(parts: Parts, request: StrataRequest, restored: int, outcome: Outcome,
                service: Service) -> None:
    """The request after a restore of ``restored`` tokens ended: did it reuse them? A
    continued conversation that barely did may pause parking (``retry_after_s``)."""
    reused = outcome.timings.reused if outcome.timings is not None else 0
    if request.state.get(NAME, {}).get("prefix_of"):
        fallback.reused_from(parts, request, restored, reused)
        return
    expected = min(restored, outcome.prompt_tokens or restored)
    if reused >= parts.config.reuse_warn_ratio * expected:
        return
    if request.state.get(NAME, {}).get("by_tokens"):
        # Restored by the prompt's tokens as /tokenize gave them: the request's own reading
        # of its prompt differed (a template parameter the rendering did not see). Counted
        # and said; no sign the engine cannot reuse a restore, so parking goes on.
        parts.stats.restores_diverged += 1
        log.info("[strata] auto sessions: %s reused %s of the %s tokens restored by its prompt's tokens: the "
                 "engine read the prompt otherwise than it tokenized it", request.conversation_key,
                 f"{reused:,}", f"{restored:,}")
        return
    if not request.state.get(NAME, {}).get("continues", False):
        # The request does not continue what was saved: its low reuse says nothing
        # about the engine.
        parts.stats.restores_diverged += 1
        log.info("[strata] auto sessions: %s changed since its file was saved (an edited message, or "
                 "another conversation with the same opening): the restore gave %s of %s tokens",
                 request.conversation_key, f"{reused:,}", f"{restored:,}")
        return
    parts.stats.restores_not_reused += 1
    log.warning("[strata] auto sessions: restore not reused: restored %s tokens for %s, and the next "
                "request, which continues that conversation, reused only %s",
                f"{restored:,}", request.conversation_key, f"{reused:,}")
    verdict = first_result(service.pm, "auto_sessions_restore_unused", restored=restored, reused=reused,
                           prompt_tokens=outcome.prompt_tokens, engine=service.engine, service=service)
    if verdict == Verdict.UNSUPPORTED:
        seconds = parts.config.retry_after_s * 2 ** parts.stats.pauses
        parts.stats.pauses += 1
        parts.status.pause(seconds, "the engine does not reuse restored state for this model")
