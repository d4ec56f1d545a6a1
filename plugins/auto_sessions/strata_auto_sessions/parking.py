"""The parking logic: when to save the slot's conversation, and when to restore one.

What the slot holds is the core's picture (``service.slots``), recorded for every
request and slot call; this module keeps no model of the engine of its own. It never
leaves a conversation to the engine's RAM prompt cache on a guess: the outgoing
conversation is saved at a switch unless its file is already current (an idle save
made it so), because the RAM cache's eviction cannot be seen from outside.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from strata_serve import ConfigError, EngineError, make_private_dir, Outcome, StrataRequest, Verdict, counter, gauge, in_tenant
from strata_serve import EngineMeasures, EngineUnavailable

from strata_serve import first_result

from strata_auto_sessions.prefix import ParkedConversation, message_chain
from strata_auto_sessions.store import (
    REFUSAL_REASONS, SIDECAR_VERSION, DirectoryInUse, LockTimeout, ParkingStore, SessionStore, Sidecar,
    engine_fingerprint, incompatibility, last_use, swa_unusable,
)

log = logging.getLogger("strata_auto_sessions")

NAME = "auto_sessions"
GB = 1024**3
_SAVE_SKIPS = "Saves skipped, by reason"
_RESTORE_SKIPS = "Restores not attempted, by reason"


class AutoSessionsConfig(BaseModel):
    """``plugins.auto_sessions.*``."""

    model_config = ConfigDict(extra="forbid")

    #: A conversation is worth a file when re-reading it would take at least this many
    #: seconds more than restoring it: prefill speed measured from the engine's own
    #: timings, restore speed from earlier restores. Until they are measured, every
    #: conversation of ``min_tokens`` or more is (when in doubt, save).
    min_prefill_s: float = Field(2.0, ge=0)
    #: Conversations shorter than this are never worth a file. Set alone (without
    #: ``min_prefill_s``), it is the only threshold, as in earlier versions.
    min_tokens: int = Field(0, ge=0)
    #: Keep at most this many session files...
    keep: int = Field(12, ge=1)
    #: ...and at most this many GB of them.
    max_gb: float = Field(100, gt=0)
    #: The slot directory; default: the engine's ``slot_save_path``.
    slot_dir: Path | None = None
    #: After a restore, a next request reusing less than this share of the restored
    #: tokens is reported as "restore not reused".
    reuse_warn_ratio: float = Field(0.5, ge=0, le=1)
    #: Save the held conversation once the server has been idle this long (0: never),
    #: so a later switch need not wait for its save.
    idle_save_s: float = Field(2.0, ge=0)
    #: After restores of continued conversations went unused (the engine cannot reuse
    #: restored state for this model), parking pauses this long, then tries again;
    #: each further pause is twice as long.
    retry_after_s: float = Field(600.0, gt=0)
    #: Files saved by an engine build at most this many llama.cpp builds apart from the
    #: running one are restored; farther apart they are refused.
    build_range: int = Field(1000, ge=0)
    #: Wait at most this long for the slot directory's lock, which another server or
    #: ``strata-serve sessions`` may hold; then the save, restore or prune is given up
    #: (logged) and the request goes on without it.
    lock_wait_s: float = Field(10.0, gt=0)

    @model_validator(mode="after")
    def _min_tokens_alone(self) -> AutoSessionsConfig:
        if "min_tokens" in self.model_fields_set and "min_prefill_s" not in self.model_fields_set:
            self.min_prefill_s = 0.0
        return self


@dataclass
class AutoSessionsStats:
    """Counters for other plugins, each declared as a metric where it is kept.

    ``collect_stats`` reports them as a flat dict; ``collect_metrics`` hands over this
    object, whose fields carry their exported name, help and unit (milliseconds are
    exported as seconds, Prometheus' base unit).
    """

    saves: int = counter("Conversations saved to disk", summary="saves")
    saved_tokens: int = counter("Tokens saved to disk")
    saved_bytes: int = counter("Bytes written by saves", unit="bytes")
    save_ms: float = counter("Time spent saving", name="save_seconds", unit="seconds", scale=1e-3)
    save_failures: int = counter("Saves that failed")
    save_skips_below_min: int = counter(_SAVE_SKIPS, name="save_skips", labels={"reason": "below_min_tokens"})
    save_skips_verdict: int = counter(_SAVE_SKIPS, name="save_skips", labels={"reason": "engine_verdict"})
    save_skips_unchanged: int = counter(_SAVE_SKIPS, name="save_skips", labels={"reason": "unchanged"})
    #: Saves not made because the model uses a sliding window and the engine runs
    #: without ``--swa-full`` (no restore of the file would be reused).
    save_skips_swa: int = counter(_SAVE_SKIPS, name="save_skips", labels={"reason": "swa"})
    idle_saves: int = counter("Saves made while the server was idle")
    restores: int = counter("Conversations restored from disk", summary="restores")
    restored_tokens: int = counter("Tokens restored from disk")
    restored_bytes: int = counter("Bytes read by restores", unit="bytes")
    restore_ms: float = counter("Time spent restoring", name="restore_seconds", unit="seconds", scale=1e-3)
    restore_failures: int = counter("Restores that failed")
    restores_withheld: int = counter(_RESTORE_SKIPS, name="restore_skips", labels={"reason": "save_failed"})
    restores_refused_damaged: int = counter(_RESTORE_SKIPS, name="restore_skips", labels={"reason": "damaged"})
    #: Files refused before the engine saw them, by reason (``store.REFUSAL_REASONS``):
    #: another model, a context too small, another KV cache type, flash-attention
    #: setting, ``--swa-full``, an engine build out of range, or not judged.
    restores_refused_other_model: int = counter(_RESTORE_SKIPS, name="restore_skips",
                                                labels={"reason": "other_model"})
    restores_refused_context: int = counter(_RESTORE_SKIPS, name="restore_skips", labels={"reason": "context"})
    restores_refused_cache_type: int = counter(_RESTORE_SKIPS, name="restore_skips",
                                               labels={"reason": "cache_type"})
    restores_refused_flash_attn: int = counter(_RESTORE_SKIPS, name="restore_skips",
                                               labels={"reason": "flash_attn"})
    restores_refused_swa: int = counter(_RESTORE_SKIPS, name="restore_skips", labels={"reason": "swa"})
    restores_refused_build: int = counter(_RESTORE_SKIPS, name="restore_skips", labels={"reason": "build"})
    restores_refused_unjudged: int = counter(_RESTORE_SKIPS, name="restore_skips", labels={"reason": "unjudged"})
    restores_not_reused: int = counter("Restores the next request barely reused")
    restores_diverged: int = counter(
        "Restores whose next request did not continue the saved conversation (an edited message, "
        "or another conversation with the same opening)")
    pauses: int = counter("Times parking paused because restores went unused")
    prunes: int = counter("Session files pruned")
    pruned_bytes: int = counter("Bytes of session files pruned", unit="bytes")
    #: Conversations without a file of their own started from another one's (a fallback
    #: plugin chose it), the tokens restored so, and how many of those the next request reused.
    prefix_restores: int = counter("Conversations started from another conversation's file")
    prefix_restored_tokens: int = counter("Tokens restored from another conversation's file")
    prefix_reused_tokens: int = counter("Tokens of another conversation's file the next request reused")

    #: Session files and their bytes, as of the last save or prune.
    files_on_disk: int = gauge("Session files on disk", summary="files")
    bytes_on_disk: int = gauge("Bytes of session files on disk", name="on_disk_bytes", unit="bytes",
                               summary="on disk")
    #: Session files beside a sidecar that is refused (not JSON, a field of another type):
    #: never restored, left alone.
    damaged_files: int = gauge("Session files whose sidecar is damaged")

    def snapshot(self) -> dict[str, float]:
        return asdict(self)


class AutoSessions:
    """One per service: the decisions around the slot the core describes."""

    def __init__(self, config: AutoSessionsConfig, store: ParkingStore | None, fingerprint: dict[str, Any],
                 measures: EngineMeasures):
        self.config = config
        self.store = store
        self.fingerprint = fingerprint
        self.stats = AutoSessionsStats()
        #: False for good once the engine said it cannot save or restore slots.
        self.usable = store is not None
        #: While parking is paused (restores went unused), the monotonic time it resumes.
        self.paused_until: float | None = None
        #: The core's measurements of the engine (prefill speed, bytes per token).
        self.measures = measures
        #: Restore speed measured on this engine (bytes, ms).
        self._restore_speed = [0, 0.0]
        #: The prompt signature of the last request that ran, by conversation key.
        self.prompts: dict[str, dict[str, Any]] = {}
        #: Saves waiting for a slot to be idle, by slot.
        self._idle: dict[int, Any] = {}
        #: Why no state of this engine is worth a file (``store.swa_unusable``), or None.
        self.unsaveable: str | None = None
        #: The conversations last recorded as held (``store.record_held``).
        self._held: list[str] | None = None

    @classmethod
    async def start(cls, config: AutoSessionsConfig, service: Any) -> AutoSessions:
        info = service.engine.info
        if "slot_files" not in getattr(service.engine, "capabilities", {"slot_files"}):
            log.warning("[strata] auto sessions: off: the engine backend cannot save and restore slots")
            return cls(config, None, {}, service.measures)
        directory = config.slot_dir or info.slot_save_path
        if directory is None:
            log.warning("[strata] auto sessions: off: no slot directory; set engine.slot_save_path "
                        "(--slot-save-path) or plugins.auto_sessions.slot_dir")
            return cls(config, None, {}, service.measures)
        store = first_result(service.pm, "auto_sessions_store", directory=Path(directory), service=service) \
            or SessionStore(Path(directory))
        try:
            try:
                make_private_dir(Path(directory))  # the lock is taken on the directory itself
                async with store.lock_without_blocking(config.lock_wait_s):
                    removed = store.prepare()
            except LockTimeout as exc:
                log.warning("[strata] auto sessions: unfinished temporary files are left for the next start: %s", exc)
                removed = 0
                claim = getattr(store, "claim", None)  # the directory is still this server's alone
                if claim is not None:
                    claim()
        except DirectoryInUse as exc:
            raise ConfigError(f"auto sessions: {exc}") from None
        except OSError as exc:
            log.warning("[strata] auto sessions: off: slot directory %s unusable: %s", directory, exc)
            return cls(config, None, {}, service.measures)
        if removed:
            log.info("[strata] auto sessions: removed %d unfinished temporary file(s)", removed)
        parking = cls(config, store, engine_fingerprint(info), service.measures)
        parking.describe_engine()
        parking.judge_engine()
        parking.refresh_usage(report=True)
        log.info("[strata] auto sessions: on, files in %s (%d file(s), %s); a conversation is worth a file "
                 "from %s", directory, parking.stats.files_on_disk, _size(parking.stats.bytes_on_disk),
                 _threshold(config))
        return parking

    def stop(self) -> None:
        """The server stops: it holds nothing any more, and lets go of the directory."""
        self._record_held([])
        release = getattr(self.store, "release", None)  # a store of the protocol's first version has none
        if release is not None:
            release()

    @property
    def active(self) -> bool:
        if not self.usable:
            return False
        if self.paused_until is not None:
            if time.monotonic() < self.paused_until:
                return False
            self.paused_until = None
            log.info("[strata] auto sessions: parking resumes")
        return True

    def engine_restarted(self, service: Any) -> None:
        """A new engine process: the model file may have been replaced in place meanwhile,
        so the fingerprint files are checked against is taken again."""
        info = service.engine.info
        if self.store is not None:
            self.fingerprint = engine_fingerprint(info)
            self.describe_engine()
            self.judge_engine()

    def judge_engine(self) -> None:
        """Whether this engine's state is worth a file at all; said once, when it changes."""
        unsaveable = swa_unusable(self.fingerprint)
        if unsaveable is not None and unsaveable != self.unsaveable:
            log.warning("[strata] auto sessions: conversations are neither saved nor restored: %s. Start the "
                        "engine with --swa-full (engine.extra_args) to park them: its cache then keeps the "
                        "whole context for the sliding layers too, which takes more memory", unsaveable)
        elif unsaveable is None and self.unsaveable is not None:
            log.info("[strata] auto sessions: the engine now keeps its whole context: parking resumes")
        self.unsaveable = unsaveable

    def describe_engine(self) -> None:
        """Leave what this engine is beside the files, for ``strata-serve sessions ls``."""
        try:
            self.store.describe_engine(self.fingerprint)  # type: ignore[union-attr]
        except OSError as exc:
            log.warning("[strata] auto sessions: cannot describe the engine in %s: %s",
                        self.store.directory, exc)  # type: ignore[union-attr]

    # -- around each request -------------------------------------------------

    async def before(self, request: StrataRequest, service: Any) -> None:
        self._cancel_idle_save(request.slot)
        self.record_held(service)
        held = await service.slot(request.slot)
        if not request.pinned:
            # The engine picks the slot itself and may take any: park every other one
            # first (the request holds them all meanwhile).
            for other in range(len(service.slots)):
                if other != request.slot:
                    await self.park_held(service, other, reason="the engine chooses the slot",
                                         incoming=request.conversation_key)
        key = request.conversation_key
        if key is not None and held.key == key and held.tenant == request.tenant and not held.empty:
            return  # the slot holds this conversation: nothing to do
        if key is None and held.key is None:
            return  # nothing nameable leaves, nothing nameable comes
        # A switch (or a request without a key): the held conversation leaves the slot.
        parked = await self.park_held(service, request.slot, reason="switch", incoming=key)
        if key is None:
            return
        if parked is False:
            # Restoring now would replace the held state, which is in the slot and nowhere
            # else, with a weaker one: leave it.
            log.info("[strata] auto sessions: not restoring %s: the held conversation could not be saved "
                     "and is still in the engine", key)
            self.stats.restores_withheld += 1
            return
        await self._restore(key, request, service)

    async def before_slot_action(self, service: Any, slot: int, action: str) -> None:
        self._cancel_idle_save(slot)
        self.record_held(service)
        if action in ("restore", "erase"):
            # A slot changed by hand: park what it holds first, like a switch.
            await self.park_held(service, slot, reason="slot action")

    def after(self, request: StrataRequest, outcome: Outcome, service: Any) -> None:
        if outcome.timings is None:
            return
        key = request.conversation_key
        if key is not None:
            self.prompts.pop(key, None)
            self.prompts[key] = prompt_signature(request.body)
            while len(self.prompts) > 64:  # only the held conversation's is needed; keep a few
                self.prompts.pop(next(iter(self.prompts)))
        if request.restored_tokens:
            self._check_reuse(request, request.restored_tokens, outcome, service)

    def worth_a_file(self, tokens: int | None) -> tuple[bool, str]:
        """Whether a conversation of ``tokens`` is worth a file, and why not."""
        if tokens is None:
            return True, ""  # not known even after asking the engine: when in doubt, save
        if tokens < self.config.min_tokens:
            return False, f"{tokens:,} tokens is below min_tokens ({self.config.min_tokens:,})"
        prefill_s = self.measures.prefill_seconds(tokens)
        if self.config.min_prefill_s <= 0 or prefill_s is None:
            return True, ""
        restore_s = 0.0
        bytes_per_token = self.measures.bytes_per_token
        if self._restore_speed[1] and bytes_per_token:
            restore_s = tokens * bytes_per_token / (self._restore_speed[0] / self._restore_speed[1] * 1000)
        if prefill_s - restore_s < self.config.min_prefill_s:
            return False, (f"re-reading its {tokens:,} tokens takes about {prefill_s:.1f} s here, less than "
                           f"min_prefill_s ({self.config.min_prefill_s:g} s) more than a restore")
        return True, ""

    def _check_reuse(self, request: StrataRequest, restored: int, outcome: Outcome, service: Any) -> None:
        reused = outcome.timings.reused if outcome.timings is not None else 0
        if request.state.get(NAME, {}).get("prefix_of"):
            self._prefix_reused(request, restored, reused)
            return
        expected = min(restored, outcome.prompt_tokens or restored)
        if reused >= self.config.reuse_warn_ratio * expected:
            return
        if not request.state.get(NAME, {}).get("continues", False):
            # The request does not continue what was saved: its low reuse says nothing
            # about the engine.
            self.stats.restores_diverged += 1
            log.info("[strata] auto sessions: %s changed since its file was saved (an edited message, or "
                     "another conversation with the same opening): the restore gave %s of %s tokens",
                     request.conversation_key, f"{reused:,}", f"{restored:,}")
            return
        self.stats.restores_not_reused += 1
        log.warning("[strata] auto sessions: restore not reused: restored %s tokens for %s, and the next "
                    "request, which continues that conversation, reused only %s",
                    f"{restored:,}", request.conversation_key, f"{reused:,}")
        verdict = first_result(service.pm, "auto_sessions_restore_unused", restored=restored, reused=reused,
                               prompt_tokens=outcome.prompt_tokens, engine=service.engine, service=service)
        if verdict == Verdict.UNSUPPORTED:
            self._pause("the engine does not reuse restored state for this model")

    def _pause(self, why: str) -> None:
        seconds = self.config.retry_after_s * 2 ** self.stats.pauses
        self.stats.pauses += 1
        self.paused_until = time.monotonic() + seconds
        log.warning("[strata] auto sessions: parking paused for %.0f s: %s", seconds, why)

    def _give_up(self, why: str) -> None:
        if self.usable:
            log.warning("[strata] auto sessions: parking stopped: %s", why)
        self.usable = False

    # -- saving while idle ---------------------------------------------------

    async def save_if_emptied_when_idle(self, service: Any, slot: int) -> None:
        """On an engine that empties idle slots into its RAM cache when another slot gets
        a task (``engine.info.clears_idle_slots``, not known for an attached one), the
        slot's conversation is saved as soon as its answer ends, while its request
        still holds the slot: once idle, it may be gone from the slot at any moment."""
        if len(service.slots) > 1 and service.engine.info.clears_idle_slots is not False:
            await self.park_held(service, slot, reason="the engine empties idle slots")

    def schedule_idle_save(self, service: Any, slot: int = 0) -> None:
        """Save the slot's conversation once the slot has been idle ``idle_save_s``."""
        held = service.slots[slot]
        if (self.config.idle_save_s <= 0 or held.key is None or held.file_current or held.empty
                or self.unsaveable is not None):
            return
        self._cancel_idle_save(slot)
        # With one slot, once the whole service is idle (as ever); with several, once this
        # slot is, while the others may be busy.
        self._idle[slot] = service.when_idle(
            self.config.idle_save_s, lambda: self._idle_save(service, slot),
            name="auto-sessions' save while idle", slot=None if len(service.slots) == 1 else slot)

    async def _idle_save(self, service: Any, slot: int) -> None:
        if self.active and await self.park_held(service, slot, reason="idle"):
            self.stats.idle_saves += 1

    def _cancel_idle_save(self, slot: int) -> None:
        idle = self._idle.pop(slot, None)
        if idle is not None:
            idle.cancel()

    # -- the engine calls ----------------------------------------------------

    async def park_held(self, service: Any, slot: int = 0, *, reason: str,
                        incoming: str | None = None) -> bool | None:
        """Save the conversation the slot holds to its file, if it is worth it and not current.

        ``incoming`` names the conversation about to be restored: pruning spares its file.

        :returns: True saved (or already current), None nothing to save (empty, not
            nameable, not worth a file), False the save failed: the state is in the
            slot and nowhere else.
        """
        assert self.store is not None
        held = await service.slot(slot)
        key = held.key
        if key is None or held.empty:
            return None
        if held.file_current:
            if self._file_kept(key):
                self.stats.save_skips_unchanged += 1
                return True
            # Its file went since it was made (`strata-serve sessions prune`, or by hand):
            # the slot holds the only copy, so it is saved like any other.
            log.info("[strata] auto sessions: %s's file is gone since it was saved: saving it again", key)
            held.file_current = False
        if self.unsaveable is not None:
            self.stats.save_skips_swa += 1  # said once, at start: no file would be of use
            return None
        worth, why_not = self.worth_a_file(held.tokens)
        if not worth:
            self.stats.save_skips_below_min += 1
            log.info("[strata] auto sessions: not saving %s: %s", key, why_not)
            return None
        verdict = service.verdict("save", None, held.tokens)
        if verdict in (Verdict.SKIP, Verdict.UNSUPPORTED):
            self.stats.save_skips_verdict += 1
            log.info("[strata] auto sessions: not saving %s: the engine quirk check says %s", key, verdict.value)
            if verdict == Verdict.UNSUPPORTED:
                self._give_up("the engine cannot save slots")
            # Unsaved state must not be replaced by a restore unless there is none.
            return None if held.tokens == 0 else False
        sidecar = self.store.sidecar(key)
        prompt = self.prompts.get(key)
        for attempt in range(2):
            temp = self.store.temp_name(key)
            began = time.monotonic()
            try:
                answer = await service.save_slot(temp, slot=slot)
                n_saved = int(answer.get("n_saved", 0))
                n_written = int(answer.get("n_written", 0))
                if n_saved == 0:
                    # The slot was empty after all: such a file is worthless, and
                    # restoring one has crashed the engine.
                    self._discard(temp)
                    log.info("[strata] auto sessions: not keeping %s: the engine's slot was empty", key)
                    service.slots.emptied(slot)
                    return None
                now = time.time()
                try:
                    async with self.store.lock_without_blocking(self.config.lock_wait_s):
                        kept = self.store.commit(temp, key, Sidecar(
                            key=key, fingerprint=self.fingerprint, tokens=n_saved, bytes=n_written,
                            # A file's state began with its first file; a state with none, when the
                            # slot began holding it: a removal by hand since then drops the save.
                            created=sidecar.created if sidecar else (held.since or now), last_used=now,
                            digest="", prompt=prompt, tenant=held.tenant, version=SIDECAR_VERSION,
                        ))
                except LockTimeout as exc:
                    self._discard(temp)
                    self.stats.save_failures += 1
                    log.warning("[strata] auto sessions: saving %s given up: %s; it stays in the slot", key, exc)
                    return False
                break
            except (EngineError, EngineUnavailable, OSError) as exc:
                self._discard(temp)
                verdict = self._failure_verdict("save", exc, service, held.tokens)
                if verdict == Verdict.RETRY and attempt == 0:
                    log.info("[strata] auto sessions: saving %s failed (%s); trying once more", key, exc)
                    continue
                return self._save_failed(key, exc, verdict, service, slot)
        ms = (time.monotonic() - began) * 1000
        if kept is False:
            return await self._removed_by_hand(key, slot, service)
        if service.slots[slot].key == key:
            service.slots[slot].file_current = True
        self.stats.saves += 1
        self.stats.saved_tokens += n_saved
        self.stats.saved_bytes += n_written
        self.stats.save_ms += ms
        log.info("[strata] auto sessions: saved %s tokens (%s) to %s in %.0f ms%s%s",
                 f"{n_saved:,}", _size(n_written), self.store.bin_name(key), ms,
                 "" if reason == "switch" else f" ({reason})", _from_slot(service, slot))
        await self._prune(protect=in_use(service, key, incoming))
        return True

    def _file_kept(self, key: str) -> bool:
        """Whether the store still has the conversation's file (its sidecar describes it)."""
        try:
            return self.store.sidecar(key) is not None  # type: ignore[union-attr]
        except OSError:
            return False

    async def _removed_by_hand(self, key: str, slot: int, service: Any) -> None:
        """The session was removed by hand (``strata-serve sessions rm``) while the slot held
        it: its save was dropped, and the slot is erased so the engine forgets it too."""
        self.prompts.pop(key, None)
        log.info("[strata] auto sessions: %s was removed by hand: its save is dropped and the slot erased", key)
        try:
            await service.erase_slot(slot)
        except (EngineError, EngineUnavailable) as exc:
            log.warning("[strata] auto sessions: erasing the slot after %s was removed failed: %s", key, exc)
        self.refresh_usage()
        self.record_held(service)
        return None

    def record_held(self, service: Any) -> None:
        """Tell ``strata-serve sessions rm`` which conversations the slots hold or are
        being run, saved or not (it runs in another process); written when that changes."""
        held = sorted(in_use(service))
        if held != self._held:
            self._record_held(held)

    def _record_held(self, held: list[str]) -> None:
        record = getattr(self.store, "record_held", None)  # a store of the protocol's first version has none
        if record is None:
            return
        try:
            record(held)
        except OSError as exc:
            log.warning("[strata] auto sessions: cannot record the held conversations in %s: %s",
                        self.store.directory, exc)  # type: ignore[union-attr]
            return
        self._held = held

    def _discard(self, temp: str) -> None:
        try:
            self.store.discard(temp)  # type: ignore[union-attr]
        except OSError as exc:  # e.g. the directory itself is gone
            log.warning("[strata] auto sessions: could not remove %s: %s", temp, exc)

    def _failure_verdict(self, op: str, exc: Exception, service: Any, tokens: int | None) -> Verdict | None:
        error = exc if isinstance(exc, EngineError) else EngineError(op=op, message=str(exc))
        return service.verdict(op, error, tokens)

    def _save_failed(self, key: str, exc: Exception, verdict: Verdict | None, service: Any,
                     slot: int) -> bool | None:
        self.stats.save_failures += 1
        message = exc.message if isinstance(exc, EngineError) else str(exc)
        if verdict == Verdict.PROVISIONAL:
            log.info("[strata] auto sessions: %s held only provisional state (%s); "
                     "restoring over it is safe", key, message)
            service.slots.emptied(slot)
            return None
        if verdict == Verdict.UNSUPPORTED:
            self._give_up(f"the engine cannot save slots ({message})")
        log.warning("[strata] auto sessions: saving %s failed: %s", key, exc)
        return False

    async def _restore(self, key: str, request: StrataRequest, service: Any) -> bool:
        assert self.store is not None
        # Locked from the choice of file to the engine's read: `strata-serve sessions rm`
        # never removes a file between the checks and the restore.
        try:
            async with self.store.lock_without_blocking(self.config.lock_wait_s):
                return await self._restore_locked(key, request, service)
        except LockTimeout as exc:
            log.warning("[strata] auto sessions: not restoring %s: %s; the request is answered by a full "
                        "prefill", key, exc)
            return False

    async def _restore_locked(self, key: str, request: StrataRequest, service: Any) -> bool:
        assert self.store is not None
        path = self.store.bin_path(key)
        source = key  # whose file is restored: the conversation's own, or a fallback's
        if not self.store.stage(key):
            if path.is_symlink():
                log.warning("[strata] auto sessions: not restoring %s: it is a symlink, never followed", path.name)
                return False
            source = self._fallback(request, service)
            if source is None:
                return False
            path = self.store.bin_path(source)
        sidecar = self.store.sidecar(source)
        problem = self.store.sidecar_problem(source) if sidecar is None else None
        if problem is not None:
            self.stats.restores_refused_damaged += 1
            log.warning("[strata] auto sessions: not restoring %s: its sidecar is damaged (%s)", path.name, problem)
            return False
        if self.refused(path.name, sidecar):
            return False
        if not self.store.intact(source, sidecar):
            self.stats.restores_refused_damaged += 1
            log.warning("[strata] auto sessions: not restoring %s: it is truncated or damaged "
                        "(size or digest differs from when it was saved)", path.name)
            return False
        held = service.slots[request.slot]
        verdict = service.verdict("restore", None, held.tokens)
        if verdict in (Verdict.SKIP, Verdict.UNSUPPORTED):
            if verdict == Verdict.UNSUPPORTED:
                self._give_up("the engine cannot restore slots")
            return False
        # The slot then holds the file's conversation, the incoming one's or the fallback's,
        # until the request changes it: one the engine refuses, or whose client leaves first,
        # never does, and no save under the incoming key may hold the rest of another's.
        # (Nothing nameable when another slot holds the fallback: never recorded in two.)
        holder: str | None = source
        if source != key and any(state.key == source for state in service.slots if state.id != request.slot):
            holder = None
        for attempt in range(2):
            began = time.monotonic()
            try:
                answer = await service.restore_slot(path.name, slot=request.slot, key=holder,
                                                    tenant=request.tenant, request=request)
                break
            except (EngineError, EngineUnavailable) as exc:
                verdict = self._failure_verdict("restore", exc, service, None)
                if verdict == Verdict.RETRY and attempt == 0:
                    log.info("[strata] auto sessions: restoring %s failed (%s); trying once more", key, exc)
                    continue
                return self._restore_failed(key, exc, verdict)
        ms = (time.monotonic() - began) * 1000
        n_restored = int(answer.get("n_restored", 0))
        n_read = int(answer.get("n_read", 0))
        self.stats.restores += 1
        self.stats.restored_tokens += n_restored
        self.stats.restored_bytes += n_read
        self.stats.restore_ms += ms
        if n_read and ms > 0:
            self._restore_speed[0] += n_read
            self._restore_speed[1] += ms
        if source != key:
            self._prefix_restored(key, source, request, service, n_restored, ms)
            return True
        request.state[NAME] = {"restore_ms": ms, "continues": continues(sidecar.prompt, request.body)}
        try:
            self.store.touch(key)
        except OSError as exc:
            log.warning("[strata] auto sessions: could not update %s's sidecar: %s", key, exc)
        log.info("[strata] auto sessions: restored %s tokens from %s in %.0f ms%s",
                 f"{n_restored:,}", path.name, ms, _from_slot(service, request.slot, "into"))
        return True

    # -- a fallback for a conversation without a file ----------------------------

    def prefill_seconds(self, tokens: int) -> float | None:
        """How long the engine takes to read ``tokens`` prompt tokens, as the core measured it (None: not yet)."""
        return self.measures.prefill_seconds(tokens)

    def restore_seconds(self, size: int) -> float | None:
        """How long restoring a file of ``size`` bytes takes, as measured here (None: not yet)."""
        if not self._restore_speed[1]:
            return None
        return size / (self._restore_speed[0] / self._restore_speed[1] * 1000)

    def _fallback(self, request: StrataRequest, service: Any) -> str | None:
        """The parked conversation a plugin chose for ``request``, which has no file: same
        tenant, a file this engine can use, not the one the slot holds (the engine reuses
        that from the slot). None when there is none."""
        assert self.store is not None
        units = prompt_units(request.body)
        if isinstance(units, str) or not units:
            return None
        chain = message_chain(request.body, units)
        parked = []
        try:
            sessions = self.store.sessions()
        except OSError as exc:
            log.warning("[strata] auto sessions: cannot list %s: %s", self.store.directory, exc)
            return None
        now = time.time()
        for other, sidecar in sessions:
            # Tenants never share: a file is another tenant's unless its sidecar names this one
            # (and an unnamed tenant's keys have no tenant prefix).
            if other == request.conversation_key or sidecar.tenant != request.tenant:
                continue
            if not in_tenant(other, request.tenant):
                continue
            prompt = sidecar.prompt or {}
            if not prompt.get("chain") or incompatibility(sidecar, self.fingerprint,
                                                          build_range=self.config.build_range):
                continue
            parked.append(ParkedConversation(key=other, tokens=sidecar.tokens, bytes=sidecar.bytes,
                                             last_used=last_use(sidecar.last_used, now=now) or 0.0,
                                             chain=list(prompt["chain"]), sizes=list(prompt.get("sizes") or [])))
        if not parked:
            return None
        chosen = first_result(service.pm, "auto_sessions_fallback", request=request, chain=chain,
                              parked=parked, parking=self, service=service)
        if chosen is None:
            return None
        if chosen not in {candidate.key for candidate in parked}:
            log.warning("[strata] auto sessions: a fallback plugin chose %r, which was not offered; ignored", chosen)
            return None
        held = service.slots[request.slot]
        if held.key == chosen and not held.empty:
            log.info("[strata] auto sessions: %s starts from %s, which the slot holds: nothing to restore",
                     request.conversation_key, chosen)
            return None
        if not self.store.stage(chosen):
            return None
        return chosen

    def _prefix_restored(self, key: str, source: str, request: StrataRequest, service: Any,
                         n_restored: int, ms: float) -> None:
        self.stats.prefix_restores += 1
        self.stats.prefix_restored_tokens += n_restored
        request.state[NAME] = {"restore_ms": ms, "continues": False, "prefix_of": source}
        log.info("[strata] auto sessions: %s has no file; restored %s tokens from %s, whose opening it "
                 "shares, in %.0f ms", key, f"{n_restored:,}", self.store.bin_name(source), ms)  # type: ignore[union-attr]

    def _prefix_reused(self, request: StrataRequest, restored: int, reused: int) -> None:
        self.stats.prefix_reused_tokens += reused
        log.info("[strata] auto sessions: %s reused %s of the %s tokens restored from %s's file",
                 request.conversation_key, f"{reused:,}", f"{restored:,}", request.state[NAME]["prefix_of"])

    def refused(self, name: str, sidecar: Sidecar | None) -> bool:
        """Whether the file ``name`` (described by ``sidecar``) cannot go to this engine:
        counted by reason and logged."""
        refusal = incompatibility(sidecar, self.fingerprint, build_range=self.config.build_range)
        if refusal is None:
            return False
        assert refusal.reason in REFUSAL_REASONS
        counter = f"restores_refused_{refusal.reason}"
        setattr(self.stats, counter, getattr(self.stats, counter) + 1)
        log.warning("[strata] auto sessions: not restoring %s (%s): %s", name, refusal.reason, refusal.detail)
        return True

    def _restore_failed(self, key: str, exc: Exception, verdict: Verdict | None) -> bool:
        self.stats.restore_failures += 1
        if verdict == Verdict.UNSUPPORTED:
            message = exc.message if isinstance(exc, EngineError) else str(exc)
            self._give_up(f"the engine cannot restore slots ({message})")
        # The file stays: it is pruned like any other, and never deleted on a guess.
        log.warning("[strata] auto sessions: restoring %s failed: %s; the request is answered by a full "
                    "prefill", self.store.bin_name(key), exc)  # type: ignore[union-attr]
        return False

    def refresh_usage(self, report: bool = False) -> None:
        """Count the files on disk (after a change, not at every read of the numbers);
        ``report`` logs each file whose sidecar is damaged."""
        assert self.store is not None
        try:
            self.stats.files_on_disk, self.stats.bytes_on_disk = self.store.usage()
            damaged = self.store.damaged()
        except OSError as exc:
            log.warning("[strata] auto sessions: cannot list %s: %s", self.store.directory, exc)
            return
        self.stats.damaged_files = len(damaged)
        for _key, path, why in damaged if report else ():
            log.warning("[strata] auto sessions: %s is left alone, never restored: its sidecar is damaged (%s)",
                        path.name, why)

    async def _prune(self, protect: frozenset[str] = frozenset()) -> None:
        assert self.store is not None
        try:
            async with self.store.lock_without_blocking(self.config.lock_wait_s):
                removed = self.store.prune(self.config.keep, int(self.config.max_gb * GB), protect)
        except OSError as exc:  # a lock held elsewhere too long (LockTimeout) among them
            log.warning("[strata] auto sessions: pruning failed: %s", exc)
            return
        finally:
            self.refresh_usage()
        if self.stats.bytes_on_disk > self.config.max_gb * GB:
            log.warning("[strata] auto sessions: %s of session files kept, more than max_gb (%g): the newest "
                        "file and the one about to be restored are never pruned", _size(self.stats.bytes_on_disk),
                        self.config.max_gb)
        for key, size in removed:
            self.stats.prunes += 1
            self.stats.pruned_bytes += size
            log.info("[strata] auto sessions: pruned %s%s%s (%s)", "auto-", key, ".bin", _size(size))


def in_use(service: Any, *keys: str | None) -> frozenset[str]:
    """Conversations whose files pruning must spare: ``keys``, those the slots hold, and
    those of the requests running (one may be restoring its file right now)."""
    held = (state.key for state in service.slots)
    running = service.fifo.busy.values()
    return frozenset(k for k in (*keys, *held, *running) if k is not None)


def _from_slot(service: Any, slot: int, word: str = "from") -> str:
    return f" ({word} slot {slot})" if len(service.slots) > 1 else ""


def _size(n: int) -> str:
    return f"{n / GB:.2f} GB" if n >= GB / 100 else f"{n / 1024**2:.2f} MB"


def _threshold(config: AutoSessionsConfig) -> str:
    parts = []
    if config.min_prefill_s > 0:
        parts.append(f"{config.min_prefill_s:g} s of prefill saved")
    if config.min_tokens > 0:
        parts.append(f"{config.min_tokens:,} tokens")
    return " and ".join(parts) or "any length"


def prompt_units(body: dict[str, Any]) -> list[Any] | str:
    """What a request's prompt is made of, in order: its instructions or system prompt
    (Responses, Anthropic) and its messages or input items; or a completion's prompt text."""
    units: list[Any] = [{field: body[field]} for field in ("instructions", "system") if field in body]
    for field in ("messages", "input"):
        value = body.get(field)
        if isinstance(value, list):
            return units + value
        if isinstance(value, str):
            return units + [value]
    prompt = body.get("prompt")
    return prompt if isinstance(prompt, str) and not units else units


def _digest(units: list[Any] | str) -> str:
    data = units if isinstance(units, str) else json.dumps(units, sort_keys=True, ensure_ascii=False)
    return hashlib.blake2b(data.encode("utf-8", "replace"), digest_size=16).hexdigest()


def prompt_signature(body: dict[str, Any]) -> dict[str, Any]:
    """How many units (messages, or characters of a prompt) a request had, and their digest;
    for messages, their chain too (:func:`strata_auto_sessions.prefix.message_chain`)."""
    units = prompt_units(body)
    signature: dict[str, Any] = {"units": len(units), "digest": _digest(units)}
    if isinstance(units, list):
        signature.update(message_chain(body, units))
    return signature


def continues(saved: dict[str, Any] | None, body: dict[str, Any]) -> bool:
    """Whether a request's prompt starts with what the saved state was made from.

    Only then is a restore that goes unused evidence about the engine; otherwise the
    conversation changed (an edited message, another conversation with the same key).
    """
    if not saved or not isinstance(saved.get("units"), int):
        return False
    units = prompt_units(body)
    return len(units) >= saved["units"] and _digest(units[: saved["units"]]) == saved.get("digest")
