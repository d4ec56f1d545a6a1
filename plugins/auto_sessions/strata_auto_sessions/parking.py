"""The parking logic: when to save the slot's conversation, and when to restore one.

What the slot holds is the core's picture (``service.slots``), recorded for every
request and slot call; this module keeps no model of the engine's slots of its own.
The outgoing conversation is saved at a switch unless its file is already current (an
idle save made it so), or the switch is left to the engine's RAM prompt cache while it
has room (``engine_ram``: a belief about that cache, checked at each return from it).

:class:`AutoSessions` decides around each request and builds the parts every step works
with (``parts``: the store, the settings, the cost rule, the counters, and the state kept
between requests, each part the one writer of its own); the rest is decided in one module
each, given those parts, never this object: whether a conversation is worth a file
(``policy``), the mode (``mode``), saving (``saving``), restoring (``restoring``) and its
fallback (``fallback``), idle saves (``idle``), pruning (``pruning``), the shared tier
(``shared.sync``).
"""

from __future__ import annotations

import contextlib
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from strata_serve import (ConfigError, EngineError, EngineMeasures, EngineUnavailable, Outcome, StrataRequest, api_of,
                          first_result, make_private_dir, span)

from strata_auto_sessions import restoring
from strata_auto_sessions.config import GB, NAME, AutoSessionsConfig, size_text
from strata_auto_sessions.engine_ram import MAX_SHARED, EngineRam, Left, cache_budget, leaving_ident, shared_share
from strata_auto_sessions.idle import IdleSaves
from strata_auto_sessions.mode import ParkingMode, ParkingStatus
from strata_auto_sessions.parked_blocks import ParkedBlocks
from strata_auto_sessions.policy import Costs, describe
from strata_auto_sessions.prompts import continues, prompt_signature
from strata_auto_sessions.in_use import InUseRecord
from strata_auto_sessions.parts import Parts
from strata_auto_sessions.pruning import refresh_usage
from strata_auto_sessions.saving import Parked, measure_state, park_slot, save_from_engine_ram
from strata_auto_sessions.shared.sync import SharedParking
from strata_auto_sessions.siblings import Choice, Sibling, SiblingIndex
from strata_auto_sessions.staging import Staging, default_keep_bytes
from strata_auto_sessions.stats import AutoSessionsStats
from strata_auto_sessions.store import DirectoryInUse, LockTimeout, ParkingStore, SessionStore, engine_fingerprint
from strata_auto_sessions.store import swa_unusable
from strata_auto_sessions.syncing import BackgroundSyncs

if TYPE_CHECKING:
    from strata_serve import Service, SlotState

__all__ = ["GB", "NAME", "AutoSessions", "AutoSessionsConfig", "AutoSessionsStats", "Parked", "ParkingMode"]

log = logging.getLogger("strata_auto_sessions")

#: The side lane's slots (``engine.side_slot_tokens``): the main conversation's, and the side slot.
MAIN_SLOT, SIDE_SLOT = 0, 1


