"""The parking logic: what the slot holds, and when to save or restore it."""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from strata_serve.exchange import EngineError, Outcome, StrataRequest, Verdict
from strata_serve.engine.base import EngineUnavailable
from strata_serve.engine.ram_cache import EngineRamModel, budget_bytes

from strata_auto_sessions.store import SessionStore, Sidecar, fingerprint, same_model

log = logging.getLogger("strata_auto_sessions")

NAME = "auto_sessions"
#: Conversations the model of the engine's RAM cache keeps at most (when it has no byte limit).
RAM_MODEL_ENTRIES = 1000
#: How many of the latest conversations make the working set, and how many switches
#: after an eviction from the engine's RAM cache it counts as full.
RAM_PRESSURE_SWITCHES = 32
GB = 1024**3


class AutoSessionsConfig(BaseModel):
    """``plugins.auto_sessions.*``."""

    model_config = ConfigDict(extra="forbid")

    #: Conversations shorter than this are not worth a file (their prefill is cheap).
    min_tokens: int = Field(16000, ge=0)
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


@dataclass
class AutoSessionsStats:
    """Counters for other plugins (the stats plugin reads them through ``collect_stats``)."""

    saves: int = 0
    saved_tokens: int = 0
    saved_bytes: int = 0
    save_ms: float = 0.0
    save_failures: int = 0
    save_skips_below_min: int = 0
    save_skips_verdict: int = 0
    save_skips_unchanged: int = 0
    saves_left_to_ram: int = 0
    idle_saves: int = 0
    restores: int = 0
    restored_tokens: int = 0
    restored_bytes: int = 0
    restore_ms: float = 0.0
    restore_failures: int = 0
    restores_withheld: int = 0
    restores_left_to_ram: int = 0
    restores_refused_other_model: int = 0
    restores_refused_damaged: int = 0
    restores_not_reused: int = 0
    prunes: int = 0
    pruned_bytes: int = 0

    #: Session files and their bytes, as of the last save or prune.
    files_on_disk: int = 0
    bytes_on_disk: int = 0

    def snapshot(self) -> dict[str, float]:
        return asdict(self)


