"""The service: what hooks get as ``service``, and the path of a request through the FIFO (:mod:`strata_serve.fifo`)."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Literal, TypeVar
from collections.abc import Awaitable, Callable

import pluggy
from pydantic import BaseModel

from strata_serve.config import ConfigError, Settings
from strata_serve.engine.base import Engine, SlotErased, SlotRestored, SlotSaved
from strata_serve.fifo import IdleWork, QueueFull, ServiceFIFO, ShuttingDown
from strata_serve.ahead import Ahead, InLine, may_go_ahead
from strata_serve.shutdown import Stopping
from strata_serve.slot_calls import SlotCalls
from strata_serve.hook_types import EngineError, Outcome, StrataRequest, Verdict
from strata_serve.measures import EngineMeasures, state_source
from strata_serve.hook_calls import broadcast, call_each_sync, first_result
from strata_serve.keying import choose_key
from strata_serve.side_lane import MAIN, SIDE, bound_generation, choose_lane, pool_tokens
from strata_serve.slot_choice import Claim, choose_slot, claim_for, last_tasks, locate, slot_for
from strata_serve.slot_state import SlotRegistry, SlotState, tokens_after
from strata_serve.timing import PhaseTotals, span, timeline_of
from strata_serve import tokens_ahead

log = logging.getLogger("strata_serve.service")

__all__ = ["IdleWork", "QueueFull", "Service", "ServiceFIFO", "ShuttingDown"]

M = TypeVar("M", bound=BaseModel)


class Service(SlotCalls, Stopping):
    """What hooks get as ``service``: settings, plugin manager, engine, FIFO.

    ``service.state`` is a dict for plugins to keep objects they want others to
    find (key it by your plugin's name).
    """

    def __init__(self, settings: Settings, pm: pluggy.PluginManager, engine: Engine):
        self.settings = settings
        self.pm = pm
        self.engine = engine
        engine.on_start = self._engine_started
        self._started = False
        self.fifo = ServiceFIFO(settings.engine.engine_slots, settings.server.queue_limit, self.choose_slot)
        self.state: dict[str, Any] = {}
        #: What each engine slot holds: recorded here for every request and slot call.
        self.slots = SlotRegistry.for_engine(settings.engine.engine_slots)
        #: Engine facts measured once, here, for everyone: prefill speed, bytes per token.
        self.measures = EngineMeasures()
        #: Every request's spans added up (:mod:`strata_serve.timing`): ``GET /stats``' ``phases``.
        self.phases = PhaseTotals()
        #: When the engine's last answer ended, on an engine that runs one request at a time
        #: (the ``gap`` span is measured from it).
        self._line_free_at: float | None = None
        #: The request whose answer the engine is making now, on an engine that runs one at a
        #: time; and the one sent to the engine ahead of its turn behind it, if any.
        self._at_engine: StrataRequest | None = None
        self._ahead: StrataRequest | None = None
        #: What the request at the engine has been answered so far (its HTTP status once the
        #: engine began its answer).
        self._at_engine_outcome: Outcome | None = None
        #: The requests waiting in line that the turn before may send ahead, by their place.
        self._in_line: dict[asyncio.Future[int], InLine] = {}
        self.closing = False
        self.started_at = time.time()
        self._tasks: set[asyncio.Task] = set()
        self._idle_work: set[IdleWork] = set()
        self._plugin_configs: dict[str, BaseModel] = {}
        #: Set by :meth:`stop_now`: a stop waits for nothing more.
        self._now = asyncio.Event()
        #: ``on_shutdown`` ran to its end: whatever was worth a file is saved.
        self._saved_at_stop = False
        self._unsaved_logged = False

    def plugin_config(self, name: str, model: type[M]) -> M:
        """``plugins.<name>`` validated into ``model``, once per server (then cached).

        For hooks that run on every request; ``on_config`` has refused a bad section
        before the start, with :meth:`Settings.plugin_config`.
        """
        cached = self._plugin_configs.get(name)
        if not isinstance(cached, model):
            cached = self._plugin_configs[name] = self.settings.plugin_config(name, model)
        return cached

    def choose_slot(self, claim: Claim, free: list[int]) -> int | None:
        """The slot for ``claim`` among the ``free`` ones (None: wait): :func:`strata_serve.slot_choice.choose_slot`."""
        return choose_slot(self.slots, claim, free)

    def conversation_key(self, request: StrataRequest) -> str | None:
        """The key of ``request``'s conversation (:func:`strata_serve.keying.choose_key`: the
        ``conversation_key`` hook asked, its answer checked and namespaced by tenant), or None;
        whether it names one conversation is recorded as ``request.conversation_named``.

        :raises KeyRefused: when a keying plugin refuses the request's input, or
            its key contains ``--``.
        """
        answer = choose_key(self.pm, request, self, order=self.settings.server.conversation_key_order)
        request.conversation_named = answer is not None and answer.named
        return None if answer is None else answer.key

    def tokens_ahead(self, request: StrataRequest) -> None:
        """Ask the engine now, beside the FIFO, which tokens ``request``'s prompt becomes
        (:mod:`strata_serve.tokens_ahead`): for a plugin's ``on_arrival``, when its own step
        for the request will want them (:meth:`prompt_tokens`)."""
        tokens_ahead.start(self.engine, request)

    async def prompt_tokens(self, request: StrataRequest) -> list[int] | None:
        """The tokens ``request``'s prompt becomes as the engine reads it, asked once per
        request (the answer :meth:`tokens_ahead` asked for, or asked now); None when the
        engine cannot tell. Raises the engine's ``EngineError`` or ``EngineUnavailable``."""
        return await tokens_ahead.prompt_tokens(self.engine, request)

    def verdict(
        self, op: str, error: EngineError | None, held_tokens: int | None = None
    ) -> Verdict | None:
        """Ask the quirk plugins what an engine failure (or a planned call) means."""
        result = first_result(
            self.pm, "engine_verdict", op=op, error=error, engine=self.engine, held_tokens=held_tokens,
            service=self,
        )
        if result is None:
            return None
        try:
            return Verdict(result)
        except ValueError:
            log.error("[strata] ignoring engine verdict %r for %s: not a strata_serve.Verdict", result, op)
            return None

    async def process(
        self, request: StrataRequest, send: Callable[[Outcome], Awaitable[None]],
        deliver: Callable[[], Awaitable[None]] | None = None,
    ) -> Outcome:
        """Run one request through the FIFO: ``pre_request``, ``send``, ``post_request``.

        ``send`` forwards to the engine and fills in the outcome as it learns it.
        ``deliver``, when given, hands a complete answer to the client once ``send``
        succeeded and the slot's picture is updated, before ``post_request``: the
        client does not wait for the plugins' work after its answer (a stream's answer
        is complete when ``send`` returns). The plugin steps around it run to their end
        even when the client goes away meanwhile: a save cut in half would leave a
        temporary file and a wrong picture of the slot. ``post_request`` runs for every
        request that got its turn.

        :raises QueueFull: when the line is full.
        :raises ShuttingDown: when the server is stopping.
        """
        if self.closing:
            raise ShuttingDown()
        task = asyncio.current_task()
        if task is not None:
            self._tasks.add(task)
        arrived = time.perf_counter()
        call_each_sync(self.pm, "on_arrival", request=request, service=self)
        try:
            with timeline_of(request.timeline):
                return await self._process(request, send, deliver, arrived)
        finally:
            self.phases.add(request.timeline)
            if task is not None:
                self._tasks.discard(task)

    async def _process(self, request: StrataRequest, send: Callable[[Outcome], Awaitable[None]],
                       deliver: Callable[[], Awaitable[None]] | None, arrived: float) -> Outcome:
        lane = self.side_lane
        claim = claim_for(request, self.engine, len(self.slots), one_at_a_time=lane)
        request.pinned = claim.pinned
        ahead = self._sent_ahead(request, claim, send)
        if ahead is not None:
            # At the engine already: the request keeps its turn to its end, whatever its client
            # does meanwhile (the slot's picture and the plugins' steps must see it through).
            return await _shielded(self._turn(request, claim, send, deliver, arrived, ahead))
        if len(self.slots) == 1 and not self.fifo.idle and not self.closing:
            return await self._wait_in_line(request, claim, send, deliver, arrived)
        return await self._turn(request, claim, send, deliver, arrived, None)

    async def _wait_in_line(self, request: StrataRequest, claim: Claim, send: Callable[[Outcome], Awaitable[None]],
                            deliver: Callable[[], Awaitable[None]] | None, arrived: float) -> Outcome:
        """A request that waits for its turn behind others, on an engine that runs one at a
        time: the request before it may send it to the engine ahead of its turn
        (:meth:`_send_next_ahead`). Until then, its client leaving takes it out of the line;
        once sent, its turn runs to its end as one sent ahead at its arrival does."""
        place = self.fifo.line_up(claim)
        in_line = self._in_line[place] = InLine(request, send, place)
        # Its turn is a task from here: whatever happens below, the place it took is used and given back.
        turn = asyncio.ensure_future(self._turn(request, claim, send, deliver, arrived, None, in_line))

        def not_sent() -> bool:
            if in_line.ahead is not None:
                return False
            in_line.closed = True  # cancelled before it was sent: it never goes
            return True

        try:
            self._send_next_ahead()  # it may be first in line behind an answer begun already
            return await _shielded(turn, unless=not_sent)
        finally:
            in_line.closed = True
            self._in_line.pop(place, None)

    def answer_began(self) -> None:
        """The engine began its answer to the request at the engine (an API's relay says so
        once the answer's status is known): the next in line may be sent to it now."""
        self._send_next_ahead()

    def _send_next_ahead(self) -> None:
        """The first request in line sent to the engine ahead of its turn, as one that arrives
        when no one waits is (:meth:`_sent_ahead`), once the engine has begun its answer to
        the request before it: it has that request then, and runs the two in order."""
        at_engine = self._at_engine_outcome
        if (at_engine is None or at_engine.http_status != 200 or len(self.slots) != 1
                or self._ahead is not None or self.closing or not self.engine.ready):
            return
        head = self.fifo.head()
        in_line = self._in_line.get(head) if head is not None else None
        if in_line is None or in_line.closed or not may_go_ahead(self.pm, in_line.request, self.slots[0], self):
            return
        in_line.ahead = self._send_ahead(in_line.request, in_line.send, in_line.place)

    def _sent_ahead(self, request: StrataRequest, claim: Claim,
                    send: Callable[[Outcome], Awaitable[None]]) -> Ahead | None:
        """``request`` sent to the engine before its turn, when it needs no switch
        (:func:`strata_serve.ahead.may_go_ahead`): an engine that runs one request at a
        time, the answer before it at the engine, no one else waiting, and every plugin
        that acts around requests agreeing. The engine runs it after that answer."""
        if (len(self.slots) != 1 or self._at_engine is None or self._ahead is not None or self.closing
                or self.fifo.waiting or not self.engine.ready):
            return None
        if not may_go_ahead(self.pm, request, self.slots[0], self):
            return None
        return self._send_ahead(request, send, self.fifo.line_up(claim))  # its place, from now: no one passes it

    def _send_ahead(self, request: StrataRequest, send: Callable[[Outcome], Awaitable[None]],
                    place: asyncio.Future[int]) -> Ahead:
        """Send ``request``, which holds ``place`` in the line, to the engine now."""
        request.slot, request.sent_ahead = 0, True
        self._ahead = request
        outcome = Outcome(status="error", error="not sent")
        log.debug("[strata] request %d goes to the engine ahead of its turn (request %d is answering)",
                  request.id, self._at_engine.id if self._at_engine is not None else -1)
        return Ahead(outcome, asyncio.ensure_future(send(outcome)), place)

    async def _turn(self, request: StrataRequest, claim: Claim, send: Callable[[Outcome], Awaitable[None]],
                    deliver: Callable[[], Awaitable[None]] | None, arrived: float, ahead: Ahead | None,
                    in_line: InLine | None = None) -> Outcome:
        multi = len(self.slots) > 1
        lane = self.side_lane
        timeline = request.timeline
        place = ahead.place if ahead is not None else in_line.place if in_line is not None else None
        async with self.fifo.hold(claim, lined_up=place) as granted:
            if in_line is not None:
                in_line.closed = True
                ahead = in_line.ahead
            timeline.add("queue", (time.perf_counter() - arrived) * 1000)
            with span("ready"):
                limit = await self._ready_and_placed(request, granted, ahead, multi)
            if multi and request.pinned:
                request.body["id_slot"] = request.slot  # the engine runs it in the slot chosen here
            began = time.monotonic()
            outcome = Outcome(status="error", error="not sent") if ahead is None else ahead.outcome
            try:
                with span("pre_request"):
                    await _shielded(broadcast(self.pm, "pre_request", request=request, service=self))
                    # A request the engine places itself: what each slot last ran, to tell after
                    # which slots it used.
                    tasks_before = await last_tasks(self.engine, len(self.slots)) if not request.pinned else None
            except asyncio.CancelledError:
                if ahead is not None:  # never: a request sent ahead is shielded
                    self._ahead = None
                    await asyncio.wait({ahead.task})
                else:
                    outcome.status, outcome.error = "cancelled", "the client went away before the engine was asked"
                await _shielded(self._post(request, outcome, began))
                raise
            if limit is not None and bound_generation(request, limit):
                # After the plugins' steps, which may change the body: the bound holds.
                log.info("[strata] request %d runs in the side slot: its generation is bounded to %d tokens",
                         request.id, limit)
            before = self._sent(request)
            one_line = lane or not multi
            if (one_line and ahead is None and self._line_free_at is not None
                    and arrived <= self._line_free_at):
                # It waited for the engine's previous answer: from that answer's end until now
                # the engine stood idle, for strata-serve's work between the two.
                timeline.add("gap", (time.perf_counter() - self._line_free_at) * 1000)
            sent = False
            self._ahead, self._at_engine, self._at_engine_outcome = None, request, outcome
            if ahead is not None:
                self._send_next_ahead()  # its answer may have begun already
            try:
                await (send(outcome) if ahead is None else ahead.task)
                sent = True
            except asyncio.CancelledError:
                outcome.status = "cancelled"
                outcome.error = outcome.error if self.closing else "the client went away"
                raise
            except Exception as exc:
                outcome.status = "error"
                outcome.error = str(exc)
                raise
            finally:
                self._at_engine = self._at_engine_outcome = None
                if one_line:
                    self._line_free_at = time.perf_counter()
                self._answered(request, outcome, before)
                if not request.pinned:
                    found = await _shielded(locate(self.engine, self.slots, tasks_before))
                    request.slot = self.slots.located(request.slot, found)
                if lane:
                    self._after_in_lane(request)
                try:
                    if sent and deliver is not None:
                        await deliver()
                finally:
                    with span("post_request"):
                        await _shielded(self._post(request, outcome, began))
            return outcome

    async def _ready_and_placed(self, request: StrataRequest, granted: int, ahead: Ahead | None,
                                multi: bool) -> int | None:
        """The engine ready for ``request`` and its slot chosen; returned, the most it may
        generate there (None: no bound of ours)."""
        try:
            await self._ready_to_act(multi)
        except BaseException:
            if ahead is not None:
                # Sent, never recorded: what the slot holds now is nobody's to name.
                self._ahead = None
                await asyncio.wait({ahead.task})
                _ = ahead.task.cancelled() or ahead.task.exception()  # its failure is this one's
                self.slots.unknown(request.slot, nameable=False)
            raise
        if self.side_lane:
            return await self._place_in_lane(request)
        request.slot = slot_for(self.slots, request, granted)
        return None

    async def _place_in_lane(self, request: StrataRequest) -> int | None:
        """The main slot or the side slot for ``request`` (:func:`strata_serve.side_lane.choose_lane`):
        its slot is set; returned, the most it may generate there (None: no bound of ours)."""
        if any(state.tokens is None for state in self.slots):
            await self.check_slots()  # the room beside the main slot is counted, never guessed
        request.slot, limit = choose_lane(self.settings.engine, self.slots, request)
        return limit

    def _after_in_lane(self, request: StrataRequest) -> None:
        """After a request in the main slot: the engine may have emptied the idle side slot to
        make room, when the side slot held more than ``side_slot_tokens`` (a side request
        that fit beside a short main conversation): its count is asked again when it matters."""
        if request.slot != MAIN:
            return
        engine = self.settings.engine
        main, side = self.slots[MAIN].tokens, self.slots[SIDE].tokens
        if main is None or side is None or side > engine.side_slot_tokens or main + side > pool_tokens(engine):
            self.slots.unknown(SIDE)

    async def _ready_to_act(self, multi: bool) -> None:
        """Once a turn is granted: the engine up, the registry of its generation and, where
        the engine may have emptied idle slots itself, checked against it."""
        await self.engine.wait_ready()
        self.sync_generation()
        if multi and self.engine.info.clears_idle_slots is not False:
            await self.check_slots()

    async def _post(self, request: StrataRequest, outcome: Outcome, began: float) -> None:
        outcome.duration_ms = (time.monotonic() - began) * 1000
        await broadcast(self.pm, "post_request", request=request, outcome=outcome, service=self)

    async def slot_action(
        self, slot: int, action: Literal["save", "restore", "erase"], filename: str | None = None, *,
        tenant: str | None = None,
    ) -> SlotSaved | SlotRestored | SlotErased:
        """A slot action by hand (``POST /slots/{id}``): save, restore or erase one slot.

        It holds that slot alone (other slots keep serving), and is no request: the
        ``pre_slot_action`` hooks run first (a plugin parks the conversation the slot
        holds before it is replaced; strict tenant isolation erases another tenant's
        state), then the call, recorded in :attr:`slots` like every slot call made
        through the service, then ``post_slot_action``; both run to their end even if
        the client goes away. A restored file is ``tenant``'s, by hand: the slot holds
        nothing nameable.

        :returns: the engine's answer.
        :raises QueueFull: when the line is full.
        :raises ShuttingDown: when the server is stopping.
        :raises EngineError: when the engine refused the call.
        """
        if self.closing:
            raise ShuttingDown()
        task = asyncio.current_task()
        if task is not None:
            self._tasks.add(task)
        hook: dict[str, Any] = {"slot": slot, "action": action, "tenant": tenant, "service": self}
        try:
            async with self.fifo.hold(Claim(slot=slot)):
                await self._ready_to_act(len(self.slots) > 1)
                try:
                    await _shielded(broadcast(self.pm, "pre_slot_action", **hook))
                    if action == "save":
                        assert filename is not None
                        return await self.save_slot(filename, slot=slot)
                    if action == "restore":
                        assert filename is not None
                        return await self.restore_slot(filename, slot=slot, tenant=tenant)
                    return await self.erase_slot(slot)
                finally:
                    await _shielded(broadcast(self.pm, "post_slot_action", **hook))
        finally:
            if task is not None:
                self._tasks.discard(task)

    # -- the life cycle ---------------------------------------------------------------

    async def start(self) -> None:
        """Start the engine, then tell the plugins, before any request is let through.

        The order, documented in :mod:`strata_serve.hookspecs`: the engine is up (its
        ``info`` read), ``on_startup`` once, ``on_engine_start(restarted=False)``; after
        every later restart of the engine, ``on_engine_start(restarted=True)``.

        :raises ConfigError: when a plugin refuses the start in ``on_startup`` (the
            engine is stopped again).
        """
        try:
            await self.engine.start()
        except ConfigError:
            await self.engine.stop()  # never leave an engine behind a refused start
            raise

    async def _engine_started(self, restarted: bool) -> None:
        self._size_slots()
        self.sync_generation()
        if not self._started:
            self._started = True
            await broadcast(self.pm, "on_startup", service=self, passthrough=(ConfigError,))
        await broadcast(self.pm, "on_engine_start", service=self, restarted=restarted)

    async def stop(self) -> None:
        """A normal stop: drain, ``on_shutdown`` (FIFO held, engine up), then the engine stops."""
        try:
            await self.shutdown()
        finally:
            await self.engine.stop()

    def _size_slots(self) -> None:
        """As many slots as the engine runs (an attached engine says how many in ``/props``).

        Strict tenant isolation uses one: the engine would choose among the others by
        their contents. A change is logged; the picture of the slots starts anew.
        """
        n = max(1, self.engine.info.parallel or self.settings.engine.engine_slots)
        if self.settings.server.tenant_isolation == "strict":
            n = 1
        if n != len(self.slots):
            log.info("[strata] the engine runs %d slot(s); requests go to %d at a time", n, n)
            self.slots = SlotRegistry.for_engine(n)
            self.fifo.resize(n)

    def when_idle(self, delay_s: float, work: Callable[[], Awaitable[Any]], *, name: str,
                  slot: int | None = None) -> IdleWork:
        """Run ``work`` once the service has been idle for ``delay_s``, holding the FIFO.

        With ``slot``, once that slot has been idle for ``delay_s`` (others may be
        busy), holding that slot only.

        The sanctioned way for a plugin to use quiet time (auto-sessions saves the held
        conversation this way): a request that arrives while ``work`` runs waits for it;
        one that arrives before it starts comes first (it is not started if the service
        is busy then). Cancel the returned handle when the work is no longer wanted. A
        normal stop cancels work that has not started and waits for work that has.
        A failure is logged with ``name``.
        """
        idle = IdleWork(self.fifo, delay_s, work, name, slot, closing=lambda: self.closing,
                        finished=self._idle_work.discard)
        self._idle_work.add(idle)
        return idle

    # -- the picture of the slots ------------------------------------------------------

    def _sent(self, request: StrataRequest) -> SlotState:
        held = self.slots[request.slot]
        request.found_in_slot = (request.conversation_key is not None and held.key == request.conversation_key
                                 and held.tenant == request.tenant and not held.empty)
        request.state_source = state_source(request, None)
        key = request.conversation_key
        if key is not None:
            for other in self.slots:
                if other.id != request.slot and other.key == key and other.tenant == request.tenant:
                    # It moved (out of the side slot, which it outgrew): one conversation, one slot.
                    self.slots.unknown(other.id, nameable=False)
        return self.slots.sent(request.slot, request)

    def _answered(self, request: StrataRequest, outcome: Outcome, before: SlotState) -> None:
        """Record what the slot holds now that the engine's answer ended, however it ended."""
        if outcome.timings is not None:
            self.measures.answered(outcome.timings)
            request.state_source = state_source(request, outcome.timings)
        if self.engine.generation != before.generation:
            self.sync_generation()  # the engine died during the request: its slots are gone
            if outcome.timings is not None:
                # Answered all the same: the request waited for the restarted engine (it died
                # during a plugin's step, a save it was writing), or the old one answered just
                # before it died. The slot holds the request's conversation or nothing, as
                # the engine will say when it matters.
                self.slots.sent(request.slot, request)
        elif outcome.timings is not None:
            self.slots.finished(request.slot, tokens_after(outcome.timings))
        elif outcome.http_status is not None and 400 <= outcome.http_status < 500:
            self.slots.untouched(request.slot, before)  # refused before it touched the slot
        elif outcome.error == "not sent":
            self.slots.untouched(request.slot, before)
        else:
            self.slots.finished(request.slot, None)  # cut off: ask the engine when it matters


async def _shielded(step: Awaitable[Any], unless: Callable[[], bool] | None = None) -> Any:
    """Await ``step`` shielded: it runs to its end even if the awaiting task is cancelled meanwhile.

    The cancel is re-raised once the step has finished. ``unless``, asked at a cancel:
    True cancels the step after all (the cancel is raised once it has ended).
    """
    inner = asyncio.ensure_future(step)
    cancelled = False
    while True:
        try:
            result = await asyncio.shield(inner)
            break
        except asyncio.CancelledError:
            if inner.done():
                raise
            if unless is not None and unless():
                inner.cancel()
                await asyncio.wait({inner})
                _ = inner.cancelled() or inner.exception()  # its failure is the cancel's
                raise
            cancelled = True
    if cancelled:
        raise asyncio.CancelledError()
    return result
