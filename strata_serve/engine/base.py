"""What the core and plugins may ask of an engine backend."""

from __future__ import annotations

from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol
from collections.abc import Awaitable, Callable

from strata_serve.engine.results import Timings
from strata_serve.engine.state_blocks import StateFormat


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
    #: The model's file, as the engine names it.
    model_path: str | None = None
    n_ctx: int | None = None
    parallel: int = 1
    build: str | None = None
    slot_save_path: Path | None = None
    #: The budget in MiB of the engine's own RAM cache of prompts, as started (None: the
    #: engine's default, or not known).
    cache_ram_mib: int | None = None
    #: Whether the engine was started with a projector for media (images, audio).
    multimodal: bool = False
    #: What the model takes besides text (``vision``, ``audio``, ``video``), as the engine's
    #: ``/props`` says; None: not known (requests with media are then left to the engine).
    modalities: frozenset[str] | None = None
    #: True when strata-serve started (and supervises) the engine process.
    managed: bool = False
    #: Whether the engine may empty an idle slot on its own when another slot gets a
    #: task; None: not known. Unless False, a multi-slot service asks the engine what
    #: its slots hold before each request.
    clears_idle_slots: bool | None = False
    #: The model's weight type (``F16``, ``Q4_1``...), as the engine names it.
    model_ftype: str | None = None
    #: How the engine lays out a slot's saved state (:class:`StateLayout`); None when not
    #: known (an engine strata-serve attached to may not say).
    layout: StateLayout | None = None


@dataclass(frozen=True)
class StateLayout:
    """How the engine lays out a slot's state (the engine's defaults where it was told nothing).

    A state file saved under one layout cannot be loaded under another: the engine
    refuses another KV cache type or another attention kernel, and a sliding-window
    model's cache has another size when it is kept whole. ``n_gpu_layers`` moves work,
    not state: recorded, never a reason to refuse. (The llama-server backend reads these
    from its start flags.)
    """

    cache_type_k: str = "f16"
    cache_type_v: str = "f16"
    #: The flash-attention kernel: ``on``, ``off`` or ``auto`` (the engine decides per
    #: device; not resolved here).
    flash_attn: str = "auto"
    #: A sliding-window model's cache kept whole (every position), not just the window.
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


@dataclass(frozen=True)
class SlotReport:
    """What the engine says of one slot (:meth:`Engine.slots`)."""

    id: int
    #: At work on a task now: its count of tokens is not final.
    processing: bool = False
    #: The slot's last task, numbered by the engine (a newer task has a larger number);
    #: None when the engine does not say.
    task: int | None = None
    #: Tokens the slot holds: the last task's prompt and what it generated (0 after an
    #: erase, the file's count after a restore), as a save would write them. None when
    #: the engine does not say (a slot that never ran a task).
    tokens: int | None = None
    #: The engine's own account of the slot, as it gave it: ``GET /slots`` shows it as it is.
    raw: Any = None


@dataclass(frozen=True)
class SlotSaved:
    """A slot saved to a file (:meth:`Engine.save`)."""

    #: Tokens the slot held, now in the file.
    tokens: int
    #: Bytes the engine wrote.
    bytes: int
    #: The engine's own answer, as it gave it: ``POST /slots/{id}`` shows it as it is.
    raw: Any = None


@dataclass(frozen=True)
class SlotRestored:
    """A file loaded into a slot (:meth:`Engine.restore`)."""

    #: Tokens the slot now holds.
    tokens: int
    #: Bytes the engine read.
    bytes: int
    raw: Any = None


@dataclass(frozen=True)
class SlotErased:
    """A slot emptied (:meth:`Engine.erase`)."""

    #: Tokens the slot held before; None when the engine does not say.
    tokens: int | None = None
    raw: Any = None


@dataclass(frozen=True)
class ContextOverflow:
    """An engine's error saying a prompt does not fit a slot's context (:meth:`Engine.read_overflow`)."""

    #: Tokens of the prompt, and of a slot's context; None when the engine does not say.
    prompt_tokens: int | None = None
    context_tokens: int | None = None


