"""The service FIFO and the context handed to hooks."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import re
import time
from typing import Any, AsyncIterator, Awaitable, Callable, TypeVar

import pluggy
from pydantic import BaseModel

from strata_serve.config import Settings
from strata_serve.engine.base import Engine
from strata_serve.exchange import EngineError, KeyRefused, Outcome, StrataRequest, Verdict
from strata_serve.plugins import broadcast, first_result

log = logging.getLogger("strata_serve.service")

M = TypeVar("M", bound=BaseModel)

KEY_PATTERN = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


class QueueFull(Exception):
    """More requests are waiting than ``server.queue_limit`` allows."""


class ShuttingDown(Exception):
    """The server is stopping and takes no new requests."""


class ServiceFIFO:
    """Admits ``capacity`` holders at a time, strictly in arrival order.

    At most ``limit`` requests may wait; a waiter that is cancelled (its client
    went away) leaves the line without taking a turn.
    """

    def __init__(self, capacity: int = 1, limit: int = 64):
        self.capacity = capacity
        self.limit = limit
        self.holders = 0
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def waiting(self) -> int:
        return sum(1 for w in self._waiters if not w.done())

    @property
    def idle(self) -> bool:
        return self.holders == 0 and self.waiting == 0

    async def acquire(self) -> None:
        if self.holders < self.capacity and not self._waiters:
            self._take()
            return
        if self.waiting >= self.limit:
            raise QueueFull()
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        self._idle.clear()
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                # The turn was handed to us just as we were cancelled: pass it on.
                self.release()
            else:
                with contextlib.suppress(ValueError):
                    self._waiters.remove(waiter)
                self._update_idle()
            raise

    def _take(self) -> None:
        self.holders += 1
        self._idle.clear()

    def release(self) -> None:
        self.holders -= 1
        while self._waiters and self.holders < self.capacity:
            waiter = self._waiters.popleft()
            if not waiter.done():
                self._take()
                waiter.set_result(None)
        self._update_idle()

    def _update_idle(self) -> None:
        if self.idle:
            self._idle.set()

    async def wait_idle(self) -> None:
        await self._idle.wait()

    @contextlib.asynccontextmanager
    async def hold(self) -> AsyncIterator[None]:
        await self.acquire()
        try:
            yield
        finally:
            self.release()


class Service:
    """What hooks get as ``service``: settings, plugin manager, engine, FIFO.

    ``service.state`` is a dict for plugins to keep objects they want others to
    find (key it by your plugin's name).
    """

    def __init__(self, settings: Settings, pm: pluggy.PluginManager, engine: Engine):
        self.settings = settings
        self.pm = pm
        self.engine = engine
        self.fifo = ServiceFIFO(settings.engine.parallel, settings.server.queue_limit)
        self.state: dict[str, Any] = {}
        self.closing = False
        self.started_at = time.time()
        self._tasks: set[asyncio.Task] = set()
        self._plugin_configs: dict[str, BaseModel] = {}

    def plugin_config(self, name: str, model: type[M]) -> M:
        """``plugins.<name>`` validated into ``model``, once per server (then cached).

        For hooks that run on every request; ``on_config`` has refused a bad section
        before the start, with :meth:`Settings.plugin_config`.
        """
        cached = self._plugin_configs.get(name)
        if not isinstance(cached, model):
            cached = self._plugin_configs[name] = self.settings.plugin_config(name, model)
        return cached

    @property
    def single_slot(self) -> bool:
        return self.settings.engine.parallel == 1

    def conversation_key(self, request: StrataRequest) -> str | None:
        """Ask the ``conversation_key`` hook, then namespace the key by tenant.

        :raises KeyRefused: when a keying plugin refuses the request's input.
        """
        key = first_result(
            self.pm,
            "conversation_key",
            order=self.settings.server.conversation_key_order,
            passthrough=(KeyRefused,),
            request=request,
            service=self,
        )
        if key is None:
            return None
        if not isinstance(key, str) or not KEY_PATTERN.match(key):
            log.warning("[strata] ignoring conversation key %r: not 1-64 of [A-Za-z0-9_-]", key)
            return None
        if request.tenant is not None:
            # Tenants never share a key, whichever plugin made it.
            key = f"{request.tenant}--{key}"
        return key

    def verdict(
        self, op: str, error: EngineError | None, held_tokens: int | None = None
    ) -> Verdict | None:
        """Ask the quirk plugins what an engine failure (or a planned call) means."""
        result = first_result(
            self.pm, "engine_verdict", op=op, error=error, engine=self.engine, held_tokens=held_tokens
        )
        if result is None:
            return None
        try:
            return Verdict(result)
        except ValueError:
            log.error("[strata] ignoring engine verdict %r for %s: not a strata_serve.Verdict", result, op)
            return None

    async def process(
        self, request: StrataRequest, send: Callable[[Outcome], Awaitable[None]]
    ) -> Outcome:
        """Run one request through the FIFO: ``pre_request``, ``send``, ``post_request``.

        ``send`` forwards to the engine and fills in the outcome as it learns it.

        :raises QueueFull: when the line is full.
        :raises ShuttingDown: when the server is stopping.
        """
        if self.closing:
            raise ShuttingDown()
        task = asyncio.current_task()
        if task is not None:
            self._tasks.add(task)
        try:
            async with self.fifo.hold():
                await self.engine.wait_ready()
                began = time.monotonic()
                await broadcast(self.pm, "pre_request", request=request, service=self)
                outcome = Outcome(status="error", error="not sent")
                try:
                    await send(outcome)
                except asyncio.CancelledError:
                    outcome.status = "cancelled"
                    outcome.error = outcome.error if self.closing else "the client went away"
                    raise
                except Exception as exc:
                    outcome.status = "error"
                    outcome.error = str(exc)
                    raise
                finally:
                    outcome.duration_ms = (time.monotonic() - began) * 1000
                    await broadcast(
                        self.pm, "post_request", request=request, outcome=outcome, service=self
                    )
                return outcome
        finally:
            if task is not None:
                self._tasks.discard(task)

    async def shutdown(self) -> None:
        """Stop taking requests, let the ones in flight finish (bounded), then ``on_shutdown``."""
        if self.closing:
            return
        self.closing = True
        grace = self.settings.server.shutdown_grace_s
        try:
            await asyncio.wait_for(self.fifo.wait_idle(), grace)
        except asyncio.TimeoutError:
            log.warning("[strata] %d request(s) still running after %.0f s; cutting them off",
                        len(self._tasks), grace)
            for task in list(self._tasks):
                task.cancel()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.fifo.wait_idle(), 10)
        # Take the FIFO in turn, behind whatever started before the stop. A plugin's task
        # created just before it (a save while idle) has not asked for the FIFO yet, and
        # on_shutdown may wait for that task: taken first, the FIFO would never be its.
        # One turn of the loop lets every task already started ask. (Up to Python 3.11
        # wait_for above always gave that turn; since 3.12 it returns at once when idle.)
        await asyncio.sleep(0)
        async with self.fifo.hold():
            await broadcast(self.pm, "on_shutdown", service=self)
