"""The shared tier's contract (:class:`SharedTier`): objects several servers reach, and a
small head record per conversation file, written by compare-and-swap.

Objects are opaque bytes under a name (``put``, ``fetch``, ``list``, ``delete``). A head
(:class:`Head`) says which upload of a conversation file is the current one, its
generation (one more at each save that lands), and whether the conversation was removed
(a tombstone). A head is replaced only by a writer that names the version it read
(``expect``); a first write names none and is refused when a head exists. Two servers
that save the same conversation at once: one lands, the other is told so
(:class:`ConditionFailed`) and never overwrites.

Names are the slot directory's file names (``auto-<name>.bin``, its sidecar, siblings
``auto-<name>.<n>.bin``), so tenants are apart exactly as they are on disk: a named
tenant's keys begin with its name.
"""

from __future__ import annotations

import builtins

import json
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Protocol


class SharedTierError(OSError):
    """The shared tier could not be reached or did not answer in time (the request goes on
    with local parking alone)."""


class ConditionFailed(SharedTierError):
    """A conditional write was refused: the head is not the version the writer read (or a
    first write found one)."""


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

    @property
    def tombstone(self) -> bool:
        return self.removed is not None

    def objects(self, name: str, sidecar_name: str) -> tuple[str, str] | None:
        """The names of the file's and the sidecar's objects, or None for a tombstone."""
        if self.upload is None:
            return None
        return object_name(name, self.upload), object_name(sidecar_name, self.upload)

    def encode(self) -> builtins.bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def decode(cls, data: builtins.bytes) -> Head:
        """:raises SharedTierError: when it is not a head."""
        try:
            raw = json.loads(data)
            fields = {name: raw[name] for name in cls.__dataclass_fields__ if name in raw}
            head = cls(**fields)
        except (ValueError, TypeError, KeyError) as exc:
            raise SharedTierError(f"not a head record: {exc}") from None
        if not isinstance(head.generation, int) or head.generation < 0:
            raise SharedTierError(f"not a head record: generation {head.generation!r}")
        return head


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

    async def close(self) -> None: ...


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