class AutoSessions:
    """One per service: the decisions around the slot the core describes."""

    def __init__(self, config: AutoSessionsConfig, store: ParkingStore | None, fingerprint: dict[str, Any],
                 measures: EngineMeasures, off: str | None = None):
        stats = AutoSessionsStats()
        #: What every step works with (:mod:`strata_auto_sessions.parts`: which part keeps
        #: which state, and who changes it); the steps are given these, never this object.
        self.parts = Parts(
            config=config, store=store, stats=stats,
            status=ParkingStatus(stopped=(off or "no store") if store is None else None),
            costs=Costs.of(config, measures), siblings=SiblingIndex(store), fingerprint=fingerprint,
            syncs=BackgroundSyncs(store, stats), in_use=InUseRecord(store))
        #: Bytes per token of the engine's state, its prefill and restore speeds: the core's measurements.
        self.speeds = measures
        self.idle_saves = IdleSaves(self.parts)
        #: The tier shared with other servers (``plugins.auto_sessions.shared``), or None.
        self.shared: SharedParking | None = None
        #: What the engine's RAM prompt cache holds of the conversations left to it
        #: (``ram_first``); None when switches always park to disk.
        self.engine_ram: EngineRam | None = None
        #: By slot, the engine path and body of the last request that ran there, with its
        #: key (kept with ``ram_first`` only: a conversation left to the engine's RAM is
        #: brought back by it at a stop).
        self.last_sent: dict[int, tuple[str, str, dict[str, Any]]] = {}

    # The parts, read (their one writer is each part's own methods, or this object).

    @property
    def config(self) -> AutoSessionsConfig:
        return self.parts.config

    @property
    def store(self) -> ParkingStore | None:
        return self.parts.store

    @property
    def stats(self) -> AutoSessionsStats:
        return self.parts.stats

    @property
    def status(self) -> ParkingStatus:
        return self.parts.status

    @property
    def costs(self) -> Costs:
        """The one cost rule, on the core's measurements (:class:`~strata_auto_sessions.policy.Costs`)."""
        return self.parts.costs

    @property
    def siblings(self) -> SiblingIndex:
        return self.parts.siblings

    @property
    def fingerprint(self) -> dict[str, Any]:
        return self.parts.fingerprint

    @classmethod
    async def start(cls, config: AutoSessionsConfig, service: Service) -> AutoSessions:
        info = service.engine.info
        if "slot_files" not in getattr(service.engine, "capabilities", {"slot_files"}):
            return cls._off(config, service, "the engine backend cannot save and restore slots")
        directory = config.slot_dir or info.slot_save_path
        if directory is None:
            return cls._off(config, service, "no slot directory; set engine.slot_save_path (--slot-save-path) or "
                                    "plugins.auto_sessions.slot_dir")
        store = first_result(service.pm, "auto_sessions_store", directory=Path(directory), service=service) \
            or SessionStore(Path(directory))
        try:
            _use_blocks(store, Path(directory), config, service)
            removed = await _open(store, Path(directory), config)
            _stage(store, Path(directory), config, service)
        except DirectoryInUse as exc:
            raise ConfigError(f"auto sessions: {exc}") from None
        except OSError as exc:
            return cls._off(config, service, f"slot directory {directory} unusable: {exc}")
        if removed:
            log.info("[strata] auto sessions: removed %d unfinished temporary file(s)", removed)
        parking = cls(config, store, engine_fingerprint(info), service.measures)
        if config.fsync == "background" and callable(getattr(store, "sync_written", None)):
            store.sync_later = True
        parking.describe_engine()
        parking.judge_engine()
        refresh_usage(store, parking.stats, report=True)
        if config.shared is not None:
            parking.shared = parking.parts.uploads = await SharedParking.start(parking.parts, service, config.shared)
        budget = cache_budget(service)
        if config.ram_first and config.shared is None and budget is not None and len(service.slots) == 1:
            # With a shared tier, the other servers need every state on the tier; with
            # several slots, the engine caches what each one leaves, in turns not seen here.
            parking.engine_ram = ram = EngineRam(budget)
            parking.parts.in_use.left_in_ram = lambda: (ident[1] for ident, _ in ram.conversations())
        log.info("[strata] auto sessions: on, files in %s (%d file(s), %s); a conversation is worth a file "
                 "from %s", directory, parking.stats.files_on_disk, size_text(parking.stats.bytes_on_disk),
                 describe(config))
        return parking

    @classmethod
    def _off(cls, config: AutoSessionsConfig, service: Service, why: str) -> AutoSessions:
        log.warning("[strata] auto sessions: off: %s", why)
        return cls(config, None, {}, service.measures, off=why)

    def stop(self) -> None:
        """The server stops: it holds nothing any more, and lets go of the directory."""
        self.parts.in_use.write([])
        staging = self.parts.staging
        if staging is not None:
            staging.close()
        if self.store is not None:
            self.store.release()

    @property
    def mode(self) -> ParkingMode:
        """Whether parking acts now (``mode.parks``), and if not, why (:class:`ParkingMode`)."""
        return self.parts.mode

    def engine_restarted(self, service: Service) -> None:
        """A new engine process: the model file may have been replaced in place meanwhile,
        so the fingerprint files are checked against is taken again."""
        info = service.engine.info
        if self.engine_ram is not None:
            self.engine_ram.restarted()
        if self.store is not None:
            self.parts.fingerprint = engine_fingerprint(info)
            self.describe_engine()
            self.judge_engine()

    def judge_engine(self) -> None:
        """Whether this engine's state is worth a file at all; said once, when it changes."""
        self.status.judge(swa_unusable(self.fingerprint))

    def describe_engine(self) -> None:
        """Leave what this engine is beside the files, for ``strata-serve sessions ls``."""
        try:
            self.store.describe_engine(self.fingerprint)  # type: ignore[union-attr]
        except OSError as exc:
            log.warning("[strata] auto sessions: cannot describe the engine in %s: %s",
                        self.store.directory, exc)  # type: ignore[union-attr]

    # -- around each request -------------------------------------------------

    async def before(self, request: StrataRequest, service: Service) -> None:
        self.idle_saves.cancel(request.slot)
        self.record_in_use(service)
        if request.sent_ahead:
            return  # it continues what the slot holds (:meth:`may_go_ahead`), and may be running
        await self._park_other_slots(request, service)
        in_slot = await service.slot(request.slot)
        key = request.conversation_key
        same_key = key is not None and in_slot.key == key and in_slot.tenant == request.tenant and not in_slot.empty
        if key is not None and same_key and self.holds(key, request, in_slot.sibling):
            return  # the slot holds this conversation: nothing to do
        if request.pinned and key is not None:
            await self._park_where_it_was(request, service)
        if await self._left_to_engine(service, request, in_slot):
            return  # the engine's RAM cache makes this switch by itself
        if key is None and in_slot.key is None:
            return  # nothing nameable leaves, nothing nameable comes
        # A switch (or a request without a key, or another conversation under the held
        # key): the held conversation leaves the slot.
        choice = None if key is None else await self._choose(key, request, service, in_slot, same_key)
        parked = await self.park_slot(service, request.slot, reason="switch" if not same_key else "another "
                                      "conversation under its key", incoming=key,
                                      incoming_sibling=None if choice is None else choice.source)
        if key is None or choice is None:
            return
        if parked is Parked.ONLY_IN_SLOT:
            # Restoring now would replace the held state, which is in the slot and nowhere
            # else, with a weaker one: leave it.
            log.info("[strata] auto sessions: not restoring %s: the held conversation could not be saved "
                     "and is still in the engine", key)
            self.stats.restores_withheld += 1
            return
        await restoring.restore(self.parts, key, request, service, choice)

    async def _park_other_slots(self, request: StrataRequest, service: Service) -> None:
        """Before a request runs: what it may displace from the slots it does not take."""
        if getattr(service, "side_lane", False) and request.slot != MAIN_SLOT:
            # The main conversation stays in its slot while this request runs beside it, as a
            # one-slot engine's parks it: its file is made current first, so an engine crash
            # in the next ``idle_save_s`` loses nothing (the side lane holds the whole line,
            # so the idle save cannot run meanwhile). Skipped when its file is current.
            await self.park_slot(service, MAIN_SLOT, reason="a side request runs beside it")
        elif request.pinned:
            # The main slot runs: a long side conversation may lose its room (an engine that
            # picks the slot itself has every other slot parked below).
            await self.park_side_at_risk(service, request.slot, incoming=request.conversation_key)
        if not request.pinned:
            # The engine picks the slot itself and may take any: park every other one
            # first (the request holds them all meanwhile).
            for other in range(len(service.slots)):
                if other != request.slot:
                    await self.park_slot(service, other, reason="the engine chooses the slot",
                                         incoming=request.conversation_key)

    async def _park_where_it_was(self, request: StrataRequest, service: Service) -> None:
        """The conversation moves to the request's slot (it outgrew the side slot): its newest
        state is in the other slot, so its file is written from there before it is restored."""
        key = request.conversation_key
        for other in service.slots:
            if other.id != request.slot and other.key == key and other.tenant == request.tenant:
                await self.park_slot(service, other.id, reason="moves to another slot", incoming=key)

    async def _choose(self, key: str, request: StrataRequest, service: Service, in_slot: SlotState,
                      same_key: bool) -> Choice:
        """Which of the key's conversations the request continues (or a new one), after the
        shared tier brought in what another server saved of it."""
        if self.shared is not None:
            with span("auto_sessions.shared"):
                busy = frozenset(other.sibling for other in service.slots
                                 if other.key == key and other.tenant == request.tenant)
                # a newer state another server saved, or its conversation, where it pays
                await self.shared.bring_in(key, request, busy)
            self.siblings.forget(key)  # the key's files, as the shared tier left them
        held = Sibling(in_slot.sibling, self.parts.prompts.get(key), time.time()) if same_key else None
        with span("auto_sessions.siblings"):
            choice = self.siblings.choose(key, request, held, one=self.one_file_a_key)
        request.state.setdefault(NAME, {})["sibling"] = choice.sibling
        if self.engine_ram is not None and not choice.new and choice.sibling == 0:
            # The conversation takes the slot: the engine brings it back from its RAM
            # cache if it is there (and drops it from the cache), or it is restored or
            # read anew. Either way it is in RAM no more: a later return restores its file.
            self.engine_ram.take_back((request.tenant, key, 0))
        if choice.new:
            self.stats.siblings_started += 1
            log.info("[strata] auto sessions: %s: this request continues none of the conversations under "
                     "its key; it gets a file of its own, %s", key,
                     self.store.bin_name(key, choice.sibling))  # type: ignore[union-attr]
        return choice

    async def _left_to_engine(self, service: Service, request: StrataRequest, in_slot: SlotState) -> bool:
        """Whether this switch is left to the engine's RAM prompt cache (the conditions are
        :mod:`strata_auto_sessions.engine_ram`'s): nothing restored, and nothing saved but
        what the cache has no room for, and an engine's first state (saved to measure its size)."""
        ram = self.engine_ram
        if ram is None or not ram.trusted or in_slot.tokens is None:
            return False
        key = request.conversation_key
        incoming = None if key is None else (request.tenant, key, 0)
        in_ram = False
        if key is not None:
            if key == in_slot.key:
                return False  # another conversation under the held key: their files tell them apart
            files = self.siblings.of(key)
            if set(files) - {0}:
                return False  # several conversations under the key: their files tell them apart
            in_ram = ram.holds((request.tenant, key, 0))
            if in_ram and not continues(self.parts.prompts.get(key), request):
                return False  # another conversation under a key held in RAM
            if not in_ram and files:
                return False  # parked on disk and not in RAM: restored from its file
        fate = "empty" if in_slot.empty else await self._outgoing_fate(service, request, in_slot)
        if fate == "kept" and not in_ram:
            return False  # saved as ever; the engine reuses what the two prompts share
        if fate in ("kept", "no room"):
            # Parked to disk, and the slot emptied: the engine caches nothing (there is no
            # room), and brings an incoming conversation back from RAM (it would not look
            # there for a prompt the slot shares much with).
            parked = await self.park_slot(service, in_slot.id, reason="switch", incoming=key)
            if parked is Parked.ONLY_IN_SLOT:
                return False
            try:
                await service.erase_slot(in_slot.id)
            except (EngineError, EngineUnavailable) as exc:
                log.warning("[strata] auto sessions: could not empty slot %d before a switch: %s", in_slot.id, exc)
                return False
        if incoming is not None:
            request.state.setdefault(NAME, {})["sibling"] = 0
            expected = ram.take_back(incoming)
            if expected is not None:
                request.state[NAME]["from_ram"] = expected
        if not in_slot.empty or in_ram:
            self.stats.ram_switches += 1
            log.debug("[strata] auto sessions: switch from %s to %s left to the engine's RAM cache",
                      in_slot.key, key)
        return True

    async def _outgoing_fate(self, service: Service, request: StrataRequest, in_slot: SlotState) -> str:
        """What the engine does at this switch with what ``in_slot`` holds: ``cached`` in
        RAM within the half of its cache (recorded); ``kept`` in the slot, cut to what it
        shares with ``request`` (it then caches nothing); or caching it leaves ``no room``."""
        ram = self.engine_ram
        assert ram is not None and in_slot.tokens is not None
        outgoing = leaving_ident(in_slot)
        if outgoing is not None:
            share = shared_share(self.parts.prompts.get(outgoing[1]), prompt_signature(request))
            if share is None or share > MAX_SHARED:
                return "kept"
        bytes_per_token = self.speeds.bytes_per_token
        if bytes_per_token is None and outgoing is not None:
            # The engine's first state: saved, which measures its size.
            await self.park_slot(service, in_slot.id, reason="switch", incoming=request.conversation_key)
            bytes_per_token = self.speeds.bytes_per_token
            if bytes_per_token is None:
                # Not worth a file: saved to measure it, and removed. Without a size, every
                # switch would park to disk and empty the slot, and the engine, re-reading
                # each prompt whole, would answer short chats a third as fast as alone.
                await measure_state(self.parts, service, in_slot.id, outgoing[1])
                bytes_per_token = self.speeds.bytes_per_token
        if bytes_per_token is None or not ram.fits(in_slot.tokens, bytes_per_token):
            return "no room"
        path, body = None, None
        sent = self.last_sent.get(in_slot.id)
        if outgoing is not None and sent is not None and sent[0] == outgoing[1]:
            path, body = sent[1], sent[2]
        ram.cached(outgoing, Left(in_slot.tokens, path, body, self.parts.prompts.get(in_slot.key or ""), in_slot.since))
        return "cached"

    def may_go_ahead(self, request: StrataRequest, held: SlotState, service: Service) -> bool:
        """Whether ``request`` needs nothing done to the slot before the engine reads it,
        while the request before it is answered: it continues the conversation the slot
        holds, or neither has a key (the ``may_go_ahead`` hook)."""
        if not self.mode.parks:
            return True
        if len(service.slots) != 1:
            return False
        key = request.conversation_key
        if key is None:
            return held.key is None
        return (held.key == key and held.tenant == request.tenant and not held.empty
                and self.holds(key, request, held.sibling))

    def restores_by_tokens(self, request: StrataRequest, service: Service) -> bool:
        """Whether ``request``, as it arrives, will likely want its prompt's tokens at its
        turn (a switch to a conversation restored by its tokens, with blocks), so that they
        are asked ahead (:meth:`strata_serve.Service.tokens_ahead`): no slot holds its
        conversation, the engine's RAM cache does not hold it (nor take a new one), and no
        whole file of it is kept (the usual switch back restores that as it is)."""
        key, store = request.conversation_key, self.parts.store
        if key is None or store is None or self.parts.blocks is None:
            return False
        if any(state.key == key and state.tenant == request.tenant and not state.empty for state in service.slots):
            return False  # most likely continued where it is
        files = self.siblings.of(key)
        ram = self.engine_ram
        if ram is not None and ram.trusted and (ram.holds((request.tenant, key, 0)) or not files):
            return False  # back from the engine's RAM cache, or a new one left to it
        return not any(store.bin_path(key, sibling).is_file() for sibling in files)  # a whole file comes back as it is

    def holds(self, key: str, request: StrataRequest, sibling: int) -> bool:
        """Whether the request continues what the slot holding ``key`` (its ``sibling``)
        holds: its whole prompt, and no other sibling's longer one (the slot may hold a
        short side request the returning conversation starts with). True too when the key
        names one conversation, or what the slot holds is not known."""
        held = self.parts.prompts.get(key)
        if request.conversation_named or held is None or self.one_file_a_key:
            return True
        if not continues(held, request):
            return False
        return not any(other.sibling != sibling and other.prompt is not None
                       and other.prompt.get("units", 0) > held["units"] and continues(other.prompt, request)
                       for other in self.siblings.of(key).values())

    @property
    def one_file_a_key(self) -> bool:
        """Whether every key keeps one file (``siblings = 1``)."""
        return self.config.siblings == 1

    async def before_slot_action(self, service: Service, slot: int, action: str) -> None:
        self.idle_saves.cancel(slot)
        self.record_in_use(service)
        if action in ("restore", "erase"):
            # A slot changed by hand: park what it holds first, like a switch.
            await self.park_slot(service, slot, reason="slot action")
        if action == "restore":
            await self.park_side_at_risk(service, slot)

    async def park_side_at_risk(self, service: Service, slot: int, *, incoming: str | None = None) -> None:
        """Before the main slot of the side lane runs (a request, a restore): the side slot's
        conversation saved when the main slot may take its room.

        The main slot holds at most ``ctx_size`` tokens, so a side slot within its share
        (``engine.side_slot_tokens``) always keeps its room. One holding more (a long
        conversation beside a short main one) is emptied when the main slot needs that
        room: by the engine, when a decode finds the pool full (it purges an idle slot),
        and by the service, when a restore into the main slot finds no room. It is saved
        first, as a switch would save it: when worth a file and its file is not current.
        A conversation moving from the side slot to the main slot is saved by the move.
        """
        if not getattr(service, "side_lane", False) or slot != MAIN_SLOT:
            return
        side = await service.slot(SIDE_SLOT)
        if side.key is None or side.empty or side.file_current or side.key == incoming:
            return
        if side.tokens is not None and side.tokens <= service.settings.engine.side_slot_tokens:
            return
        await self.park_slot(service, SIDE_SLOT, reason="the main slot may need its room", incoming=incoming)

    def after(self, request: StrataRequest, outcome: Outcome, service: Service) -> None:
        key = request.conversation_key
        sibling = request.state.get(NAME, {}).get("sibling")
        in_slot = service.slots[request.slot]
        if key is not None and sibling is not None and in_slot.last_request == request.id and in_slot.key == key:
            # The request reached the engine: the slot holds its conversation, this sibling.
            service.slots.holds_sibling(request.slot, key, sibling)
        if outcome.timings is None:
            return
        if key is not None:
            self.parts.prompts.ran(key, prompt_signature(request))
        if request.restored_tokens:
            restoring.check_reuse(self.parts, request, request.restored_tokens, outcome, service)
        if self.engine_ram is not None and key is not None:
            api = api_of(request)
            if api is not None and api.engine_path:
                self.last_sent[request.slot] = (key, api.engine_path, dict(request.body))
        expected = request.state.get(NAME, {}).get("from_ram")
        if expected and key is not None and self.engine_ram is not None:
            if self.engine_ram.came_back((request.tenant, key, 0), expected, outcome.timings.reused):
                self.stats.ram_hits += 1
            else:
                self.stats.ram_misses += 1

    async def save_left_in_ram(self, service: Service, within_s: float) -> None:
        """At a normal stop, after the slots were parked: each conversation left to the
        engine's RAM cache, newest first, brought back into the main slot and saved
        (:func:`strata_auto_sessions.saving.save_from_engine_ram`), within ``within_s``."""
        ram = self.engine_ram
        if ram is None or not ram.held or not self.mode.parks:
            return
        deadline = time.monotonic() + within_s
        left = ram.conversations()
        ram.held.clear()
        for done, (ident, conversation) in enumerate(left):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                log.warning("[strata] auto sessions: %d conversation(s) left to the engine's RAM cache not saved: "
                            "the stop's %.0f s for them ran out", len(left) - done, within_s)
                return
            await save_from_engine_ram(self.parts, service, MAIN_SLOT, ident, conversation, remaining)

    async def park_slot(self, service: Service, slot: int = 0, *, reason: str, incoming: str | None = None,
                        incoming_sibling: int | None = None) -> Parked:
        """Save the conversation the slot holds to its file, if it is worth it and not
        current (:func:`strata_auto_sessions.saving.park_slot`)."""
        held = service.slots[slot]
        parked = await park_slot(self.parts, service, slot, reason=reason, incoming=incoming,
                                 incoming_sibling=incoming_sibling)
        if self.engine_ram is not None and held.key is not None and not held.empty:
            # The slot holds it: it is not in the engine's RAM cache, whatever was believed.
            # (A switch left to the cache whose request never reached the engine, cut off
            # first, left it in the slot; its return must come from its file, not the cache.)
            self.engine_ram.take_back((held.tenant, held.key, held.sibling))
        return parked

    def record_in_use(self, service: Service) -> None:
        """Tell ``strata-serve sessions rm`` which conversations the slots hold or are
        being run, saved or not (it runs in another process); written when that changes."""
        self.parts.in_use.record(service)

    def syncs_held(self) -> contextlib.AbstractContextManager[None]:
        """The fsyncs of saves made meanwhile start at the end of a request's steps before
        the engine (:meth:`~strata_auto_sessions.syncing.BackgroundSyncs.held`)."""
        return self.parts.syncs.held()

    async def synced(self) -> None:
        """Until every save so far is on disk (a normal stop waits for it)."""
        await self.parts.syncs.synced()


