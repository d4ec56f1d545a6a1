"""The FIFO: which request holds which of the engine's slots, in arrival order."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
from typing import Any
from collections.abc import AsyncIterator, Awaitable, Callable

from strata_serve.slot_choice import Claim, SlotChooser

log = logging.getLogger("strata_serve.service")

class QueueFull(Exception):
    """More requests are waiting than ``server.queue_limit`` allows."""


class ShuttingDown(Exception):
    """The server is stopping and takes no new requests."""


class ServiceFIFO:
    """Admits requests to the engine's ``capacity`` slots, in arrival order.

    With one slot it is a plain FIFO. With several, each waiter in arrival order is
    given a slot as soon as one it may use is free (``chooser`` says which: the slot
    that holds its conversation, or the cheapest to displace), so a request waiting
    for its conversation's slot does not hold back those behind it; an exclusive
    waiter does hold back everyone behind it, so it cannot be starved.

    At most ``limit`` requests may wait; a waiter that is cancelled (its client
    went away) leaves the line without taking a turn.
    """

    def __init__(self, capacity: int = 1, limit: int = 64, chooser: SlotChooser | None = None):
        self.capacity = capacity
        self.limit = limit
        self.chooser = chooser
        #: Busy slots and the conversation key each runs (None: none).
        self.busy: dict[int, str | None] = {}
        self.exclusive = False
        self._waiters: collections.deque[tuple[asyncio.Future[int], Claim]] = collections.deque()
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def holders(self) -> int:
        return 1 if self.exclusive else len(self.busy)

    @property
    def waiting(self) -> int:
        return sum(1 for w, _ in self._waiters if not w.done())

    def head(self) -> asyncio.Future[int] | None:
        """The place of the first request waiting (its turn comes next, on one slot)."""
        return next((w for w, _ in self._waiters if not w.done()), None)

    @property
    def idle(self) -> bool:
        return self.holders == 0 and self.waiting == 0

    def slot_free(self, slot: int) -> bool:
        """No one holds ``slot``. (A waiter that could use it would have been given it.)"""
        return not self.exclusive and slot not in self.busy

    def resize(self, capacity: int) -> None:
        """The engine turned out to run ``capacity`` slots (an attached engine)."""
        self.capacity = capacity
        self._grant()

    def _place(self, claim: Claim) -> int | None:
        if self.exclusive:
            return None
        if claim.exclusive:
            return -1 if not self.busy else None
        if claim.key is not None and claim.key in self.busy.values():
            return None  # one conversation runs in one slot at a time
        free = [n for n in range(self.capacity) if n not in self.busy]
        if claim.slot is not None:
            return claim.slot if claim.slot in free else None
        if not free:
            return None
        if self.chooser is None:
            return free[0]
        return self.chooser(claim, free)

    def _take(self, slot: int, claim: Claim) -> None:
        if slot == -1:
            self.exclusive = True
        else:
            self.busy[slot] = claim.key
        self._idle.clear()

    def _grant(self) -> None:
        for entry in list(self._waiters):
            waiter, claim = entry
            if waiter.done():
                self._waiters.remove(entry)
                continue
            slot = self._place(claim)
            if slot is None:
                if claim.exclusive or self.exclusive:
                    break  # nobody passes a waiting exclusive claim
                continue
            self._waiters.remove(entry)
            self._take(slot, claim)
            waiter.set_result(slot)

    def line_up(self, claim: Claim) -> asyncio.Future[int]:
        """Join the line at once, without waiting: the turn, when it comes, is the future's
        result (await it through :meth:`hold` with ``lined_up``). For a request that must
        keep its place from this moment (one sent to the engine ahead of its turn).

        :raises QueueFull: when ``limit`` requests wait already.
        """
        if self.waiting >= self.limit:
            raise QueueFull()
        waiter: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self._waiters.append((waiter, claim))
        self._idle.clear()
        self._grant()
        return waiter

    async def acquire(self, claim: Claim | None = None, *, exclusive: bool = False,
                      lined_up: asyncio.Future[int] | None = None) -> int:
        """Wait for a turn; the slot granted (-1: all of them, ``exclusive``). ``lined_up``:
        the place :meth:`line_up` gave.

        :raises QueueFull: when ``limit`` requests wait already.
        """
        claim = claim or Claim(exclusive=exclusive)
        if lined_up is not None:
            waiter = lined_up
        else:
            if not self._waiters:
                slot = self._place(claim)
                if slot is not None:
                    self._take(slot, claim)
                    return slot
            waiter = self.line_up(claim)
        try:
            return await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                # The turn was handed to us just as we were cancelled: pass it on.
                self.release(waiter.result())
            else:
                self._waiters = collections.deque(e for e in self._waiters if e[0] is not waiter)
                self._grant()
                self._update_idle()
            raise

    def release(self, slot: int) -> None:
        """End a turn: ``slot`` as granted by :meth:`acquire` (-1: every slot)."""
        if slot == -1:
            self.exclusive = False
        else:
            del self.busy[slot]
        self._grant()
        self._update_idle()

    def _update_idle(self) -> None:
        if self.idle:
            self._idle.set()

    async def wait_idle(self) -> None:
        await self._idle.wait()

    @contextlib.asynccontextmanager
    async def hold(self, claim: Claim | None = None, *, exclusive: bool = False,
                   lined_up: asyncio.Future[int] | None = None) -> AsyncIterator[int]:
        slot = await self.acquire(claim, exclusive=exclusive, lined_up=lined_up)
        try:
            yield slot
        finally:
            self.release(slot)


class IdleWork:
    """Work a plugin asked to run once the service has been idle a while (``Service.when_idle``)."""

    def __init__(self, fifo: ServiceFIFO, delay_s: float, work: Callable[[], Awaitable[Any]], name: str,
                 slot: int | None = None, *, closing: Callable[[], bool],
                 finished: Callable[[IdleWork], None]):
        self._fifo = fifo
        #: Whether the service is stopping (then the work never starts).
        self._closing = closing
        #: Called once the work is over, or will never run.
        self._finished = finished
        self._work = work
        self.name = name
        #: The slot whose idleness is awaited (None: the whole service).
        self.slot = slot
        self.running = False
        self._task: asyncio.Task | None = None
        self._timer: asyncio.TimerHandle | None = asyncio.get_running_loop().call_later(delay_s, self._start)

    def _start(self) -> None:
        self._timer = None
        fifo = self._fifo
        quiet = fifo.idle if self.slot is None else fifo.slot_free(self.slot)
        if quiet and not self._closing():
            self._task = asyncio.create_task(self._run(), name=f"strata-idle-{self.name}")
        else:
            self._finished(self)

    async def _run(self) -> None:
        claim = Claim(exclusive=True) if self.slot is None else Claim(slot=self.slot)
        try:
            async with self._fifo.hold(claim):
                if self._closing():
                    return
                self.running = True
                try:
                    await self._work()
                except Exception:
                    log.exception("[strata] %s (run while idle) failed", self.name)
        finally:
            self.running = False
            self._finished(self)

    def cancel(self) -> None:
        """Do not start it; if it waits for its turn, it leaves the line. Running, it finishes."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._task is not None and not self.running:
            self._task.cancel()
        self._finished(self)

    @property
    def done(self) -> bool:
        return self._timer is None and (self._task is None or self._task.done())
