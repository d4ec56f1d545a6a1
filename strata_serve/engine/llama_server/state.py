"""Whether the engine is up and ready, and waiting until it is."""

from __future__ import annotations

import asyncio
import contextlib

from strata_serve.engine.base import EngineUnavailable


class EngineState:
    """The engine's state as calls and requests see it; every change wakes whoever waits.

    Up: the current process answered ``/health``, calls may go to it. Ready: up, and the
    start hooks have run, requests are let through. Down: no start is under way, and
    whoever waits is told why at once.
    """

    def __init__(self, start_timeout_s: float):
        self.start_timeout_s = start_timeout_s
        self.up = asyncio.Event()
        self.ready = asyncio.Event()
        #: Why the engine is down while no start is under way, or None.
        self.down: EngineUnavailable | None = None
        self.stopping = False
        #: Set (and replaced) at every change, to wake whoever waits.
        self._changed = asyncio.Event()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    def set_up(self) -> None:
        self.down = None
        self.up.set()
        self._notify()

    def set_ready(self) -> None:
        self.ready.set()
        self._notify()

    def set_lost(self) -> None:
        self.up.clear()
        self.ready.clear()
        self._notify()

    def set_down(self, reason: EngineUnavailable) -> None:
        """Down, with no start under way: whoever waits for the engine is told at once."""
        self.down = reason
        self.set_lost()

    def set_starting(self) -> None:
        self.down = None
        self._notify()

    def set_stopping(self) -> None:
        self.stopping = True
        self.set_lost()

    async def wait_up(self) -> None:
        await self._wait_for(self.up)

    async def wait_ready(self) -> None:
        await self._wait_for(self.ready)

    async def _wait_for(self, state: asyncio.Event) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.start_timeout_s
        while not state.is_set():
            if self.stopping:
                raise EngineUnavailable("the engine is stopping")
            if self.down is not None:
                raise EngineUnavailable(str(self.down), status=self.down.status, retry_after=self.down.retry_after)
            changed = self._changed
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise EngineUnavailable("the engine is not ready (still starting or restarting)")
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(changed.wait(), remaining)