class AutoSessions:
    """One per service: the held conversation and the decisions around it."""

    def __init__(self, config: AutoSessionsConfig, store: SessionStore | None, fingerprint: dict[str, Any],
                 ram: EngineRamModel | None):
        self.config = config
        self.store = store
        self.fingerprint = fingerprint
        self.ram = ram
        self.stats = AutoSessionsStats()
        self.active = store is not None
        self.held_key: str | None = None
        self.held_tokens = 0
        self.held_generation: int | None = None
        #: True while the held conversation's file matches what the slot holds.
        self.held_saved = False
        #: Bytes per token of the engine's state, measured from our saves.
        self.bytes_per_token: float | None = None
        #: Switches so far, and the switch at which the RAM cache last had to evict.
        self.switches = 0
        self.last_ram_eviction: int | None = None
        #: The latest conversations seen and their sizes in tokens, oldest first.
        self.working_set: collections.OrderedDict[str, int] = collections.OrderedDict()
        self._idle_timer: asyncio.TimerHandle | None = None
        self._idle_task: asyncio.Task | None = None

    @classmethod
    def start(cls, config: AutoSessionsConfig, service: Any) -> AutoSessions:
        info = service.engine.info
        if service.settings.engine.parallel > 1 or info.parallel > 1:
            log.warning("[strata] auto sessions: off: the engine runs %d slots in parallel; "
                        "parking needs a single-slot engine (engine.parallel = 1)", max(info.parallel, 2))
            return cls(config, None, {}, None)
        directory = config.slot_dir or info.slot_save_path
        if directory is None:
            log.warning("[strata] auto sessions: off: no slot directory; set engine.slot_save_path "
                        "(--slot-save-path) or plugins.auto_sessions.slot_dir")
            return cls(config, None, {}, None)
        store = SessionStore(Path(directory))
        try:
            removed = store.prepare()
        except OSError as exc:
            log.warning("[strata] auto sessions: off: slot directory %s unusable: %s", directory, exc)
            return cls(config, None, {}, None)
        if removed:
            log.info("[strata] auto sessions: removed %d unfinished temporary file(s)", removed)
        budget = budget_bytes(info.cache_ram_mib)
        ram = EngineRamModel(budget, RAM_MODEL_ENTRIES) if budget != 0 else None
        parking = cls(config, store, fingerprint(info.model_path, info.n_ctx), ram)
        parking.held_generation = service.engine.generation
        parking.bytes_per_token = store.bytes_per_token(parking.fingerprint)
        parking.refresh_usage()
        log.info("[strata] auto sessions: on, files in %s (%d file(s), %s); min_tokens %s; engine RAM cache %s",
                 directory, parking.stats.files_on_disk, _size(parking.stats.bytes_on_disk),
                 f"{config.min_tokens:,}",
                 "off" if ram is None else "unlimited" if budget is None else _size(budget))
        return parking

    # -- state -------------------------------------------------------------

    def engine_restarted(self) -> None:
        """Whatever the slot and the RAM cache held is gone."""
        if self.held_key is not None:
            log.info("[strata] auto sessions: the engine restarted; %s is no longer held", self.held_key)
        self.held_key, self.held_tokens = None, 0
        self.last_ram_eviction = None
        self.working_set.clear()
        if self.ram is not None:
            self.ram.clear()

    def _check_generation(self, service: Any) -> None:
        if self.held_generation != service.engine.generation:
            self.engine_restarted()
            self.held_generation = service.engine.generation

    # -- around each request -------------------------------------------------

    async def before(self, request: StrataRequest, service: Any) -> None:
        self._cancel_idle_save()
        self._check_generation(service)
        key = request.conversation_key
        if request.route == "slots" or key is None or key == self.held_key:
            return
        self.switches += 1
        outgoing, outgoing_tokens = self.held_key, self.held_tokens
        if outgoing is not None:
            self.working_set.pop(outgoing, None)
            self.working_set[outgoing] = outgoing_tokens
            while len(self.working_set) > RAM_PRESSURE_SWITCHES:
                self.working_set.popitem(last=False)
        in_ram = self.ram is not None and self.ram.holds_after_parking(
            key, outgoing, outgoing_tokens, self.bytes_per_token)
        if self._ram_keeps_outgoing() and (in_ram or not self.store.restorable(key)):  # type: ignore[union-attr]
            # Nothing will be restored over the outgoing conversation and the engine
            # parks it in its RAM cache by itself: saving it now would only add the
            # save's time to this request. It is saved when idle, or at shutdown.
            self.stats.saves_left_to_ram += 1
            saved = None
        else:
            saved = await self.save_held(service, reason="switch")
        if saved is False:
            # Restoring now would replace the held state (still in the slot, and in the
            # engine's RAM cache when it has one) with a weaker one: leave it.
            log.info("[strata] auto sessions: not restoring %s: the held conversation could not be saved "
                     "and is still in the engine", key)
            self.stats.restores_withheld += 1
            restored = False
        else:
            restored = await self._restore(key, request, service, in_ram=in_ram)
        if self.ram is not None:
            if not restored and outgoing is not None and outgoing_tokens > 0:
                # No restore: the engine parks the outgoing conversation itself. After a
                # restore it does not (the restore overwrote the slot).
                if self.ram.park(outgoing, outgoing_tokens, self.bytes_per_token):
                    self.last_ram_eviction = self.switches
            self.ram.take(key)  # now in the slot, whichever way it came
        self.held_key = key
        self.held_saved = restored
        if not restored:
            self.held_tokens = 0

    def _ram_keeps_outgoing(self) -> bool:
        """Whether the engine's RAM cache can be trusted to keep the held conversation.

        Only while it has ample room for every conversation in play (the working set
        in half the budget, no recent eviction): a conversation parked there without a
        file, then evicted as the working set grows, would be lost from both tiers.
        Not known before the bytes per token are (the first save measures them).
        """
        if self.ram is None or self.held_key is None or self.held_saved or self.bytes_per_token is None:
            return False
        if self.last_ram_eviction is not None and self.switches - self.last_ram_eviction <= RAM_PRESSURE_SWITCHES:
            return False
        if self.ram.budget is not None:
            in_play = sum(self.working_set.values()) * self.bytes_per_token
            if in_play > self.ram.budget / 2:
                return False
        return not self.ram.evictions_if_parked(self.held_key, self.held_tokens, self.bytes_per_token)

    # -- saving while idle ---------------------------------------------------

    def schedule_idle_save(self, service: Any) -> None:
        if self.config.idle_save_s <= 0 or self.held_key is None or self.held_saved:
            return
        self._cancel_idle_save()
        loop = asyncio.get_running_loop()
        self._idle_timer = loop.call_later(self.config.idle_save_s, self._start_idle_save, service)

    def _start_idle_save(self, service: Any) -> None:
        self._idle_timer = None
        if service.fifo.idle and not service.closing and self.active:
            self._idle_task = asyncio.create_task(self._idle_save(service), name="strata-idle-save")

    async def _idle_save(self, service: Any) -> None:
        # Holding the FIFO: a request arriving now waits for this one save at most.
        async with service.fifo.hold():
            if await self.save_held(service, reason="idle"):
                self.stats.idle_saves += 1

    def _cancel_idle_save(self) -> None:
        if self._idle_timer is not None:
            self._idle_timer.cancel()
            self._idle_timer = None

    async def stop_idle_save(self) -> None:
        """At shutdown: no new idle save, and the one running (if any) finished."""
        self._cancel_idle_save()
        if self._idle_task is not None:
            await self._idle_task
            self._idle_task = None

    def after(self, request: StrataRequest, outcome: Outcome, service: Any) -> None:
        if request.route == "slots":
            if request.body.get("action") in ("restore", "erase"):
                # Someone changed the slot by hand: we no longer know what it holds.
                self.held_key, self.held_tokens = None, 0
            return
        if request.conversation_key is None:
            # A keyless request took the slot: nothing we can name is held now.
            if outcome.status != "error":
                self.held_key, self.held_tokens = None, 0
            return
        self.held_saved = False  # the request changed what the slot holds
        if outcome.status == "ok" and outcome.context_tokens is not None:
            self.held_tokens = outcome.context_tokens
        restored = request.state.get(NAME, {}).get("restored_tokens")
        if restored and outcome.timings:
            self._check_reuse(request, restored, outcome, service)

    def _check_reuse(self, request: StrataRequest, restored: int, outcome: Outcome, service: Any) -> None:
        reused = int(outcome.timings.get("cache_n", 0))  # type: ignore[union-attr]
        expected = min(restored, outcome.prompt_tokens or restored)
        if reused >= self.config.reuse_warn_ratio * expected:
            return
        self.stats.restores_not_reused += 1
        log.warning("[strata] auto sessions: restore not reused: restored %s tokens for %s, the next "
                    "request reused only %s", f"{restored:,}", request.conversation_key, f"{reused:,}")
        error = EngineError(op="restore_reuse", message=f"restored {restored} tokens, reused {reused}",
                            body={"restored": restored, "reused": reused, "prompt_tokens": outcome.prompt_tokens})
        if service.verdict("restore_reuse", error, restored) == Verdict.UNSUPPORTED:
            self._give_up("the engine does not reuse restored state for this model")

    def _give_up(self, why: str) -> None:
        if self.active:
            log.warning("[strata] auto sessions: parking stopped: %s", why)
        self.active = False

    # -- the engine calls ----------------------------------------------------

    async def save_held(self, service: Any, *, reason: str) -> bool | None:
        """Save the held conversation if it is worth it.

        :returns: True saved, None nothing to do (skipped), False the save failed.
        """
        assert self.store is not None
        self._check_generation(service)
        key, tokens = self.held_key, self.held_tokens
        if key is None or tokens <= 0:
            return None
        if self.held_saved:
            self.stats.save_skips_unchanged += 1
            return True
        if tokens < self.config.min_tokens:
            self.stats.save_skips_below_min += 1
            log.info("[strata] auto sessions: not saving %s: %s tokens is below min_tokens (%s)",
                     key, f"{tokens:,}", f"{self.config.min_tokens:,}")
            return None
        verdict = service.verdict("save", None, tokens)
        if verdict in (Verdict.SKIP, Verdict.UNSUPPORTED):
            self.stats.save_skips_verdict += 1
            log.info("[strata] auto sessions: not saving %s: the engine quirk check says %s", key, verdict.value)
            if verdict == Verdict.UNSUPPORTED:
                self._give_up("the engine cannot save slots")
            return None
        sidecar = self.store.sidecar(key)
        for attempt in range(2):
            temp = self.store.temp_name(key)
            began = time.monotonic()
            try:
                answer = await service.engine.save(temp)
                n_saved = int(answer.get("n_saved", tokens))
                n_written = int(answer.get("n_written", 0))
                if n_saved == 0:
                    # The slot was empty after all (our count was stale): such a file
                    # is worthless, and restoring one has crashed the engine.
                    self._discard(temp)
                    log.info("[strata] auto sessions: not keeping %s: the engine's slot was empty", key)
                    self.held_key, self.held_tokens = None, 0
                    return None
                now = time.time()
                self.store.commit(temp, key, Sidecar(
                    key=key, fingerprint=self.fingerprint, tokens=n_saved, bytes=n_written,
                    created=sidecar.created if sidecar else now, last_used=now, digest="",
                ))
                break
            except (EngineError, EngineUnavailable, OSError) as exc:
                self._discard(temp)
                verdict = self._failure_verdict("save", exc, service, self.held_tokens)
                if verdict == Verdict.RETRY and attempt == 0:
                    log.info("[strata] auto sessions: saving %s failed (%s); trying once more", key, exc)
                    continue
                return self._save_failed(key, exc, verdict)
        ms = (time.monotonic() - began) * 1000
        self.held_tokens, self.held_saved = n_saved, True
        if n_saved:
            self.bytes_per_token = n_written / n_saved
        self.stats.saves += 1
        self.stats.saved_tokens += n_saved
        self.stats.saved_bytes += n_written
        self.stats.save_ms += ms
        log.info("[strata] auto sessions: saved %s tokens (%s) to %s in %.0f ms%s",
                 f"{n_saved:,}", _size(n_written), self.store.bin_name(key), ms,
                 "" if reason == "switch" else f" ({reason})")
        self._prune()
        return True

    def _discard(self, temp: str) -> None:
        try:
            self.store.discard(temp)  # type: ignore[union-attr]
        except OSError as exc:  # e.g. the directory itself is gone
            log.warning("[strata] auto sessions: could not remove %s: %s", temp, exc)

    def _failure_verdict(self, op: str, exc: Exception, service: Any, tokens: int | None) -> Verdict | None:
        error = exc if isinstance(exc, EngineError) else EngineError(op=op, message=str(exc))
        return service.verdict(op, error, tokens)

    def _save_failed(self, key: str, exc: Exception, verdict: Verdict | None) -> bool | None:
        self.stats.save_failures += 1
        message = exc.message if isinstance(exc, EngineError) else str(exc)
        if verdict == Verdict.PROVISIONAL:
            log.info("[strata] auto sessions: %s held only provisional state (%s); "
                     "restoring over it is safe", key, message)
            self.held_key, self.held_tokens = None, 0
            return None
        if verdict == Verdict.UNSUPPORTED:
            self._give_up(f"the engine cannot save slots ({message})")
        log.warning("[strata] auto sessions: saving %s failed: %s", key, exc)
        return False

    async def _restore(self, key: str, request: StrataRequest, service: Any, *, in_ram: bool) -> bool:
        assert self.store is not None
        path = self.store.bin_path(key)
        if not self.store.restorable(key):
            if path.is_symlink():
                log.warning("[strata] auto sessions: not restoring %s: it is a symlink, never followed", path.name)
            return False
        sidecar = self.store.sidecar(key)
        if sidecar is None or not same_model(sidecar.fingerprint, self.fingerprint):
            self.stats.restores_refused_other_model += 1
            log.warning("[strata] auto sessions: not restoring %s: it was saved %s", path.name,
                        "without a readable sidecar" if sidecar is None else "for another model or context size")
            return False
        if not self.store.intact(key, sidecar):
            self.stats.restores_refused_damaged += 1
            log.warning("[strata] auto sessions: not restoring %s: it is truncated or damaged "
                        "(size or digest differs from when it was saved)", path.name)
            return False
        if in_ram:
            self.stats.restores_left_to_ram += 1
            log.info("[strata] auto sessions: %s is most likely in the engine's RAM cache; "
                     "leaving it to the engine", key)
            return False
        verdict = service.verdict("restore", None, self.held_tokens)
        if verdict in (Verdict.SKIP, Verdict.UNSUPPORTED):
            if verdict == Verdict.UNSUPPORTED:
                self._give_up("the engine cannot restore slots")
            return False
        for attempt in range(2):
            began = time.monotonic()
            try:
                answer = await service.engine.restore(path.name)
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
        self.held_tokens = n_restored
        request.state[NAME] = {"restored_tokens": n_restored, "restore_ms": ms}
        try:
            self.store.touch(key)
        except OSError as exc:
            log.warning("[strata] auto sessions: could not update %s's sidecar: %s", key, exc)
        log.info("[strata] auto sessions: restored %s tokens from %s in %.0f ms",
                 f"{n_restored:,}", path.name, ms)
        return True

    def _restore_failed(self, key: str, exc: Exception, verdict: Verdict | None) -> bool:
        self.stats.restore_failures += 1
        # A failed restore may have cleared the slot: assume it holds nothing.
        self.held_key, self.held_tokens = None, 0
        if verdict == Verdict.UNSUPPORTED:
            message = exc.message if isinstance(exc, EngineError) else str(exc)
            self._give_up(f"the engine cannot restore slots ({message})")
        # The file stays: it is pruned like any other, and never deleted on a guess.
        log.warning("[strata] auto sessions: restoring %s failed: %s; the request is answered by a full "
                    "prefill", self.store.bin_name(key), exc)  # type: ignore[union-attr]
        return False

    def refresh_usage(self) -> None:
        """Count the files on disk (after a change, not at every read of the numbers)."""
        assert self.store is not None
        try:
            self.stats.files_on_disk, self.stats.bytes_on_disk = self.store.usage()
        except OSError as exc:
            log.warning("[strata] auto sessions: cannot list %s: %s", self.store.directory, exc)

    def _prune(self) -> None:
        assert self.store is not None
        try:
            removed = self.store.prune(self.config.keep, int(self.config.max_gb * GB))
        except OSError as exc:
            log.warning("[strata] auto sessions: pruning failed: %s", exc)
            return
        finally:
            self.refresh_usage()
        for key, size in removed:
            self.stats.prunes += 1
            self.stats.pruned_bytes += size
            log.info("[strata] auto sessions: pruned %s%s%s (%s)", "auto-", key, ".bin", _size(size))


def _size(n: int) -> str:
    return f"{n / GB:.2f} GB" if n >= GB / 100 else f"{n / 1024**2:.2f} MB"
