"""Conversations in the shared tier as blocks: a manifest per upload, blocks written once.

An upload of a conversation parked in blocks sends its manifest (a small object under the
upload, beside its sidecar) and only the blocks the tier lacks; a fetch brings the
manifest and only the blocks the slot directory's store lacks. A block's name is its
chained hash (:mod:`strata_auto_sessions.blocks.names`): the same bytes on every replica
of one model, so a block is sent once however many conversations and replicas reach it.

Which blocks the tier holds is remembered per process (:class:`TierBlocks`): listed once,
then each block sent or found there is known for :data:`KNOWN_S`, and not asked for again.
A block is removed from the tier by the sweep alone (:func:`held_blocks`), only when no
manifest object in the tier names it and it is older than ``lease_s``: an upload puts its
blocks, then its manifest, then its head.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any, TypeVar

from strata_serve import make_private_dir

from strata_auto_sessions.blocks import BlockStore, CorruptBlock, Manifest
from strata_auto_sessions.blocks import objects as block_objects
from strata_auto_sessions.blocks.store import MANIFEST_VERSION
from strata_auto_sessions.shared.tier import SharedTier, SharedTierError

T = TypeVar("T")
Call = Callable[..., Awaitable[Any]]

#: What a manifest object's name holds between the file's name and the upload.
MANIFEST_MARK = ".manifest."
#: How long a block found in the tier (or sent there) is taken as present without asking
#: again: well under the sweep's grace (``lease_s``, 900 s by default) is not needed for
#: safety (the sweep keeps every block a manifest names), only to notice one removed.
KNOWN_S = 600.0


def encode_manifest(manifest: Manifest) -> bytes:
    return json.dumps({"version": MANIFEST_VERSION, **asdict(manifest)}, separators=(",", ":")).encode()


def manifest_digest(manifest: Manifest) -> str:
    """What tells a state in blocks from any other, for its head's ``digest``: its blocks
    and its tail are named by their tokens, so two states of one prompt whose answers
    differ (the same count of tokens, other tokens) have other digests."""
    identity = json.dumps(manifest.identity, separators=(",", ":"))
    return "blocks:" + hashlib.sha256(identity.encode()).hexdigest()[:32]


def decode_manifest(data: bytes, what: str) -> Manifest:
    """:raises SharedTierError: when it is not a manifest of this version."""
    try:
        raw = json.loads(data)
        if raw.pop("version") != MANIFEST_VERSION:
            raise ValueError("another manifest version")
        manifest = Manifest(**raw)
        if not all(isinstance(n, str) and n and "/" not in n and not n.startswith(".") for n in manifest.objects()):
            raise ValueError("a block name that is not one")
        return manifest
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        raise SharedTierError(f"{what} is not a manifest: {exc}") from None


class TierBlocks:
    """The tier's blocks as one server sees them: what it knows the tier holds, sending
    what it lacks and bringing what the local store lacks."""

    def __init__(self, tier: SharedTier, call: Call, transfer_timeout_s: float):
        self.tier, self.call, self.transfer_timeout_s = tier, call, transfer_timeout_s
        #: Block name -> when it was last known in the tier (``time.monotonic()``).
        self.known: dict[str, float] = {}
        self._listed = False

    def _knows(self, name: str) -> bool:
        seen = self.known.get(name)
        return seen is not None and time.monotonic() - seen < KNOWN_S

    async def send(self, store: BlockStore, manifest: Manifest) -> int:
        """Send the manifest's blocks the tier lacks; the bytes sent.

        :raises OSError: a block gone from the local store meanwhile (a newer save: the
            upload is made again for it)."""
        if not self._listed:
            now = time.monotonic()
            for listed in await self.call(self.tier.blocks(), self.transfer_timeout_s):
                self.known[listed.name] = now
            self._listed = True
        sent = 0
        for name in dict.fromkeys(manifest.objects()):
            if self._knows(name):
                continue
            raw = await asyncio.to_thread(store._object_path(name).read_bytes)
            # Its bytes cross the wire whether the tier had it or not (another server may
            # have sent it meanwhile): counted either way.
            await self.call(self.tier.put_block(name, raw), self.transfer_timeout_s)
            sent += len(raw)
            self.known[name] = time.monotonic()
        return sent

    async def bring(self, store: BlockStore, manifest: Manifest, staging: Callable[[str], Path]) -> tuple[
            list[tuple[str, Path]], int]:
        """Fetch the manifest's blocks the local store lacks, each checked against its digest,
        into temporaries (``staging(name)``); they and the bytes fetched. The caller puts
        them in the store (:func:`put_in_store`) and removes the temporaries."""
        staged: list[tuple[str, Path]] = []
        fetched = 0
        try:
            for name in dict.fromkeys(manifest.objects()):
                if await asyncio.to_thread(store.has, name):
                    continue
                try:
                    raw = await self.call(self.tier.fetch_block(name), self.transfer_timeout_s)
                except FileNotFoundError:
                    raise SharedTierError(f"block {name[:16]} of the manifest is not in the tier") from None
                temp = staging(name)
                await asyncio.to_thread(_write_checked, temp, raw, name)
                staged.append((name, temp))
                self.known[name] = time.monotonic()
                fetched += len(raw)
        except BaseException:
            await asyncio.to_thread(unlink_staged, staged)
            raise
        return staged, fetched


def _write_checked(temp: Path, raw: bytes, name: str) -> None:
    try:
        block_objects.decode(raw)
    except CorruptBlock as exc:
        raise SharedTierError(f"block {name[:16]} in the tier is damaged: {exc}") from None
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(raw)
    except BaseException:
        temp.unlink(missing_ok=True)  # a full disk must not leave the temporary behind
        raise


def unlink_staged(staged: Iterable[tuple[str, Path]]) -> None:
    for _name, temp in staged:
        temp.unlink(missing_ok=True)


def put_in_store(store: BlockStore, manifest: Manifest, key: str, staged: list[tuple[str, Path]]) -> None:
    """The fetched blocks linked into the store (one already there stays: same name, same
    bytes), then the manifest under ``key``, once every object it names is there. Called
    under the slot directory's lock, so no local prune runs between the two.

    :raises SharedTierError: an object the manifest names is missing here."""
    for name, temp in staged:
        path = store._object_path(name)
        make_private_dir(path.parent)
        try:
            os.link(temp, path)
        except FileExistsError:
            pass
    if staged:
        store.objects_changed()  # listed again at the next look
    missing = [name for name in manifest.objects() if not store.has(name)]
    if missing:
        raise SharedTierError(f"{len(missing)} block(s) of the manifest went from the store here meanwhile")
    store._write_manifest(replace(manifest, key=key, saved_at=time.time()))


async def held_blocks(tier: SharedTier, names: Iterable[str], call: Call) -> set[str] | None:
    """The blocks the manifest objects ``names`` hold; None when one cannot be read (then no
    block is removed: what it holds is unknown)."""
    held: set[str] = set()
    for name in names:
        try:
            manifest = decode_manifest(await call(tier.fetch_bytes(name)), name)
        except FileNotFoundError:
            continue  # removed since it was listed: it holds nothing
        except SharedTierError:
            return None
        held.update(manifest.objects())
    return held
