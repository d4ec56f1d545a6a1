"""The shared tier's contract (:class:`SharedTier`): objects several servers reach, and a
small head record per conversation file, written by compare-and-swap.

Objects are opaque bytes under a name (``put``, ``fetch``, ``list``, ``delete``). A head
(:class:`Head`) says which upload of a conversation file is the current one, its
generation (one more at each save that lands), and whether the conversation was removed
(a tombstone). A head is replaced only by a writer that names the version it read
(``expect``); a first write names none and is refused when a head exists. Two servers
that save the same conversation at once: one lands, the other is told so
(:class:`ConditionFailed`) and never overwrites.

Blocks (``put_block``, ``fetch_block``, ``blocks``, ``delete_block``) are apart from the
objects: named by their content's chained hash, written once and never over, shared by
every conversation and replica that reached them (:mod:`~strata_auto_sessions.shared.blocks`).

Names are the slot directory's file names (``auto-<name>.bin``, its sidecar, siblings
``auto-<name>.<n>.bin``), so tenants are apart exactly as they are on disk: a named
tenant's keys begin with its name.
"""

from __future__ import annotations

import builtins

import asyncio
import json
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeVar

T = TypeVar("T")


class SharedTierError(OSError):
    """The shared tier could not be reached or did not answer in time (the request goes on
    with local parking alone)."""


class ConditionFailed(SharedTierError):
    """A conditional write was refused: the head is not the version the writer read (or a
    first write found one)."""


class DamagedHead(SharedTierError):
    """A head that is not one: cut short, not JSON, or a field of the wrong type. Another
    head, and the rest of the store, are unaffected."""


class ConditionsIgnored(SharedTierError):
    """The store accepted a write that contradicted its condition: shared mode is refused."""


@dataclass
class Head:
    """What the shared tier holds of one conversation file."""

    #: One more at each save that lands; a tombstone keeps counting.
    generation: int
    #: Which upload holds the file and its sidecar (``objects`` names); None in a tombstone.
    upload: str | None
    tokens: int = 0
    bytes: int = 0
    #: The file's sampled digest (:func:`~strata_auto_sessions.digests.sample_digest`).
    digest: str = ""
    #: When the conversation's state began (the sidecar's ``created``).
    created: float = 0.0
    #: When this head was written.
    written: float = field(default_factory=time.time)
    #: Set in a tombstone: when the conversation was removed (``strata-serve sessions rm``,
    #: or expiry); an upload of a state begun at or before it is refused.
    removed: float | None = None
    #: Who wrote it (host and process), for an operator reading the store.
    writer: str = ""
    #: What the state was made from (the sidecar's ``prompt``: its units, digest and chain of
    #: message digests): which conversation it is, and how far it went. None in a tombstone
    #: and in a head of an earlier version.
    prompt: dict[str, object] | None = None
    #: The upload is a manifest of blocks (the tier's ``blocks/``), not a whole file. A
    #: head of an earlier version has no such field: a whole file. A replica of an earlier
    #: version reading a manifest head finds no object under the file's name: its fetch
    #: fails, and nothing is restored.
    manifest: bool = False

    @property
    def tombstone(self) -> bool:
        return self.removed is not None

    def objects(self, name: str, sidecar_name: str) -> tuple[str, str] | None:
        """The names of the state's object (the file, or the manifest of its blocks) and the
        sidecar's, or None for a tombstone."""
        if self.upload is None:
            return None
        state = object_name(f"{name}.manifest", self.upload) if self.manifest else object_name(name, self.upload)
        return state, object_name(sidecar_name, self.upload)

    def encode(self) -> builtins.bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def decode(cls, data: builtins.bytes) -> Head:
        """:raises DamagedHead: when it is not a head (every field's type is checked: a
            reader compares and subtracts them)."""
        try:
            raw = json.loads(data)
            fields = {name: raw[name] for name in cls.__dataclass_fields__ if name in raw}
            head = cls(**fields)
        except (ValueError, TypeError, KeyError) as exc:
            raise DamagedHead(f"not a head record: {exc}") from None
        for name, kinds in _FIELD_TYPES.items():
            value = getattr(head, name)
            if (isinstance(value, bool) and bool not in kinds) or not isinstance(value, kinds):
                raise DamagedHead(f"not a head record: {name} {value!r}")
        if head.generation < 0:
            raise DamagedHead(f"not a head record: generation {head.generation!r}")
        return head


