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
from strata_serve.engine.base import Engine, EngineUnavailable
from strata_serve.exchange import EngineError, KeyRefused, Outcome, StrataRequest, Verdict
from strata_serve.plugins import broadcast, first_result
from strata_serve.slot_state import SlotPicture, SlotState, tokens_after

log = logging.getLogger("strata_serve.service")

M = TypeVar("M", bound=BaseModel)

#: What a keying plugin may return: 1-64 of letters, digits, ``-`` and ``_`` (whole string).
KEY_PATTERN = re.compile(r"[A-Za-z0-9_-]{1,64}")
#: Separates a tenant's name from its conversation keys (``alice--<key>``). Tenant names
#: have no ``-`` and a plugin's key may not contain it, so no key reaches another namespace.
TENANT_SEPARATOR = "--"


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


class IdleWork:
    """Work a plugin asked to run once the service has been idle a while (:meth:`Service.when_idle`)."""

    def __init__(self, service: Service, delay_s: float, work: Callable[[], Awaitable[Any]], name: str):
        self._service = service
        self._work = work
        self.name = name
        self.running = False
        self._task: asyncio.Task | None = None
        self._timer: asyncio.TimerHandle | None = asyncio.get_running_loop().call_later(delay_s, self._start)

    def _start(self) -> None:
        self._timer = None
        if self._service.fifo.idle and not self._service.closing:
            self._task = asyncio.create_task(self._run(), name=f"strata-idle-{self.name}")
        else:
            self._service._idle_work.discard(self)

    async def _run(self) -> None:
        try:
            async with self._service.fifo.hold():
                if self._service.closing:
                    return
                self.running = True
                try:
                    await self._work()
                except Exception:
                    log.exception("[strata] %s (run while idle) failed", self.name)
        finally:
            self.running = False
            self._service._idle_work.discard(self)

    def cancel(self) -> None:
        """Do not start it; if it waits for its turn, it leaves the line. Running, it finishes."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._task is not None and not self.running:
            self._task.cancel()
        self._service._idle_work.discard(self)

    @property
    def done(self) -> bool:
        return self._timer is None and (self._task is None or self._task.done())


class Service:
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
        self.fifo = ServiceFIFO(settings.engine.parallel, settings.server.queue_limit)
        self.state: dict[str, Any] = {}
        #: What each engine slot holds: recorded here for every request and slot call.
        self.slots = SlotPicture.for_engine(settings.engine.parallel)
        self.closing = False
        self.started_at = time.time()
        self._tasks: set[asyncio.Task] = set()
        self._idle_work: set[IdleWork] = set()
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

        A named tenant's keys are ``<tenant>--<key>``; the unnamed tenant's (the plain
        ``server.api_key``, or no key at all) are the plugin's key as is. A plugin's
        key may not contain ``--``, so neither can reach the other's namespace.

        :raises KeyRefused: when a keying plugin refuses the request's input, or
            its key contains ``--``.
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
        if not isinstance(key, str) or not KEY_PATTERN.fullmatch(key):
            log.warning("[strata] ignoring conversation key %r: not 1-64 of [A-Za-z0-9_-]", key)
            return None
        if TENANT_SEPARATOR in key:
            # Without this, a key chosen by the client ("alice--s1") would name another
            # tenant's conversation; refused whatever the key's source, tenants or not.
            raise KeyRefused(
                f"the conversation key {key!r} contains {TENANT_SEPARATOR!r}, which is reserved: "
                "it separates a tenant's name from its conversation keys"
            )
        if request.tenant is not None:
            # Tenants never share a key, whichever plugin made it.
            key = f"{request.tenant}{TENANT_SEPARATOR}{key}"
        return key

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
        self, request: StrataRequest, send: Callable[[Outcome], Awaitable[None]]
    ) -> Outcome:
        """Run one request through the FIFO: ``pre_request``, ``send``, ``post_request``.

        ``send`` forwards to the engine and fills in the outcome as it learns it.
        The plugin steps around it run to their end even when the client goes away
        meanwhile: a save cut in half would leave a temporary file and a wrong
        picture of the slot. ``post_request`` runs for every request that got its turn.

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
                self.sync_generation()
                began = time.monotonic()
                outcome = Outcome(status="error", error="not sent")
                try:
                    await _to_the_end(broadcast(self.pm, "pre_request", request=request, service=self))
                except asyncio.CancelledError:
                    outcome.status, outcome.error = "cancelled", "the client went away before the engine was asked"
                    await _to_the_end(self._post(request, outcome, began))
                    raise
                before = self._sent(request)
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
                    self._answered(request, outcome, before)
                    await _to_the_end(self._post(request, outcome, began))
                return outcome
        finally:
            if task is not None:
                self._tasks.discard(task)

    async def _post(self, request: StrataRequest, outcome: Outcome, began: float) -> None:
        outcome.duration_ms = (time.monotonic() - began) * 1000
        await broadcast(self.pm, "post_request", request=request, outcome=outcome, service=self)

    # -- the life cycle ---------------------------------------------------------------

    async def start(self) -> None:
        """Start the engine, then tell the plugins, before any request is let through.

        The order, documented in :mod:`strata_serve.hookspecs`: the engine is up (its
        ``info`` read), ``on_startup`` once, ``on_engine_start(restarted=False)``; after
        every later restart of the engine, ``on_engine_start(restarted=True)``.
        """
        await self.engine.start()

    async def _engine_started(self, restarted: bool) -> None:
        self.sync_generation()
        if not self._started:
            self._started = True
            await broadcast(self.pm, "on_startup", service=self)
        await broadcast(self.pm, "on_engine_start", service=self, restarted=restarted)

    async def stop(self) -> None:
        """A normal stop: drain, ``on_shutdown`` (FIFO held, engine up), then the engine stops."""
        try:
            await self.shutdown()
        finally:
            await self.engine.stop()

    def when_idle(self, delay_s: float, work: Callable[[], Awaitable[Any]], *, name: str) -> IdleWork:
        """Run ``work`` once the service has been idle for ``delay_s``, holding the FIFO.

        The sanctioned way for a plugin to use quiet time (auto-sessions saves the held
        conversation this way): a request that arrives while ``work`` runs waits for it;
        one that arrives before it starts comes first (it is not started if the service
        is busy then). Cancel the returned handle when the work is no longer wanted. A
        normal stop cancels work that has not started and waits for work that has.
        A failure is logged with ``name``.
        """
        idle = IdleWork(self, delay_s, work, name)
        self._idle_work.add(idle)
        return idle

    # -- the picture of the slots ------------------------------------------------------

    def sync_generation(self) -> None:
        """Forget what the slots held when the engine has (re)started since."""
        if any(slot.generation != self.engine.generation for slot in self.slots):
            self.slots.engine_started(self.engine.generation)

    def _sent(self, request: StrataRequest) -> SlotState | None:
        if request.route == "slots":
            return None  # slot calls record themselves (save_slot, restore_slot, erase_slot)
        held = self.slots[request.slot]
        request.found_in_slot = (request.conversation_key is not None and held.key == request.conversation_key
                                 and held.tenant == request.tenant and not held.empty)
        return self.slots.sent(request.slot, request)

    def _answered(self, request: StrataRequest, outcome: Outcome, before: SlotState | None) -> None:
        """Record what the slot holds now that the engine's answer ended, however it ended."""
        if before is None:
            return
        if self.engine.generation != before.generation:
            self.sync_generation()  # the engine died during the request: the slot is empty
        elif outcome.timings:
            self.slots.finished(request.slot, tokens_after(outcome.timings))
        elif outcome.http_status is not None and 400 <= outcome.http_status < 500:
            self.slots.untouched(request.slot, before)  # refused before it touched the slot
        elif outcome.error == "not sent":
            self.slots.untouched(request.slot, before)
        else:
            self.slots.finished(request.slot, None)  # cut off: ask the engine when it matters

    async def slot(self, slot: int = 0) -> SlotState:
        """What the slot holds, asking the engine first when the picture is not sure."""
        self.sync_generation()
        state = self.slots[slot]
        if state.tokens is None:
            await self.check_slots()
        return self.slots[slot]

    async def check_slots(self) -> None:
        """Compare the picture with the engine's ``GET /slots`` (its token counts win)."""
        try:
            answer = await self.engine.slots()
        except (EngineError, EngineUnavailable) as exc:
            log.info("[strata] could not ask the engine what its slots hold: %s", exc)
            return
        self.sync_generation()
        self.slots.check(answer)

    async def save_slot(self, filename: str, *, slot: int = 0) -> dict[str, Any]:
        """Save a slot to ``filename`` in the slot directory, and record it."""
        answer = await self.engine.save(filename, slot)
        self.slots.saved(slot, int(answer.get("n_saved", 0)))
        return answer

    async def restore_slot(self, filename: str, *, slot: int = 0, key: str | None = None,
                           tenant: str | None = None, request: StrataRequest | None = None) -> dict[str, Any]:
        """Load ``filename`` into a slot; it then holds ``key`` (None: a file by hand).

        ``request``, when given, is the request the restore is made for.
        """
        try:
            answer = await self.engine.restore(filename, slot)
        except BaseException:
            # A failed restore may have cleared the slot, or not: nothing nameable is held.
            self.slots.unknown(slot, nameable=False)
            raise
        n_restored = int(answer.get("n_restored", 0))
        self.slots.restored(slot, key, tenant, n_restored, from_own_file=key is not None)
        if request is not None:
            request.restored_tokens = n_restored
        return answer

    async def erase_slot(self, slot: int = 0) -> dict[str, Any]:
        try:
            answer = await self.engine.erase(slot)
        except BaseException:
            self.slots.unknown(slot)
            raise
        self.slots.emptied(slot)
        return answer

    async def shutdown(self) -> None:
        """Stop taking requests, let the ones in flight finish (bounded), then ``on_shutdown``."""
        if self.closing:
            return
        self.closing = True
        for idle in list(self._idle_work):
            idle.cancel()  # not started: never will; running: finishes before the FIFO is ours
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


async def _to_the_end(step: Awaitable[Any]) -> Any:
    """Await ``step`` to its end even if the awaiting task is cancelled meanwhile.

    The cancel is re-raised once the step has finished.
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
            cancelled = True
    if cancelled:
        raise asyncio.CancelledError()
    return result
