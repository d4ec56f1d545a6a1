"""A stop: new requests refused, those in flight drained, then ``on_shutdown``, each bounded;
and a stop at once, on a second signal."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import replace
from typing import Any
from collections.abc import Awaitable, Callable

import pluggy

from strata_serve.config import Settings
from strata_serve.engine.base import Engine
from strata_serve.fifo import ServiceFIFO
from strata_serve.hook_calls import broadcast
from strata_serve.slot_state import SlotRegistry, SlotState

log = logging.getLogger("strata_serve.service")

#: How long work cut off by a stop is given to unwind before the stop goes on without it.
CUT_UNWIND_S = 2.0


class Stopping:
    """How :class:`~strata_serve.Service` stops (it is one of its bases: these are its attributes)."""

    settings: Settings
    pm: pluggy.PluginManager
    engine: Engine
    fifo: ServiceFIFO
    slots: SlotRegistry
    closing: bool
    #: The requests and slot actions under way.
    _tasks: set[asyncio.Task]
    #: Plugins' work waiting for quiet (``Service.when_idle``): each has ``cancel()``.
    _idle_work: set[Any]
    #: Set by :meth:`stop_now`: a stop waits for nothing more.
    _now: asyncio.Event
    #: ``on_shutdown`` ran to its end: whatever was worth a file is saved.
    _saved_at_stop: bool
    _unsaved_logged: bool

    async def shutdown(self) -> None:
        """Stop taking requests, let the ones in flight finish, then ``on_shutdown``: each bounded.

        Requests have ``server.shutdown_grace_s``, then are cut off; their last steps
        and ``on_shutdown`` (auto-sessions' saves) have ``server.shutdown_save_s``, then
        are cut off too, and the conversations the engine held that no file keeps are
        logged by name. :meth:`stop_now` cuts whatever still runs at once.
        """
        if self.closing:
            return
        self.closing = True
        for idle in list(self._idle_work):
            idle.cancel()  # not started: never will; running: finishes before the FIFO is ours
        grace = self.settings.server.shutdown_grace_s
        if not self.fifo.idle and not await self._within(self.fifo.wait_idle(), grace):
            if not self._now.is_set():
                log.warning("[strata] %d request(s) still running after %g s; cutting them off",
                            len(self._tasks), grace)
            for task in list(self._tasks):
                task.cancel()
        # Take the FIFO in turn, behind whatever started before the stop. A plugin's task
        # created just before it (a save while idle) has not asked for the FIFO yet, and
        # on_shutdown may wait for that task: taken first, the FIFO would never be its.
        # One turn of the loop lets every task already started ask. (Up to Python 3.11
        # wait_for always gave that turn; since 3.12 it returns at once when idle.)
        await asyncio.sleep(0)
        bound = self.settings.server.shutdown_save_s

        def saves_cut() -> None:
            if not self._now.is_set():
                # The engine does not answer (hung, or deep in swap): waiting on saves nothing.
                log.warning("[strata] the stop's saves did not finish in %g s (server.shutdown_save_s); "
                            "stopping without them", bound)
                self._log_unsaved()

        self._saved_at_stop = await self._within(self._on_shutdown(), bound, before_cut=saves_cut)

    async def _on_shutdown(self) -> None:
        async with self.fifo.hold(exclusive=True):
            await broadcast(self.pm, "on_shutdown", service=self)

    async def _within(self, step: Awaitable[Any], timeout: float,
                      before_cut: Callable[[], None] | None = None) -> bool:
        """Await ``step`` for at most ``timeout`` seconds, or until :meth:`stop_now`.

        :returns: True when it finished; otherwise ``before_cut`` is called, ``step``
            cancelled (and given a moment to unwind), and False.
        """
        task = asyncio.ensure_future(step)
        now = asyncio.ensure_future(self._now.wait())
        try:
            await asyncio.wait({task, now}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            now.cancel()
        if task.done():
            task.result()
            return True
        if before_cut is not None:
            before_cut()
        task.cancel()
        await asyncio.wait({task}, timeout=CUT_UNWIND_S)
        return False

    def stop_now(self) -> None:
        """Stop at once (a second signal during a stop): nothing more is waited for.

        Requests and saves still running are cut off, the engine is killed (its
        backend's ``kill``), and each conversation it held that no file keeps is
        logged by name. Before a stop began, the stop that follows takes no time.
        """
        if self._now.is_set():
            return
        self._now.set()
        log.warning("[strata] stopping now: requests and saves still running are cut off")
        if not self._saved_at_stop:
            self._log_unsaved()  # before the kill: a call it fails may leave the picture unsure
        kill = getattr(self.engine, "kill", None)
        if kill is not None:
            kill()

    def _unsaved_slots(self) -> list[SlotState]:
        """The slots holding a named conversation that no file keeps as it is now."""
        return [replace(state) for state in self.slots
                if state.key is not None and not state.empty and not state.file_current]

    def _log_unsaved(self) -> None:
        """Name, once, each conversation a cut-short stop leaves unsaved."""
        if self._unsaved_logged:
            return
        self._unsaved_logged = True
        for state in self._unsaved_slots():
            tokens = "tokens not known" if state.tokens is None else f"{state.tokens:,} tokens"
            log.warning("[strata] not saved: conversation %s (slot %d, %s): its state is lost with the engine",
                        state.key, state.id, tokens)