#: What each field of a head may hold, as read back from JSON (a float may be written as an int).
_FIELD_TYPES: dict[str, tuple[type, ...]] = {
    "generation": (int,), "upload": (str, type(None)), "tokens": (int,), "bytes": (int,), "digest": (str,),
    "created": (int, float), "written": (int, float), "removed": (int, float, type(None)), "writer": (str,),
    "prompt": (dict, type(None)), "manifest": (bool,),
}


def object_name(name: str, upload: str) -> str:
    """The object of file ``name`` in upload ``upload``: each upload has objects of its own,
    so a save that loses the head's race never overwrites the winner's bytes."""
    return f"{name}.{upload}"


def new_upload() -> str:
    return uuid.uuid4().hex[:16]


@dataclass
class Listed:
    """An object as :meth:`SharedTier.list` finds it."""

    name: str
    bytes: int
    modified: float


class SharedTier(Protocol):
    """Where the servers' parked conversations meet. Every method is a coroutine that may
    block on a network or a remote file system; callers bound each with a timeout.

    Choose one with the ``auto_sessions_shared_tier`` hook, or by
    ``plugins.auto_sessions.shared.url`` (``file://`` or ``s3://``).
    """

    #: Where it is, for log lines (no credentials).
    where: str

    async def put(self, name: str, source: Path) -> None:
        """Store the file ``source`` as object ``name`` (whole or not at all)."""
        ...

    async def fetch(self, name: str, target: Path) -> int:
        """Write object ``name`` to ``target``: the bytes written.

        :raises FileNotFoundError: when there is no such object.
        """
        ...

    async def list(self, prefix: str) -> builtins.list[Listed]:
        """The objects whose names begin with ``prefix``."""
        ...

    async def delete(self, name: str) -> None:
        """Remove object ``name`` (nothing when there is none)."""
        ...

    async def put_bytes(self, name: str, data: builtins.bytes) -> None:
        """Store ``data`` as object ``name`` (a small one: a manifest)."""
        ...

    async def fetch_bytes(self, name: str) -> builtins.bytes:
        """Object ``name``'s bytes (a small one: a manifest).

        :raises FileNotFoundError: when there is no such object.
        """
        ...

    # Blocks (``blocks/``): named by their content's chained hash, so written once and never
    # changed; shared by every conversation (and replica) that reached them.

    async def put_block(self, name: str, data: builtins.bytes) -> bool:
        """Write block ``name`` unless the tier holds it: True when this call wrote it. Never
        overwrites (``O_EXCL`` on a directory, ``If-None-Match: *`` on S3)."""
        ...

    async def fetch_block(self, name: str) -> builtins.bytes:
        """Block ``name``'s bytes.

        :raises FileNotFoundError: when the tier does not hold it.
        """
        ...

    async def blocks(self) -> builtins.list[Listed]:
        """Every block the tier holds."""
        ...

    async def delete_block(self, name: str) -> None:
        """Remove block ``name`` (nothing when there is none)."""
        ...

    async def head(self, name: str) -> tuple[Head, str] | None:
        """The head of conversation file ``name`` and its version, or None."""
        ...

    async def heads(self, prefix: str) -> builtins.list[str]:
        """The names of the heads that begin with ``prefix``."""
        ...

    async def put_head(self, name: str, head: Head, expect: str | None) -> str:
        """Write ``name``'s head if its version is ``expect`` (None: only if it has none);
        the new version.

        :raises ConditionFailed: when it is not.
        """
        ...

    async def delete_head(self, name: str, expect: str) -> None:
        """Remove ``name``'s head if its version is ``expect``.

        :raises ConditionFailed: when it is not.
        """
        ...

    async def remove_partial(self, older_than_s: float) -> int:
        """Remove what uploads that never ended left (a server killed mid-upload): partial
        objects, open multipart uploads, begun more than ``older_than_s`` ago. How many."""
        ...

    async def close(self) -> None: ...


#: How many threads a tier's blocking calls may hold at once.
TIER_THREADS = 8


@dataclass
class _Job:
    fn: Callable[..., Any]
    args: tuple[Any, ...]
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[Any]
    running: bool = False
    abandoned: bool = False


