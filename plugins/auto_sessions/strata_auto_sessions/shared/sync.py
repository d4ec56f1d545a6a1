"""auto-sessions and the shared tier: uploads after a save, fetches before a restore.

The engine reads and writes the slot directory alone; this module keeps the shared tier
in step with it, never on a request's path for long and never failing one:

- a conversation's identity is what its state holds, not a file's name: the head records
  the prompt the state was made from (its chain of message digests), and two states are
  of one conversation when one's prompt continues the other's
  (:mod:`~strata_auto_sessions.shared.standing`). Sibling numbers are chosen by each
  server, so a local file's head is found by that test (the ledger then remembers it),
  never by its name: a conversation another server shares under the same key and number
  gets a head of its own (the lowest number under the key no other conversation holds).
- after a save commits locally, the file, then its sidecar, then the head (by
  compare-and-swap) are uploaded in the background. The newest state of a conversation
  wins wherever it was made: a head that holds less of it (an older turn, whichever
  server wrote it) is moved on by compare-and-swap on the version read; one that holds
  more (a newer turn saved elsewhere) is never overwritten: the upload is dropped,
  logged and counted. A conversation parked in blocks is sent as its manifest and the
  blocks the tier lacks (:mod:`~strata_auto_sessions.shared.blocks`). A failed upload
  (the store down) is tried again every
  ``retry_s`` until it lands or a newer save replaces it; one pending at a stop is
  recorded in the ledger and tried again at the next start.
- before a restore, the key's heads are read: a file here is brought up to its head when
  the head holds more of its conversation, and a conversation this directory lacks is
  fetched (under a sibling number free here) when the request continues its prompt,
  each when the cost rule says it pays (its prefill against fetch and restore, at
  measured speeds), then restored as ever. Never another conversation's state, nor an
  older one over a newer. A stale local copy that could not be brought up to date is
  set aside, never restored. A tombstone (``strata-serve sessions rm``) removes the
  local copy of a conversation removed before its state began.
- local pruning removes local copies only; the shared tier forgets a conversation no
  server saved for ``max_age_days``, and an upload's objects outlive the head that
  stopped naming them by ``lease_s``, so a fetch under way finishes
  (:mod:`~strata_auto_sessions.shared.sweep`).

Every call on the tier is bounded (``timeout_s``, ``transfer_timeout_s``); every
blocking file operation runs in a thread.

Which head each local file's conversation has, and which generation of it the file
holds, is kept beside the files (``auto-.shared.json``, a name no conversation file
takes), for the files present alone, and written only when it changes
(:mod:`~strata_auto_sessions.shared.ledger`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Awaitable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from strata_serve import first_result

from strata_auto_sessions.compat import incompatibility
from strata_auto_sessions.config import SharedConfig, size_text
from strata_auto_sessions.digests import digest_matches, sample_digest
from strata_auto_sessions.naming import (
    PREFIX, SESSION_NAME, file_key, key_of_file, session_name, sibling_name, sibling_of,
)
from strata_auto_sessions.blocks import Manifest
from strata_auto_sessions.parked_blocks import CorruptBlock, ParkedBlocks, manifest_key
from strata_auto_sessions.shared.blocks import (
    TierBlocks, decode_manifest, encode_manifest, manifest_digest, put_in_store, unlink_staged,
)
from strata_auto_sessions.shared.ledger import LEDGER_NAME, Ledger, LedgerEntry, sidecar_name, temp_for
from strata_auto_sessions.shared.standing import (
    Standing, continued_by, continued_by_prompt, prompt_units, removed_since, standing,
)
from strata_auto_sessions.shared.sweep import sweep
from strata_auto_sessions.shared.tier import (
    ConditionFailed, ConditionsIgnored, DamagedHead, Head, SharedTier, SharedTierError, check_conditions, new_upload,
    writer_name,
)
from strata_auto_sessions.parts import Parts
from strata_auto_sessions.sidecar import DamagedSidecar, Sidecar

if TYPE_CHECKING:
    from strata_serve import Service, StrataRequest

log = logging.getLogger("strata_auto_sessions")

#: How often the shared tier is swept for expired conversations and unreferenced objects.
SWEEP_EVERY_S = 3600.0
#: How many times an upload reads the head again after another server wrote it meanwhile.
UPLOAD_RACES = 4
#: Conversations one key may hold in the shared tier (sibling numbers 0 to this).
MAX_SHARED_SIBLINGS = 1000
T = TypeVar("T")


class TransferSpeed:
    """Bytes and milliseconds of the fetches so far: how long the next one takes."""

    def __init__(self) -> None:
        self.bytes, self.ms = 0, 0.0

    def add(self, n: int, ms: float) -> None:
        if n and ms > 0:
            self.bytes += n
            self.ms += ms

    def seconds(self, size: int) -> float | None:
        return None if not self.ms else size / (self.bytes / self.ms * 1000)


class SharedParking:
    """One per server: the shared tier and what this server's slot directory holds of it."""

    def __init__(self, tier: SharedTier, config: SharedConfig, parts: Parts):
        assert parts.store is not None
        self.tier, self.config, self.parts = tier, config, parts
        self.directory = parts.store.directory
        self.stats = parts.stats
        self.ledger = Ledger(self.directory / LEDGER_NAME)
        self.fetch_speed = TransferSpeed()
        #: Set once the store proved it keeps its conditions (``check_conditions``).
        self.checked = False
        #: The store refused shared mode: nothing is sent or fetched any more.
        self.refused: str | None = None
        self._uploads: dict[str, asyncio.Task[None]] = {}
        self._again: set[str] = set()
        self._failed: set[str] = set()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._writer = writer_name()
        #: A lookup failed (the store down or hung): none is made before this
        #: (``time.monotonic()``), so that a request waits for the store once, not at every switch.
        self._down_until = 0.0
        self._checking: asyncio.Task[bool] | None = None
        #: A call on the tier was given up (it did not answer in its bound): why, and
        #: until when (``time.monotonic()``) every call fails at once instead of holding
        #: another thread or request on it; None once a call made since answers.
        self.unwell: str | None = None
        self._unwell_since = self._unwell_until = 0.0
        #: The tier's blocks, as this server knows them (conversations parked in blocks).
        self.tier_blocks = TierBlocks(tier, self._call, config.transfer_timeout_s)

    @classmethod
    async def start(cls, parts: Parts, service: Service, config: SharedConfig) -> SharedParking | None:
        """The shared tier the hook or ``shared.url`` names, checked: None when the store
        ignores conditional writes (shared mode refused, said why). A store that does not
        answer is not refused: it is checked again before its first use."""
        from strata_auto_sessions.shared import tier_for

        try:
            tier = first_result(service.pm, "auto_sessions_shared_tier", config=config, service=service) \
                or tier_for(config)
        except (SharedTierError, ValueError) as exc:
            log.error("[strata] auto sessions: shared tier %s unusable: %s; local parking alone", config.url, exc)
            return None
        shared = cls(tier, config, parts)
        await asyncio.to_thread(shared.ledger.load)
        if not await shared._check():
            if shared.refused is not None:
                await shared._close_tier()
                return None
            log.warning("[strata] auto sessions: shared tier %s does not answer yet; requests are answered with "
                        "local parking alone until it does", tier.where)
        else:
            log.info("[strata] auto sessions: shared tier %s: conversations parked here are shared", tier.where)
        shared._spawn(shared._sweep_loop())
        shared._resume_uploads()
        return shared

    async def _check(self) -> bool:
        """Whether the store is checked (now or before); sets :attr:`refused` when it ignores conditions."""
        if self.checked:
            return True
        try:
            await self._call(check_conditions(self.tier), self.config.timeout_s * 4)
        except ConditionsIgnored as exc:
            self.refused = str(exc)
            self.stats.shared_refused = 1
            log.error("[strata] auto sessions: shared tier: %s; local parking alone", exc)
            return False
        except (SharedTierError, OSError) as exc:
            log.info("[strata] auto sessions: shared tier %s not checked: %s", self.tier.where, exc)
            return False
        self.checked = True
        return True

    def _check_soon(self) -> None:
        """The store's check, in the background (a request never waits for it)."""
        if self._checking is None or self._checking.done():
            self._checking = self._spawn(self._check())

    async def _call(self, work: Awaitable[T], timeout: float | None = None) -> T:
        """``work``, given up after ``timeout`` (``timeout_s``) as :class:`SharedTierError`.

        A call given up marks the tier unwell: for ``retry_s`` every call fails at once
        (a hung store holds one caller once, never a thread or a request at each call),
        and ``/health`` says so until a call made since answers."""
        limit = self.config.timeout_s if timeout is None else timeout
        began = time.monotonic()
        if began < self._unwell_until:
            _discard(work)
            raise SharedTierError(f"{self.tier.where} is taken for hung ({self.unwell}); not asked again for "
                                  f"{self._unwell_until - began:.0f} s (shared.retry_s)")
        try:
            answer = await asyncio.wait_for(work, limit)
        except TimeoutError:
            now = time.monotonic()
            if self.unwell is None or now >= self._unwell_until:
                log.warning("[strata] auto sessions: shared tier %s did not answer within %g s: taken for hung, "
                            "no call on it for %g s (shared.retry_s); local parking alone meanwhile",
                            self.tier.where, limit, self.config.retry_s)
            self.unwell = f"a call did not answer within {limit:g} s"
            self._unwell_since, self._unwell_until = now, now + self.config.retry_s
            raise SharedTierError(f"{self.tier.where} did not answer within {limit:g} s") from None
        if self.unwell is not None and began > self._unwell_since:
            log.info("[strata] auto sessions: shared tier %s answers again", self.tier.where)
            self.unwell = None
        return answer

    def degraded(self) -> str | None:
        """What ``/health`` says of the tier: None while it answers."""
        if self.unwell is None:
            return None
        return f"shared tier not answering ({self.unwell}): conversations are parked locally alone"

    def _spawn(self, work: Awaitable[Any]) -> asyncio.Task[Any]:
        task: asyncio.Task[Any] = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # -- after a save ---------------------------------------------------------------

    def saved(self, name: str) -> None:
        """Conversation file ``name`` was just committed locally: upload it in the background."""
        if self.refused is not None:
            return
        entry = self.ledger.entries.get(name)
        self.ledger.entries[name] = LedgerEntry(entry.generation if entry else 0, dirty=True,
                                                shared=entry.shared if entry else None)
        if name in self._uploads:
            self._again.add(name)  # uploaded again once the one under way ends
            return
        self._uploads[name] = self._spawn(self._upload_loop(name))

    def _resume_uploads(self) -> None:
        """The uploads an earlier run of this server left pending (the store down, a
        restart before they landed): tried now, then every ``retry_s`` until they land."""
        pending = [name for name in self.ledger.pending() if name not in self._uploads]
        for name in pending:
            self._uploads[name] = self._spawn(self._upload_loop(name))
        if pending:
            log.info("[strata] auto sessions: shared tier: %d upload(s) pending since the last run: %s",
                     len(pending), ", ".join(pending))

    async def _upload_loop(self, name: str) -> None:
        try:
            # That an upload is pending is on disk before it is tried: a restart before it
            # lands tries it again (``_resume_uploads``).
            await self._write_ledger()
            while True:
                self._again.discard(name)
                try:
                    await self._upload(name)
                    self._failed.discard(name)
                    self._down_until = 0.0  # it answers: lookups again
                except (SharedTierError, OSError) as exc:
                    self.stats.shared_upload_failures += 1
                    if name not in self._failed:
                        log.warning("[strata] auto sessions: shared tier: uploading %s failed: %s; tried again "
                                    "every %g s", name, exc, self.config.retry_s)
                    if not self._failed:
                        self._spawn(self._retry_later())
                    self._failed.add(name)
                except Exception:  # never a request's failure, never silent
                    self.stats.shared_upload_failures += 1
                    log.exception("[strata] auto sessions: shared tier: uploading %s failed", name)
                if name not in self._again:
                    return
        finally:
            self._uploads.pop(name, None)
            await self._write_ledger()

    async def _retry_later(self) -> None:
        while self._failed and self.refused is None:
            await asyncio.sleep(self.config.retry_s)
            for name in sorted(self._failed):
                if name not in self._uploads:
                    self._uploads[name] = self._spawn(self._upload_loop(name))

    async def _upload(self, name: str) -> None:
        if not await self._check():
            if self.refused is not None:
                return
            raise SharedTierError(f"{self.tier.where} does not answer")
        assert self.parts.store is not None
        async with self.parts.store.lock_without_blocking(self.parts.config.lock_wait_s):
            snapshot = await asyncio.to_thread(self._snapshot, name)
        if snapshot is None:
            self.ledger.entries.pop(name, None)
            return  # pruned or removed here since: nothing to share
        bin_temp, json_temp, sidecar, manifest = snapshot
        try:
            await self._send(name, bin_temp, json_temp, sidecar, manifest)
        except FileNotFoundError:
            if manifest is None or Sidecar.read(self.directory / sidecar_name(name)) is not None:
                raise  # saved anew meanwhile (its blocks changed): tried again
            # Its blocks were removed by another process while they were sent (``sessions rm``).
            self.ledger.entries.pop(name, None)
        finally:
            if manifest is not None:
                self._parked_blocks().store.unpin(manifest.objects())
            if bin_temp is not None:
                bin_temp.unlink(missing_ok=True)
            json_temp.unlink(missing_ok=True)

    def _blocks_shared(self) -> bool:
        """Whether conversations parked in blocks go to the tier as blocks (``shared.blocks``,
        and a tier that keeps blocks: one of a plugin's may not)."""
        return self.config.blocks and callable(getattr(self.tier, "put_block", None))

    def _snapshot(self, name: str) -> tuple[Path | None, Path, Sidecar, Manifest | None] | None:
        """Hard links to the file and its sidecar as they are now (a save may replace them
        during the upload), and the sidecar read; for a conversation parked in blocks, its
        manifest as it is now, and no file (or its blocks joined, with ``shared.blocks`` off)."""
        path, side = self.directory / name, self.directory / sidecar_name(name)
        sidecar = Sidecar.read(side)
        if sidecar is not None and not path.exists() and (blocks := self._blocks_of(sidecar)) is not None:
            if self._blocks_shared():
                manifest = blocks.manifest(sidecar.key, sidecar.sibling)
                if manifest is None or manifest.tokens != sidecar.tokens:
                    return None  # removed, or replaced by a save not committed yet: its own upload follows
                json_temp = self.directory / temp_for(name, ".json")
                os.link(side, json_temp)
                # Its blocks stay until they are sent, as a whole file's hard link does: a
                # prune here meanwhile (``keep``) leaves the shared copy whole.
                blocks.store.pin(manifest.objects())
                return None, json_temp, sidecar, manifest
            return self._snapshot_blocks(name, side, sidecar)
        if sidecar is None or not path.is_file() or path.is_symlink():
            return None
        bin_temp, json_temp = self.directory / temp_for(name, ".bin"), self.directory / temp_for(name, ".json")
        try:
            os.link(path, bin_temp)
            os.link(side, json_temp)
        except OSError:
            bin_temp.unlink(missing_ok=True)
            raise
        return bin_temp, json_temp, sidecar, None

    def digest_of(self, sidecar: Sidecar) -> str:
        """A local state's digest as its head would carry it: a whole file's sampled one, or
        in blocks its manifest's (:func:`~strata_auto_sessions.shared.blocks.manifest_digest`)."""
        if sidecar.digest:
            return sidecar.digest
        blocks = self.parts.blocks
        manifest = None if blocks is None else blocks.manifest(sidecar.key, sidecar.sibling)
        return sidecar.digest if manifest is None else manifest_digest(manifest)

    def _parked_blocks(self) -> ParkedBlocks:
        """The slot directory's block store (there is one: a manifest was read from it)."""
        blocks = self.parts.blocks
        assert blocks is not None
        return blocks

    def _blocks_of(self, sidecar: Sidecar) -> ParkedBlocks | None:
        """The slot directory's block store, when it holds ``sidecar``'s conversation."""
        blocks = self.parts.blocks
        if blocks is None or blocks.manifest(sidecar.key, sidecar.sibling) is None:
            return None
        return blocks

    def _snapshot_blocks(self, name: str, side: Path, sidecar: Sidecar) -> tuple[Path, Path, Sidecar, None] | None:
        """A conversation parked in blocks: its blocks joined into the file the tier takes
        (the very bytes the engine saved: the sidecar's digest holds), beside its sidecar."""
        blocks = self._blocks_of(sidecar)
        assert blocks is not None
        bin_temp, json_temp = self.directory / temp_for(name, ".bin"), self.directory / temp_for(name, ".json")
        try:
            blocks.join_into(sidecar.key, sidecar.sibling, bin_temp)
        except (CorruptBlock, ValueError) as exc:
            log.warning("[strata] auto sessions: shared tier: not uploading %s: its blocks do not join (%s)", name, exc)
            return None
        try:
            os.link(side, json_temp)
        except OSError:
            bin_temp.unlink(missing_ok=True)
            raise
        return bin_temp, json_temp, sidecar, None

    async def _send(self, name: str, bin_temp: Path | None, json_temp: Path, sidecar: Sidecar,
                    manifest: Manifest | None = None) -> None:
        """Share local file ``name``'s state: under its conversation's head (the one that
        holds an earlier or later state of it), or a head of its own under the key (another
        server's conversation under the same key is never written over). A head that holds
        more of the conversation than this state is left as it is; one that holds less
        is moved on, by compare-and-swap on the version read (whichever server wrote it)."""
        began = time.monotonic()
        if manifest is not None:
            digest = manifest_digest(manifest)  # its identity, not a sidecar's (blocks keep no digest)
        elif sidecar.digest or bin_temp is None:
            digest = sidecar.digest
        else:
            digest = await asyncio.to_thread(sample_digest, bin_temp)
        for _race in range(UPLOAD_RACES):
            entry = self.ledger.entries.get(name) or LedgerEntry(0)
            found = await self._shared_place(name, entry, sidecar)
            if found is None:
                return  # removed by hand since its state began
            target, current = found
            head, version = current if current is not None else (None, None)
            base = entry.generation if entry.shared == target else 0
            if head is not None and not head.tombstone:
                where = standing(sidecar.prompt, sidecar.tokens, head)
                if where is Standing.SAME and head.digest == digest:
                    self.ledger.entries[name] = LedgerEntry(head.generation, name in self._again, target)
                    return  # this very state is the shared one already
                if head.generation > base and where is not Standing.AHEAD:
                    self.stats.shared_uploads_lost += 1
                    self.ledger.entries[name] = LedgerEntry(base, dirty=False, shared=target)
                    log.warning("[strata] auto sessions: shared tier: not uploading %s: another server saved a "
                                "newer turn of it (generation %d of %s, this copy was made from %d); its copy "
                                "is kept", name, head.generation, target, base)
                    return
            new = Head(generation=max(head.generation if head is not None else 0, base) + 1, upload=new_upload(),
                       tokens=sidecar.tokens, bytes=sidecar.bytes, digest=digest, created=sidecar.created,
                       writer=self._writer, prompt=sidecar.prompt, manifest=manifest is not None)
            objects = new.objects(target, sidecar_name(target))
            assert objects is not None
            try:
                sent = await self._put_objects(objects, bin_temp, json_temp, sidecar, manifest)
                await self._call(self.tier.put_head(target, new, version))
            except ConditionFailed:
                await self._forget_objects(objects)
                if head is None or head.tombstone or await self._still_ahead(target, sidecar):
                    continue  # a name taken meanwhile, or a head this state is newer than: again
                self.stats.shared_uploads_lost += 1
                self.ledger.entries[name] = LedgerEntry(base, dirty=False, shared=target)
                log.warning("[strata] auto sessions: shared tier: %s: another server saved it at the same time and "
                            "won; this save is not shared", name)
                return
            except BaseException:
                await self._forget_objects(objects)
                raise
            self.ledger.entries[name] = LedgerEntry(new.generation, dirty=name in self._again, shared=target)
            ms = (time.monotonic() - began) * 1000
            self.stats.shared_uploads += 1
            self.stats.shared_uploaded_bytes += sent
            self.stats.shared_upload_ms += ms
            log.info("[strata] auto sessions: shared tier: uploaded %s (%s%s, generation %d)%s in %.0f ms", name,
                     size_text(sent), f" of {size_text(sidecar.bytes)}: blocks the tier lacked" if manifest else "",
                     new.generation, "" if target == name else f" as {target}", ms)
            return
        self.stats.shared_uploads_lost += 1
        log.warning("[strata] auto sessions: shared tier: %s: other servers saved under its key %d times while "
                    "it was uploaded; this save is not shared", name, UPLOAD_RACES)

    async def _put_objects(self, objects: tuple[str, str], bin_temp: Path | None, json_temp: Path,
                           sidecar: Sidecar, manifest: Manifest | None) -> int:
        """A new head's state and sidecar put in the tier (the head itself is the caller's to
        write, last); the bytes sent. In blocks: the blocks the tier lacks first, then the
        manifest, so that a head never names a manifest whose blocks are not all in the tier."""
        if manifest is not None:
            sent = await self.tier_blocks.send(self._parked_blocks().store, manifest)
            data = encode_manifest(manifest)
            await self._call(self.tier.put_bytes(objects[0], data))
            sent += len(data)
        else:
            assert bin_temp is not None
            await self._call(self.tier.put(objects[0], bin_temp), self.config.transfer_timeout_s)
            sent = sidecar.bytes
        await self._call(self.tier.put(objects[1], json_temp), self.config.transfer_timeout_s)
        return sent

    async def _still_ahead(self, target: str, sidecar: Sidecar) -> bool:
        """Whether the state of ``sidecar`` is newer than the head another server just wrote at ``target``."""
        current = await self._call(self.tier.head(target))
        return current is not None and not current[0].tombstone and \
            standing(sidecar.prompt, sidecar.tokens, current[0]) is Standing.AHEAD

    async def _shared_place(self, name: str, entry: LedgerEntry,
                            sidecar: Sidecar) -> tuple[str, tuple[Head, str] | None] | None:
        """Where local file ``name``'s conversation is shared: the name of its head and
        that head with its version (None: a name no head takes, free for it). A head of
        another conversation is never its place: one of its own is chosen then, the
        lowest sibling number under the key no other conversation holds (its own number
        here first). None when the key was removed by hand (``strata-serve sessions rm``)
        since this state began: its copy here is then removed."""
        if entry.shared is not None:
            try:
                current = await self._call(self.tier.head(entry.shared))
            except DamagedHead as exc:
                # Its own head cannot be read: it is shared under a number no head takes
                # (the sweep logs and keeps the damaged one), never retried against it forever.
                log.warning("[strata] auto sessions: shared tier: the head of %s is damaged (%s); "
                            "shared anew", entry.shared, exc)
                entry.shared = None
        if entry.shared is not None:
            if current is None or current[0].tombstone \
                    or standing(sidecar.prompt, sidecar.tokens, current[0]) is not Standing.APART:
                if current is not None and removed_since(current[0], sidecar):
                    await self._removed_here(name)
                    return None
                return entry.shared, current
        match = SESSION_NAME.fullmatch(name)
        assert match is not None
        own = sibling_of(match)
        free: tuple[str, tuple[Head, str] | None] | None = None
        # Numbers are taken from the lowest up: the heads of the key are read in that order
        # (its own number first) up to the first number no head takes, never listed.
        for number in dict.fromkeys((own, *range(MAX_SHARED_SIBLINGS))):
            shared = sibling_name(name, number)
            try:
                current = await self._call(self.tier.head(shared))
            except DamagedHead:
                continue  # taken, by what cannot be read: never written over
            if current is None:
                free = free or (shared, None)
                if number != own:
                    break
                continue
            if removed_since(current[0], sidecar):  # rm KEY: every conversation of the key begun before
                await self._removed_here(name)
                return None
            if current[0].tombstone:
                free = free or (shared, current)
            elif standing(sidecar.prompt, sidecar.tokens, current[0]) is not Standing.APART:
                return shared, current
        if free is not None:
            return free
        raise SharedTierError(f"{MAX_SHARED_SIBLINGS} conversations are shared under {name}'s key: no room "
                              "for one more")

    async def _removed_here(self, name: str) -> None:
        self.stats.shared_uploads_removed += 1
        log.info("[strata] auto sessions: shared tier: %s was removed by hand since its state began: not "
                 "uploaded, and its copy here removed", name)
        await self._remove_local(name)

    async def _forget_objects(self, objects: tuple[str, ...]) -> None:
        for obj in objects:
            try:
                await self._call(self.tier.delete(obj))
            except (SharedTierError, OSError):
                pass  # unreferenced: the sweep removes it once its lease is over

    # -- before a restore ---------------------------------------------------------------

    async def bring_in(self, key: str, request: StrataRequest | None = None,
                       busy: frozenset[int] = frozenset()) -> None:
        """Bring the conversation ``key``'s files up to the shared tier's state, where that
        pays: a file here is replaced only by a newer state of its own conversation (one
        whose prompt continues the file's), never by another conversation's or an older
        one; a conversation this server lacks is fetched when ``request`` continues it,
        under a sibling number no file here and none of ``busy`` (those the slots hold
        unsaved) takes. Any failure leaves the local files as they are (or a stale one set
        aside)."""
        if self.refused is not None:
            return
        if not self.checked:
            # Not checked yet (it did not answer at start): checked beside the requests, which
            # go on with local parking alone meanwhile, never waiting for the check's calls.
            self._check_soon()
            return
        if time.monotonic() < self._down_until:
            return  # it failed a lookup lately: local parking alone, at once
        try:
            names = [name for name in await self._call(self.tier.heads(f"{PREFIX}{file_key(key)}."))
                     if name.endswith(".bin") and SESSION_NAME.fullmatch(name) is not None]
        except (SharedTierError, OSError) as exc:
            self.stats.shared_fetch_failures += 1
            self._down_until = time.monotonic() + self.config.retry_s
            log.warning("[strata] auto sessions: shared tier: cannot look up %s: %s; local parking alone, and "
                        "no lookups for %g s (shared.retry_s)", key, exc, self.config.retry_s)
            return
        self._down_until = 0.0
        try:
            here, taken = await asyncio.to_thread(self._here, key)
        except OSError as exc:
            log.warning("[strata] auto sessions: shared tier: cannot list %s's files here: %s", key, exc)
            return
        lacking: list[tuple[str, Head]] = []
        for shared in names:
            try:
                found = await self._bring_in_file(shared, here, request)
                if found is not None:
                    lacking.append((shared, found))
            except (SharedTierError, OSError, DamagedSidecar) as exc:
                self.stats.shared_fetch_failures += 1
                log.warning("[strata] auto sessions: shared tier: fetching %s failed: %s", shared, exc)
                mine = self._local_of(shared, here)
                if mine is not None:
                    await self._set_aside_if_stale(mine, shared)
            except Exception:
                self.stats.shared_fetch_failures += 1
                log.exception("[strata] auto sessions: shared tier: fetching %s failed", shared)
        if lacking and request is not None:
            await self._bring_in_new(key, request, lacking, here, taken | busy)
        await self._write_ledger()

    def _here(self, key: str) -> tuple[dict[str, Sidecar], set[int]]:
        """The key's conversation files here whose sidecars read, by name, and the sibling
        numbers any file of the key takes (damaged ones too: never written over)."""
        store = self.parts.store
        assert store is not None
        start = f"{PREFIX}{file_key(key)}"
        with os.scandir(self.directory) as entries:
            names = [entry.name for entry in entries if entry.name.startswith(start)]
        taken = set()
        for name in names:
            match = SESSION_NAME.fullmatch(name)
            if match is not None and key_of_file(match["key"]) == key:
                taken.add(sibling_of(match))
        sidecars = store.siblings(key)
        return {session_name(key, "bin", s.sibling): s for s in sidecars if s.key == key}, taken

    def _local_of(self, shared: str, here: dict[str, Sidecar]) -> str | None:
        """The file here that holds the conversation of head ``shared``, as the ledger says."""
        return next((name for name, entry in self.ledger.entries.items()
                     if entry.shared == shared and name in here), None)

    async def _bring_in_file(self, shared: str, here: dict[str, Sidecar], request: StrataRequest | None) -> Head | None:
        """Bring the file here that holds head ``shared``'s conversation up to it, where it is
        newer; the head, when no file here holds its conversation and ``request`` continues it."""
        current = await self._call(self.tier.head(shared))
        if current is None:
            return None
        head = current[0]
        name = self._local_of(shared, here)
        if name is None and not head.tombstone:
            # A file here of the same conversation the ledger does not tie to a head yet
            # (saved, not uploaded): tied to this one.
            name = next((mine for mine, sidecar in here.items()
                         if (mine not in self.ledger.entries or self.ledger.entries[mine].shared is None)
                         and standing(sidecar.prompt, sidecar.tokens, head) is not Standing.APART), None)
            if name is not None:
                entry = self.ledger.entries.get(name) or LedgerEntry(0)
                self.ledger.entries[name] = LedgerEntry(0, entry.dirty, shared)  # made from none of its generations
        if name is None and head.tombstone and shared in here and shared not in self.ledger.entries:
            name = shared  # a file from before the ledger, under the head's name
        if head.tombstone:
            local = here.get(name) if name is not None else None
            if local is not None and name is not None and head.removed is not None and local.created <= head.removed:
                self.stats.shared_removed_here += 1
                log.info("[strata] auto sessions: shared tier: %s was removed by hand: its copy here is removed",
                         name)
                await self._remove_local(name)
            return None
        if name is None:
            return head if request is not None and continued_by(head, request) else None
        local, entry = here[name], self.ledger.entries[name]
        if entry.generation >= head.generation:
            return None  # this copy is the shared one, or newer
        where = standing(local.prompt, local.tokens, head)
        if where is Standing.SAME and self.digest_of(local) == head.digest:
            self.ledger.entries[name] = LedgerEntry(head.generation, entry.dirty, shared)  # the same file
            return None
        if where in (Standing.AHEAD, Standing.APART):
            # Newer here (or another conversation now): never replaced; shared if it is not yet.
            if not entry.dirty and name not in self._uploads:
                self.saved(name)
            return None
        why_not = self._not_worth(head)
        if why_not is not None:
            self.stats.shared_fetches_not_worth += 1
            log.info("[strata] auto sessions: shared tier: not fetching %s: %s", shared, why_not)
            await self._set_aside_if_stale(name, shared)
            return None
        await self._fetch(name, shared, head)
        return None

    async def _bring_in_new(self, key: str, request: StrataRequest, lacking: list[tuple[str, Head]],
                            here: dict[str, Sidecar], taken: set[int]) -> None:
        """Fetch the longest of the conversations ``lacking`` here that ``request`` continues,
        unless a file here holds as much of it, under a sibling number none of ``taken`` is."""
        shared, head = max(lacking, key=lambda found: (prompt_units(found[1].prompt), found[1].tokens))
        if any(continued_by_prompt(sidecar.prompt, request)
               and prompt_units(sidecar.prompt) >= prompt_units(head.prompt) for sidecar in here.values()):
            return
        why_not = self._not_worth(head)
        if why_not is not None:
            self.stats.shared_fetches_not_worth += 1
            log.info("[strata] auto sessions: shared tier: not fetching %s: %s", shared, why_not)
            return
        number = next(n for n in range(len(taken) + 1) if n not in taken)
        try:
            await self._fetch(session_name(key, "bin", number), shared, head)
        except (SharedTierError, OSError, DamagedSidecar) as exc:
            self.stats.shared_fetch_failures += 1
            log.warning("[strata] auto sessions: shared tier: fetching %s failed: %s", shared, exc)
        except Exception:
            self.stats.shared_fetch_failures += 1
            log.exception("[strata] auto sessions: shared tier: fetching %s failed", shared)

    def _not_worth(self, head: Head) -> str | None:
        """Why fetching a file of ``head`` does not pay, or None when it does (or cannot be
        judged yet: when in doubt, fetch)."""
        worth, why_not = self.parts.costs.worth(head.tokens, head.bytes,
                                                  more_s=self.fetch_speed.seconds(head.bytes) or 0.0,
                                                  more="fetching")
        return None if worth else why_not

    async def _fetch(self, name: str, shared: str, head: Head) -> None:
        """Head ``shared``'s state, as local file ``name`` (its sidecar naming that file's sibling)."""
        objects = head.objects(shared, sidecar_name(shared))
        assert objects is not None
        match = SESSION_NAME.fullmatch(name)
        assert match is not None
        began = time.monotonic()
        bin_temp, json_temp = self.directory / temp_for(name, ".bin"), self.directory / temp_for(name, ".json")
        try:
            await self._call(self.tier.fetch(objects[1], json_temp))
            sidecar = await asyncio.to_thread(Sidecar.load, json_temp)
            if sidecar.key != key_of_file(match["key"]):
                raise SharedTierError(f"{objects[1]} is the sidecar of {sidecar.key!r}, not of {name}'s key")
            refusal = incompatibility(sidecar, self.parts.fingerprint, build_range=self.parts.config.build_range)
            if refusal is not None:
                self.stats.shared_fetches_not_worth += 1
                log.info("[strata] auto sessions: shared tier: not fetching %s (%s): %s", shared, refusal.reason,
                         refusal.detail)
                await self._set_aside_if_stale(name, shared)
                return
            if sidecar.sibling != sibling_of(match):
                sidecar.sibling = sibling_of(match)  # which of the key's files it is here
                await asyncio.to_thread(sidecar.write, json_temp)
            if head.manifest:
                n = await self._fetch_blocks(name, objects[0], json_temp, sidecar, head)
            else:
                n = await self._call(self.tier.fetch(objects[0], bin_temp), self.config.transfer_timeout_s)
                matches = await asyncio.to_thread(digest_matches, bin_temp, head.digest)
                if n != head.bytes or not matches:
                    raise SharedTierError(f"{objects[0]} is not the file its head describes "
                                          f"({n:,} bytes, {head.bytes:,} expected)")
                assert self.parts.store is not None
                async with self.parts.store.lock_without_blocking(self.parts.config.lock_wait_s):
                    await asyncio.to_thread(self._put_in_place, name, bin_temp, json_temp)
            self.ledger.entries[name] = LedgerEntry(head.generation, shared=shared)
        finally:
            await asyncio.to_thread(_unlink, bin_temp, json_temp)
        ms = (time.monotonic() - began) * 1000
        self.fetch_speed.add(n, ms)
        self.stats.shared_fetches += 1
        self.stats.shared_fetched_bytes += n
        self.stats.shared_fetch_ms += ms
        log.info("[strata] auto sessions: shared tier: fetched %s (%s, generation %d, saved by %s) in %.0f ms%s",
                 shared, size_text(n), head.generation, head.writer or "another server", ms,
                 "" if shared == name else f", as {name}")

    async def _fetch_blocks(self, name: str, manifest_object: str, json_temp: Path, sidecar: Sidecar,
                            head: Head) -> int:
        """A conversation shared in blocks, as local file ``name``'s: its manifest, and only
        the blocks the store here lacks, put in the store with the manifest and the sidecar
        (local pruning counts them as any save's); the bytes fetched.

        :raises SharedTierError: this server parks whole files (no block store), the
            manifest is not one of this format or not the state its head describes, or a
            block is missing or damaged: nothing is restored from it."""
        blocks = self.parts.blocks
        if blocks is None:
            raise SharedTierError(f"{manifest_object} is a conversation shared in blocks, and this server parks "
                                  "whole files (blocks = false): not fetched")
        data = await self._call(self.tier.fetch_bytes(manifest_object))
        manifest = decode_manifest(data, manifest_object)
        if manifest.tokens != head.tokens or manifest.tokens != sidecar.tokens:
            raise SharedTierError(f"{manifest_object} holds {manifest.tokens:,} tokens, its head "
                                  f"{head.tokens:,}: not the state its head describes")
        if manifest.format_version != blocks.store.format.version:
            raise SharedTierError(f"{manifest_object} was cut under state format {manifest.format_version!r}, "
                                  f"this engine's is {blocks.store.format.version!r}: not fetched")
        staged, fetched = await self.tier_blocks.bring(
            blocks.store, manifest, lambda block: self.directory / temp_for(name, f".{block[:8]}.blk"))
        try:
            assert self.parts.store is not None
            async with self.parts.store.lock_without_blocking(self.parts.config.lock_wait_s):
                await asyncio.to_thread(self._put_blocks_in_place, name, manifest, staged, json_temp, sidecar)
        finally:
            await asyncio.to_thread(unlink_staged, staged)
        return fetched + len(data)

    def _put_blocks_in_place(self, name: str, manifest: Manifest, staged: list[tuple[str, Path]], json_temp: Path,
                             sidecar: Sidecar) -> None:
        blocks = self.parts.blocks
        assert blocks is not None
        os.chmod(json_temp, 0o600)
        put_in_store(blocks.store, manifest, manifest_key(sidecar.key, sidecar.sibling), staged)
        (self.directory / name).unlink(missing_ok=True)  # a whole file of an older state of it
        os.replace(json_temp, self.directory / sidecar_name(name))

    def _put_in_place(self, name: str, bin_temp: Path, json_temp: Path) -> None:
        # The sidecar first, as a local commit does: a crash between the two leaves a
        # sidecar whose digest the old file fails, never restored.
        os.chmod(bin_temp, 0o600)
        os.chmod(json_temp, 0o600)
        blocks = self.parts.blocks
        if blocks is not None:
            # Parking in blocks: the fetched file is cut, only the blocks this store lacks
            # are written (a state the format refuses is kept whole, as fetched).
            sidecar = Sidecar.load(json_temp)
            if blocks.save(sidecar.key, sidecar.sibling, bin_temp).refused is None:
                (self.directory / name).unlink(missing_ok=True)
                os.replace(json_temp, self.directory / sidecar_name(name))
                return
            blocks.remove(sidecar.key, sidecar.sibling)
        os.replace(json_temp, self.directory / sidecar_name(name))
        os.replace(bin_temp, self.directory / name)

    async def _set_aside_if_stale(self, name: str, shared: str) -> None:
        """A newer state of local file ``name``'s conversation is in the shared tier (head
        ``shared``) and was not brought in: the copy here is removed rather than restored
        stale. A copy as new or newer, or of another conversation, stays."""
        current = None
        try:
            current = await self._call(self.tier.head(shared))
        except (SharedTierError, OSError):
            return
        entry = self.ledger.entries.get(name)
        if current is None or current[0].tombstone or (
                entry is not None and entry.shared == shared and entry.generation >= current[0].generation):
            return
        local = await asyncio.to_thread(Sidecar.read, self.directory / sidecar_name(name))
        if local is None or standing(local.prompt, local.tokens, current[0]) is not Standing.BEHIND:
            return
        if await asyncio.to_thread((self.directory / name).is_file) or self._blocks_of(local) is not None:
            self.stats.shared_stale_set_aside += 1
            log.info("[strata] auto sessions: shared tier: the copy of %s here is older than the shared one "
                     "(%s, generation %d): removed, never restored stale", name, shared, current[0].generation)
            await self._remove_local(name)

    async def _remove_local(self, name: str) -> None:
        assert self.parts.store is not None
        async with self.parts.store.lock_without_blocking(self.parts.config.lock_wait_s):
            await asyncio.to_thread(self._unlink_pair, name)
        self.ledger.entries.pop(name, None)

    def _unlink_pair(self, name: str) -> None:
        (self.directory / name).unlink(missing_ok=True)
        sidecar = Sidecar.read(self.directory / sidecar_name(name))
        blocks = self._blocks_of(sidecar) if sidecar is not None else None
        (self.directory / sidecar_name(name)).unlink(missing_ok=True)
        if blocks is not None and sidecar is not None:
            blocks.remove(sidecar.key, sidecar.sibling)
            blocks.free_unheld()

    def _save_ledger(self, number: int, text: str) -> None:
        try:
            self.ledger.write(number, text)
        except OSError as exc:
            log.warning("[strata] auto sessions: shared tier: cannot record %s: %s", LEDGER_NAME, exc)

    async def _write_ledger(self) -> None:
        """The ledger as it stands now, written in a thread and waited for at most
        ``timeout_s``: a request never waits longer on it (the write goes on; the next one
        records the same, and an older one never lands over it)."""
        number, text = self.ledger.render()
        try:
            await asyncio.wait_for(asyncio.to_thread(self._save_ledger, number, text), self.config.timeout_s)
        except TimeoutError:
            log.warning("[strata] auto sessions: shared tier: recording %s took over %g s; not waited for",
                        LEDGER_NAME, self.config.timeout_s)

    # -- the shared tier's own upkeep ---------------------------------------------------

    async def _sweep_loop(self) -> None:
        while self.refused is None:
            try:
                if await self._check():
                    await sweep(self.tier, self.config, self._call, self.stats)
            except (SharedTierError, OSError) as exc:
                log.info("[strata] auto sessions: shared tier: sweep not done: %s", exc)
            except Exception:
                log.exception("[strata] auto sessions: shared tier: sweep failed")
            await asyncio.sleep(SWEEP_EVERY_S)

    async def settled(self, timeout: float) -> bool:
        """Wait at most ``timeout`` for the uploads under way; whether they all ended."""
        deadline = time.monotonic() + timeout
        while self._uploads and time.monotonic() < deadline:
            await asyncio.wait(list(self._uploads.values()), timeout=max(deadline - time.monotonic(), 0))
        return not self._uploads

    async def close(self, timeout: float) -> None:
        """The server stops: the uploads under way get ``timeout`` to end, then all stops."""
        if not await self.settled(timeout):
            log.warning("[strata] auto sessions: shared tier: %d upload(s) not finished at the stop: %s",
                        len(self._uploads), ", ".join(sorted(self._uploads)))
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:  # a call on the tier ends at its cancellation; bounded all the same
            await asyncio.wait(list(self._tasks), timeout=self.config.timeout_s)
        await self._write_ledger()
        await self._close_tier()

    async def _close_tier(self) -> None:
        """The tier closed, within ``timeout_s``: a call stuck in it (a hung mount) is left
        to its thread, which never keeps the process alive."""
        try:
            await asyncio.wait_for(self.tier.close(), self.config.timeout_s)
        except (TimeoutError, SharedTierError, OSError) as exc:
            log.info("[strata] auto sessions: shared tier: closing: %s", exc)


def _discard(work: Awaitable[Any]) -> None:
    """A call not made: its coroutine closed (never awaited, never warned of)."""
    if asyncio.iscoroutine(work):
        work.close()
    elif isinstance(work, asyncio.Future):
        work.cancel()

def _unlink(*paths: Path) -> None:
    for path in paths:
        path.unlink(missing_ok=True)