#: What a backend may declare in ``capabilities``:
#: ``slots`` (``slots()`` reports what each slot holds), ``slot_files`` (``save``,
#: ``restore`` and ``erase`` of a slot, into files in ``info.slot_save_path``),
#: ``ram_cache`` (the engine keeps prompts in a RAM cache of its own), ``tokens``
#: (``prompt_tokens()`` says which tokens a request's prompt is, as the engine reads it).
CAPABILITIES = frozenset({"slots", "slot_files", "ram_cache", "tokens"})


class Engine(Protocol):
    """What the core asks of an engine backend.

    Whatever the engine says comes back in strata-serve's own types (:class:`SlotReport`,
    :class:`SlotSaved`, :class:`SlotRestored`, :class:`SlotErased`, :class:`Timings`,
    :class:`ContextOverflow`): a backend translates its engine's words, and no other
    part of the server reads them.
    """

    info: EngineInfo
    #: What this backend can do (a subset of :data:`CAPABILITIES`); plugins check these.
    capabilities: frozenset[str]
    #: The engine's paths this backend serves (of ``strata_serve.ENGINE_ROUTES``, and any a plugin's
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
    #: How this engine's slot files are cut into blocks of tokens and joined back
    #: (:class:`strata_serve.engine.state_blocks.StateFormat`); None when the backend
    #: does not know its engine's state layout (its files are then kept whole).
    state_format: StateFormat | None
    @property
    def numbers_key(self) -> str | None:
        """The key under which the engine adds numbers of its own to an answer and to a
        stream's events (what :meth:`read_timings` reads); None when it adds none."""
        ...

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
        """``(status, body)``: JSON as Python (an object may be a :class:`JSONAnswer`), else text.

        ``op`` names the call (``completion``, ``props``...) for errors and for wrappers
        of a backend; with ``resend=False`` the call never goes to an engine that came
        back after a crash (it holds nothing of what the call was about).
        """
        ...

    def stream(self, path: str, json: Any) -> AbstractAsyncContextManager[Any]:
        """Yields a reply with ``status``, ``await body()`` and ``async for chunk in chunks()``.

        A reply may also offer ``await forward(take) -> bool``: each chunk handed to
        ``take(chunk) -> bool`` in the thread that read it, not on the event loop (``take``
        touches nothing of the loop's and returns True to stop; the rest is then read with
        ``chunks()``), True once the answer ended. The relay then writes a stream's chunks to
        its client from that thread (llama-server's ``StreamReply`` does).
        """
        ...

    async def save(self, filename: str, slot: int = 0) -> SlotSaved:
        """Save the slot into ``filename`` in ``info.slot_save_path``.

        :raises EngineError: when the engine refuses.
        """
        ...

    async def restore(self, filename: str, slot: int = 0) -> SlotRestored:
        """Load ``filename`` (in ``info.slot_save_path``) into the slot.

        :raises EngineError: when the engine refuses.
        """
        ...

    async def erase(self, slot: int = 0) -> SlotErased: ...

    async def slots(self) -> list[SlotReport]:
        """What each slot holds, as the engine says (``slots`` capability).

        :raises EngineError: when the engine refuses.
        """
        ...

    def read_timings(self, numbers: Any) -> Timings | None:
        """What an answer cost, from the numbers this engine adds to it (under
        :attr:`numbers_key`), in the core's terms; None when they say nothing usable.

        The relay hands over whatever the answer carried under that key; where an API
        reports only ``usage``, the core reads that itself.
        """
        ...

    def read_overflow(self, error: dict[str, Any]) -> ContextOverflow | None:
        """Whether the ``error`` object of an error answer says the prompt does not fit a
        slot's context (the core then tells the client both sizes, and how to serve more);
        None when it says something else."""
        ...

    async def health(self) -> bool: ...

    async def prompt_tokens(self, path: str, body: dict[str, Any]) -> list[int] | None:
        """The tokens the engine would read for ``body`` sent to ``path``, its own template
        and tokenizer applied (``tokens`` capability); None when it cannot tell (a path or
        a prompt it does not tokenize alone, such as media). Asked beside the slots' work.

        :raises EngineError: when the engine refuses.
        :raises EngineUnavailable: when it cannot be reached.
        """
        ...