class TierThreads:
    """The threads a tier's blocking calls run in: a few daemon threads of the tier's own,
    never the event loop's default executor.

    A call that never returns (``open()`` on a hung NFS mount blocks in the kernel, and no
    thread blocked there can be stopped) then holds one of these, not a thread the rest of
    the server waits for, and a daemon thread never keeps the process alive at its exit. A
    call its caller stopped waiting for before it began is never run; one already running
    is counted as stuck until it returns; with every thread stuck, a call is refused at
    once rather than queued behind them.
    """

    def __init__(self, where: str, size: int = TIER_THREADS):
        self.where, self.size = where, size
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._jobs: deque[_Job] = deque()
        self._threads = self._idle = 0
        #: Calls running whose caller gave up on them.
        self.stuck = 0
        self._closed = False

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` in one of the threads.

        :raises SharedTierError: when every thread is stuck in a call, or the tier is closed.
        """
        loop = asyncio.get_running_loop()
        job = _Job(fn, args, loop, loop.create_future())
        with self._lock:
            if self._closed:
                raise SharedTierError(f"{self.where} is closed")
            if self.stuck >= self.size:
                raise SharedTierError(f"{self.where}: {self.stuck} calls on it have not returned; none is made "
                                      "until one does")
            self._jobs.append(job)
            if self._idle:
                self._idle -= 1
                self._wake.notify()
            elif self._threads < self.size:
                self._threads += 1
                threading.Thread(target=self._work, name=f"strata-shared-tier-{self._threads}", daemon=True).start()
        try:
            return await job.future
        except asyncio.CancelledError:
            with self._lock:
                if job.running and not job.abandoned:
                    self.stuck += 1
                job.abandoned = True
            raise

    def _work(self) -> None:
        while True:
            with self._lock:
                while not self._jobs and not self._closed:
                    self._idle += 1
                    self._wake.wait()
                if not self._jobs:
                    self._threads -= 1
                    return
                job = self._jobs.popleft()
                if job.abandoned:
                    continue
                job.running = True
            result: Any = None
            error: BaseException | None = None
            try:
                result = job.fn(*job.args)
            except BaseException as exc:  # delivered to the caller, never lost in this thread
                error = exc
            with self._lock:
                job.running = False
                if job.abandoned:
                    self.stuck -= 1
                    continue
            try:
                job.loop.call_soon_threadsafe(_deliver, job.future, result, error)
            except RuntimeError:
                pass  # the loop is closed: nobody waits any more

    def close(self) -> None:
        """Idle threads end; stuck ones are left to the process's exit (daemon threads)."""
        with self._lock:
            self._closed = True
            self._idle = 0
            self._wake.notify_all()


def _deliver(future: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


#: Where the start check writes: a name no conversation file takes.
PROBE_PREFIX = "auto-.probe-"


async def check_conditions(tier: SharedTier) -> None:
    """Write a probe head, then try two writes its conditions must refuse: a first write
    over it, and a write naming a stale version. Removes the probe.

    :raises ConditionsIgnored: when the store accepted either (some S3 stand-ins ignore
        ``If-Match`` and ``If-None-Match``): compare-and-swap would not hold there.
    """
    name = f"{PROBE_PREFIX}{uuid.uuid4().hex[:12]}"
    first = await tier.put_head(name, Head(generation=1, upload=None), None)
    try:
        refused = []
        try:
            await tier.put_head(name, Head(generation=2, upload=None), None)
        except ConditionFailed:
            refused.append("first")
        current = await tier.head(name)
        version = current[1] if current is not None else first
        stale = f'"{uuid.uuid4().hex}"' if version.startswith('"') else uuid.uuid4().hex
        try:
            version = await tier.put_head(name, Head(generation=3, upload=None), stale)
        except ConditionFailed:
            refused.append("stale")
        if refused != ["first", "stale"]:
            ignored = [what for what in ("first", "stale") if what not in refused]
            words = {"first": "a first write (If-None-Match: *) over an existing head",
                     "stale": "a write naming a stale version (If-Match)"}
            raise ConditionsIgnored(
                f"{tier.where} accepted {' and '.join(words[w] for w in ignored)}: it ignores conditional "
                "writes, so two servers could overwrite each other's saves; shared mode is refused")
    finally:
        current = await tier.head(name)
        if current is not None:
            await tier.delete_head(name, current[1])


def writer_name() -> str:
    import os
    import socket

    return f"{socket.gethostname()}:{os.getpid()}"
