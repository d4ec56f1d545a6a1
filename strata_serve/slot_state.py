"""One picture of what each engine slot holds, owned by the core.

One writer: the service (``service.py``, its slot calls in ``slot_calls.py``) alone calls the recording methods of
:class:`SlotRegistry`. Every request that reaches the engine is recorded here by it,
whatever its client did afterwards (read to the end, closed the stream after the last
event, went away mid-prefill); every slot call (save, restore, erase) made through the
service is recorded too, and so is where the engine ran a request it placed itself
(:func:`strata_serve.slot_choice.locate` answers, the service records it with
:meth:`SlotRegistry.located`). The facts only the plugin whose files they are knows go
through four named methods of its own (``file_written``, ``file_gone``, ``nothing_durable``,
``holds_sibling``). Everyone reads this picture; no plugin keeps a model of the
engine's slots of its own. ``tests/test_layers.py`` holds the code to this.

Where the picture is not sure (a request that was cut off, an error), it says so
(``tokens is None``) and the service asks the engine (``Engine.slots``) the next time
the answer matters.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from strata_serve.hook_types import Timings

if TYPE_CHECKING:
    from strata_serve.engine.base import SlotReport

log = logging.getLogger("strata_serve.slots")


@dataclass
class SlotState:
    """What one slot holds."""

    id: int
    #: The conversation whose state the slot holds; None when it holds nothing nameable
    #: (empty, a request without a conversation key, or changed by hand).
    key: str | None = None
    #: The tenant of the request that last ran in the slot (None: no tenants, or empty).
    tenant: str | None = None
    #: Tokens the slot holds (prompt plus generated); 0 when empty, None when not known
    #: (a request was cut off): the service asks the engine, whose count the registry
    #: adopts (:meth:`SlotRegistry.adopt_engine_counts`).
    tokens: int | None = 0
    #: True while the conversation's own file equals what the slot holds (saved or
    #: restored since the last request changed the slot).
    file_current: bool = False
    #: The engine generation this record belongs to; an older one describes a dead engine.
    generation: int = 0
    #: The id of the last request that ran in the slot.
    last_request: int | None = None
    #: When (``time.time()``) the slot began holding this conversation's state: its first
    #: request here since the slot held something else, or the restore it continues.
    #: None when it holds nothing nameable. A removal by hand (``strata-serve sessions
    #: rm``) made since then is about this state.
    since: float | None = None
    #: Which of the conversations parked under ``key`` the slot holds: several clients
    #: without ids share one key, and the plugin whose files they are keeps one file for
    #: each (auto-sessions' siblings) and says which here (:meth:`SlotRegistry.holds_sibling`).
    #: 0 whenever the key changes.
    sibling: int = 0

    @property
    def empty(self) -> bool:
        return self.tokens == 0


@dataclass(frozen=True)
class Located:
    """Where the engine ran a request it placed itself, as its slot reports say
    (:func:`strata_serve.slot_choice.locate`)."""

    #: The engine's slot reports; None when it could not be asked.
    reports: list[SlotReport] | None
    #: The slot calls' counts before the reports were asked for (:meth:`SlotRegistry.actions`).
    actions: dict[int, int]
    #: The slot whose last task is the newest: it ran the request (None: not known).
    ran: int | None = None
    #: The other slots whose last task changed meanwhile: each ran part of it.
    touched: frozenset[int] = frozenset()


@dataclass
class SlotRegistry:
    """What each slot of one engine holds, by id: the core's record, written through the
    methods below (the service is the only caller of those it records with; the plugin
    whose files they are calls the three of its own) and read by everyone."""

    slots: list[SlotState] = field(default_factory=lambda: [SlotState(0)])
    #: Checks against the engine that found the picture wrong (each is logged).
    corrections: int = 0
    #: Per slot, a count bumped as a slot call (save, restore, erase) starts and as it
    #: ends, and the calls in flight (:meth:`acting`).
    _actions: dict[int, int] = field(default_factory=dict, repr=False)
    _in_flight: dict[int, int] = field(default_factory=dict, repr=False)

    @classmethod
    def for_engine(cls, parallel: int) -> SlotRegistry:
        return cls([SlotState(n) for n in range(max(1, parallel))])

    def __getitem__(self, slot: int) -> SlotState:
        return self.slots[slot]

    def __iter__(self):
        return iter(self.slots)

    def __len__(self) -> int:
        return len(self.slots)

    # -- what the service records ----------------------------------------------------

    def engine_started(self, generation: int) -> None:
        """A new engine process: every slot is empty."""
        for n, slot in enumerate(self.slots):
            self.slots[n] = SlotState(slot.id, generation=generation)

    def sent(self, slot: int, request: Any) -> SlotState:
        """A request is going to the engine: the slot will hold its conversation.

        :returns: the record as it was before, for :meth:`untouched`.
        """
        before = replace(self.slots[slot])
        state = self.slots[slot]
        if state.key != request.conversation_key or state.tenant != request.tenant or state.empty:
            state.since = time.time() if request.conversation_key is not None else None
        if state.key != request.conversation_key or state.tenant != request.tenant:
            state.sibling = 0
        state.key, state.tenant = request.conversation_key, request.tenant
        state.tokens = None  # known once the engine says
        state.file_current = False
        state.last_request = request.id
        return before

    def finished(self, slot: int, tokens: int | None) -> None:
        """The engine's answer ended; ``tokens`` the slot now holds, None if not known."""
        self.slots[slot].tokens = tokens

    def untouched(self, slot: int, before: SlotState) -> None:
        """The engine refused the request before touching the slot (a 4xx): as it was."""
        self.slots[slot] = before

    def saved(self, slot: int, tokens: int) -> None:
        """The slot was saved: the engine counted what it holds (0: it was empty, and holds
        nothing nameable). (The plugin whose file it was records it with
        :meth:`file_written` once the file is in place under its name.)"""
        if tokens == 0:
            self.emptied(slot)
        else:
            self.slots[slot].tokens = tokens

    def restored(self, slot: int, key: str | None, tenant: str | None, tokens: int,
                 *, from_own_file: bool, sibling: int = 0) -> None:
        """A file was loaded into the slot: it now holds ``key`` (None: a file by hand), its
        ``sibling``."""
        state = self.slots[slot]
        state.key, state.tenant, state.tokens = key, tenant, tokens
        state.sibling = sibling if key is not None else 0
        state.file_current = from_own_file and key is not None
        state.since = time.time() if key is not None else None

    def moved(self, slot: int, to: int) -> None:
        """The engine ran the request recorded in ``slot`` in slot ``to`` instead."""
        here, there = self.slots[slot], self.slots[to]
        there.key, there.tenant, there.tokens = here.key, here.tenant, here.tokens
        there.file_current, there.last_request, there.since = False, here.last_request, here.since
        there.sibling, here.sibling = here.sibling, 0
        here.key = here.tenant = here.since = None  # whatever it holds, it is no longer that conversation's
        here.tokens, here.file_current = None, False  # counted by the engine's answer

    def located(self, recorded: int, found: Located) -> int:
        """Where the engine ran the request recorded in slot ``recorded`` (it placed it
        itself): its record moves to the slot that ran it (a conversation is never
        recorded in two), the slots that ran part of it hold nothing nameable, and the
        engine's counts are taken. Not known (the engine did not answer): no slot's name
        can be trusted.

        :returns: the slot that ran it (``recorded`` when not known).
        """
        if found.reports is None:
            for slot in range(len(self.slots)):
                self.unknown(slot, nameable=False)
            return recorded
        ran = recorded if found.ran is None else found.ran
        if ran != recorded:
            self.moved(recorded, ran)
        for slot in sorted(found.touched):
            if self.slots[slot].key is not None:
                log.info("[strata] slot %d ran part of request %s: it no longer holds %s",
                         slot, self.slots[ran].last_request, self.slots[slot].key)
                self.unknown(slot, nameable=False)
        self.adopt_engine_counts(found.reports, found.actions)
        return ran

    def emptied(self, slot: int) -> None:
        """Erased, or a failed restore that may have cleared it."""
        state = self.slots[slot]
        state.key, state.tenant, state.tokens, state.file_current, state.since = None, None, 0, False, None
        state.sibling = 0

    def unknown(self, slot: int, *, nameable: bool = True) -> None:
        """Something happened to the slot that cannot be counted (a failed call); with
        ``nameable=False`` what it holds cannot be named either (a failed restore)."""
        state = self.slots[slot]
        state.tokens = None
        state.file_current = False
        if not nameable:
            state.key = state.tenant = state.since = None
            state.sibling = 0

    # -- what the plugin whose files they are records ------------------------------------

    def file_written(self, slot: int, key: str) -> None:
        """``key``'s own file now holds what the slot holds (a save of it is in place under
        its name): current, while the slot still holds that conversation."""
        state = self.slots[slot]
        if state.key == key:
            state.file_current = True

    def holds_sibling(self, slot: int, key: str, sibling: int) -> None:
        """The slot's conversation ``key`` is its plugin's sibling ``sibling`` (one of
        several conversations parked under one key). Another sibling than the one recorded
        has no file current: its file is another conversation's."""
        state = self.slots[slot]
        if state.key == key and state.sibling != sibling:
            state.sibling = sibling
            state.file_current = False

    def nothing_durable(self, slot: int) -> None:
        """The slot holds nothing worth keeping (the engine's quirks said its state is
        provisional: a cancelled request's, which the engine refuses to save): restoring
        over it loses nothing, and it holds nothing nameable."""
        self.emptied(slot)

    def file_gone(self, slot: int) -> None:
        """The file that was current for the slot's conversation is gone (removed since):
        the slot holds the only copy."""
        self.slots[slot].file_current = False

    # -- the engine's word -------------------------------------------------------------

    @contextlib.contextmanager
    def acting(self, slot: int) -> Iterator[None]:
        """A slot call (save, restore, erase) is in flight on ``slot``: a report of the
        engine's slots read meanwhile may show its effect before the call's own record."""
        self._actions[slot] = self._actions.get(slot, 0) + 1
        self._in_flight[slot] = self._in_flight.get(slot, 0) + 1
        try:
            yield
        finally:
            self._actions[slot] += 1
            self._in_flight[slot] -= 1

    def actions(self) -> dict[int, int]:
        """The slot calls' counts now: taken before asking the engine about its slots, for
        :meth:`adopt_engine_counts`."""
        return dict(self._actions)

    def adopt_engine_counts(self, reports: list[SlotReport], actions_before: dict[int, int] | None = None) -> None:
        """Take the engine's token counts from its slot reports, where ours differ or are unknown.

        The engine cannot name conversations, only count tokens: a count that differs
        from ours (or ours unknown) is replaced by the engine's, and a slot the engine
        reports empty is empty whatever we thought. A slot the engine is still working
        in has no final count: it is marked unknown. With ``actions_before`` (from
        :meth:`actions`, taken before the reports were asked for), a slot that had a slot
        call in flight at any time since is left to that call's own record: the report
        may show the slot before the call, or after it and before the call's record.
        """
        for report in reports:
            if not 0 <= report.id < len(self.slots):
                continue
            if actions_before is not None and (self._in_flight.get(report.id, 0)
                                               or self._actions.get(report.id, 0) != actions_before.get(report.id, 0)):
                continue  # a call began or ended since the read was asked for, or runs still
            state = self.slots[report.id]
            if report.processing:
                # Still at work (on a request whose client left, the engine goes on until
                # it notices): its count is not final. Asked again when it matters.
                state.tokens = None
                continue
            tokens = report.tokens
            if tokens is None:
                continue
            if state.tokens is not None and state.tokens != tokens:
                self.corrections += 1
                log.info("[strata] slot %d: the engine holds %d tokens, not %d as recorded; taking its count",
                         state.id, tokens, state.tokens)
            state.tokens = tokens
            if tokens == 0:
                state.key, state.tenant, state.file_current, state.since = None, None, False, None
                state.sibling = 0


def tokens_after(timings: Timings) -> int:
    """Tokens a slot holds after a request with these ``timings``.

    The prompt (reused plus prefilled) and the tokens generated, except the last one:
    it was sampled, never fed back through the model.
    """
    return timings.prompt_tokens + max(timings.generated - 1, 0)