def _use_blocks(store: ParkingStore, directory: Path, config: AutoSessionsConfig, service: Service) -> None:
    """Park in blocks (``blocks = true``) where the store is the slot directory's (or a
    store plugin's that says it parks blocks) and the engine's backend can cut its state;
    whole files otherwise."""
    state_format = getattr(service.engine, "state_format", None)
    if not config.blocks or not isinstance(store, SessionStore):
        return
    if type(store) is not SessionStore and not getattr(store, "parks_blocks", False):
        # A store plugin built on whole files (it copies ``bin_name`` out and back in).
        log.info("[strata] auto sessions: the store %s parks whole files (it does not say parks_blocks = True)",
                 type(store).__name__)
        return
    if state_format is None:
        log.info("[strata] auto sessions: blocks = true, but this engine's state cannot be cut into blocks: "
                 "whole files")
        return
    make_private_dir(directory)
    store.blocks = ParkedBlocks.open(directory, state_format, fingerprint=engine_fingerprint(service.engine.info),
                                     block_tokens=config.block_tokens, fsync=config.fsync == "at_save")


def _stage(store: ParkingStore, directory: Path, config: AutoSessionsConfig, service: Service) -> None:
    """With blocks, stage the engine's saves in memory (:mod:`strata_auto_sessions.staging`),
    once the directory is this server's: the engine must reach the stage directory, which
    one strata-serve started does (or one the operator chose, ``stage_dir``)."""
    if not isinstance(store, SessionStore) or store.blocks is None:
        return  # whole files: nothing is staged
    if config.stage_dir is None and not service.engine.info.managed:
        return
    keep = default_keep_bytes() if config.stage_keep_mb is None else config.stage_keep_mb << 20
    store.staging = Staging.open(directory, config.stage_dir, keep)


async def _open(store: ParkingStore, directory: Path, config: AutoSessionsConfig) -> int:
    """Take the slot directory for this server and clear what an earlier one left
    unfinished: the number of temporary files removed."""
    try:
        make_private_dir(directory)  # the lock is taken on the directory itself
        async with store.lock_without_blocking(config.lock_wait_s):
            return store.prepare()
    except LockTimeout as exc:
        log.warning("[strata] auto sessions: unfinished temporary files are left for the next start: %s", exc)
        claim = getattr(store, "claim", None)  # the directory is still this server's alone
        if claim is not None:
            claim()
        return 0
