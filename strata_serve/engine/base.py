"""What the core and plugins may ask of an engine backend."""

from __future__ import annotations

from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Awaitable, Callable, Protocol

from strata_serve.hook_types import Timings


class EngineUnavailable(Exception):
    """The engine cannot answer now (starting, restarting, or gone); maps to 502/503.

    ``retry_after``: seconds until the next attempt to start it, when one is planned.
    """

    def __init__(self, message: str, status: int = 503, retry_after: float | None = None):
        super().__init__(message)
        self.status = status
        self.retry_after = retry_after


@dataclass
class EngineInfo:
    """What a backend knows of the engine it talks to."""

    url: str
    model_path: str | None = None
    n_ctx: int | None = None
    parallel: int = 1
    build: str | None = None
    slot_save_path: Path | None = None
    #: ``--cache-ram`` budget in MiB as started (None: the engine's default, unknown when attached).
    cache_ram_mib: int | None = None
    multimodal: bool = False
    #: What the model takes besides text (``vision``, ``audio``, ``video``), as the engine's
    #: ``/props`` says; None: not known (requests with media are then left to the engine).
    modalities: frozenset[str] | None = None
    #: True when strata-serve started (and supervises) the engine process.
    managed: bool = False
    #: Whether the engine may empty an idle slot on its own when another slot gets a
    #: task (llama-server with ``--kv-unified``, its RAM cache on and
    #: ``--cache-idle-slots``); None: not known (attached). Unless False, a multi-slot
    #: service asks the engine what its slots hold before each request.
    clears_idle_slots: bool | None = False
    #: The model's weight type, as ``/props`` says (``model_ftype``: ``F16``, ``Q4_1``...).
    model_ftype: str | None = None
    #: The start flags that shape a slot's saved state (:class:`StateLayout`); None when not
    #: known (an engine strata-serve attached to: ``/props`` does not report them).
    layout: StateLayout | None = None


@dataclass(frozen=True)
class StateLayout:
    """How the engine lays out a slot's state, from its start flags (resolved to the
    engine's defaults where a flag was not given).

    A state file saved under one layout cannot be loaded under another: the engine
    refuses another KV cache type or another flash-attention setting, and an SWA
    model's cache has another size with ``--swa-full``. ``n_gpu_layers`` moves work,
    not state: recorded, never a reason to refuse.
    """

    cache_type_k: str = "f16"
    cache_type_v: str = "f16"
    #: ``on``, ``off`` or ``auto`` (the engine decides per device; not resolved here).
    flash_attn: str = "auto"
    swa_full: bool = False
    n_gpu_layers: str | None = None


class JSONAnswer(dict):
    """A JSON object an engine answered, with the bytes it came in (``raw``).

    A backend may return one from ``request``; the relay then hands the client those
    bytes as they are instead of writing the object out again.
    """

    __slots__ = ("raw",)

    def __init__(self, value: dict[str, Any], raw: bytes):
        super().__init__(value)
        self.raw = raw


#: What a backend may declare in ``capabilities``:
#: ``slots`` (``slots()`` reports what each slot holds), ``slot_files`` (``save``,
#: ``restore`` and ``erase`` of a slot, into files in ``info.slot_save_path``),
#: ``ram_cache`` (the engine keeps prompts in a RAM cache of its own).
CAPABILITIES = frozenset({"slots", "slot_files", "ram_cache"})


def __getattr__(name: str) -> Any:
    # ENGINE_ROUTES: the engine's paths the built-in APIs are relayed to, each declared once
    # by its API (strata_serve.api.registry); a backend declares in ``routes`` which of them
    # it serves. (``/slots``, ``/health``, ``/openapi.json`` and plugins' routes are the
    # core's own, not relayed, so not listed.) Read from the registry on first use: the
    # APIs' modules import this one.
    if name == "ENGINE_ROUTES":
        from strata_serve.api.registry import builtin

        routes = builtin().engine_paths
        globals()[name] = routes
        return routes
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class Engine(Protocol):
    info: EngineInfo
    #: What this backend can do (a subset of :data:`CAPABILITIES`); plugins check these.
    capabilities: frozenset[str]
    #: The engine's paths this backend serves (of :data:`ENGINE_ROUTES`, and any a plugin's
    #: API is relayed to); an API relayed to another answers 404 ``not_supported`` in its
    #: error shape. A backend without it serves them all.
    routes: frozenset[str]
    #: The engine's paths on which the backend runs a request in the slot the service
    #: chose (``id_slot`` in the body). On a multi-slot engine, a request relayed to
    #: another path holds every slot, since the engine picks one itself.
    pinned_routes: frozenset[str]
    #: Increases by one at every (re)start: state held by an older generation is gone.
    generation: int
    #: Awaited with ``restarted`` after every start, before requests are let through.
    on_start: Callable[[bool], Awaitable[None]] | None

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    def kill(self) -> None:
        """Stop at once, waiting for nothing: a second signal during a stop. :meth:`stop`
        is still called after it. (A backend without it is stopped by :meth:`stop` alone.)"""
        ...

    @property
    def ready(self) -> bool:
        """Started, answering, and letting requests through."""
        ...

    async def wait_ready(self) -> None:
        """Wait until requests may go to the engine.

        :raises EngineUnavailable: past the start timeout, or at once when the engine
            is down with no start under way (the message says whether one is coming).
        """
        ...

    async def request(
        self, method: str, path: str, json: Any = None, *, op: str = "request", resend: bool = True
    ) -> tuple[int, Any]:
        """``(status, body)``: JSON as Python (an object may be a :class:`JSONAnswer`), else text."""
        ...

    def stream(self, path: str, json: Any) -> AbstractAsyncContextManager[Any]:
        """Yields a reply with ``status``, ``await body()`` and ``async for chunk in chunks()``."""
        ...

    async def save(self, filename: str, slot: int = 0) -> dict[str, Any]: ...

    async def restore(self, filename: str, slot: int = 0) -> dict[str, Any]: ...

    async def erase(self, slot: int = 0) -> dict[str, Any]: ...

    async def slots(self) -> list[dict[str, Any]]: ...

    def read_timings(self, numbers: Any) -> Timings | None:
        """What an answer cost, from the numbers this engine adds to it (llama-server's
        ``timings`` object), in the core's terms; None when they say nothing usable.

        The relay hands over whatever the answer carried under the engine's own key;
        where an API reports only ``usage``, the core reads that itself.
        """
        ...

    async def health(self) -> bool: ...
