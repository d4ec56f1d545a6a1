"""auto-sessions and the shared tier: uploads after a save, fetches before a restore.

The engine reads and writes the slot directory alone; this module keeps the shared tier
in step with it, never on a request's path for long and never failing one:

- after a save commits locally, the file, then its sidecar, then the head (by
  compare-and-swap) are uploaded in the background. A head another server moved on
  since this copy's generation (a newer turn saved there) is never overwritten: the
  upload is dropped, logged and counted. A failed upload (the store down) is tried
  again every ``retry_s`` until it lands or a newer save replaces it.
- before a restore, the conversation's heads are read: a file this directory lacks, or
  holds at an older generation than the shared one, is fetched when the cost rule says
  it pays (its prefill against fetch and restore, at measured speeds), then restored as
  ever. A stale local copy that could not be brought up to date is set aside, never
  restored. A tombstone (``strata-serve sessions rm``) removes the local copy of a
  conversation removed before its state began.
- local pruning removes local copies only; the shared tier forgets a conversation no
  server saved for ``max_age_days``, and an upload's objects outlive the head that
  stopped naming them by ``lease_s``, so a fetch under way finishes.

Every call on the tier is bounded (``timeout_s``, ``transfer_timeout_s``); every
blocking file operation runs in a thread.

Which generation each local file holds is kept beside the files (``auto-.shared.json``):
a name no conversation file takes.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
import uuid
from collections.abc import Awaitable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from strata_serve import first_result

from strata_auto_sessions.compat import incompatibility
from strata_auto_sessions.config import SharedConfig, size_text
from strata_auto_sessions.digests import digest_matches, sample_digest
from strata_auto_sessions.naming import PREFIX, TEMP_PREFIX, file_key
from strata_auto_sessions.shared.tier import (
    ConditionFailed, ConditionsIgnored, DamagedHead, Head, SharedTier, SharedTierError, check_conditions, new_upload,
    object_name, writer_name,
)
from strata_auto_sessions.sidecar import DamagedSidecar, Sidecar

if TYPE_CHECKING:
    from strata_auto_sessions.parking import AutoSessions

log = logging.getLogger("strata_auto_sessions")

#: Which generation of the shared tier each local file holds, beside the files.
LEDGER_NAME = f"{PREFIX}.shared.json"
#: How often the shared tier is swept for expired conversations and unreferenced objects.
SWEEP_EVERY_S = 3600.0
T = TypeVar("T")


def sidecar_name(name: str) -> str:
    """The sidecar of conversation file ``name`` (``auto-x.bin`` -> ``auto-x.json``, and
    ``auto-x.1.bin`` -> ``auto-x.1.json`` for a sibling)."""
    return name[: -len(".bin")] + ".json"


def temp_for(name: str, suffix: str) -> str:
    """A temporary's name in the slot directory for file ``name``: one the next start sweeps."""
    return f"{TEMP_PREFIX}{name[len(PREFIX):].split('.')[0]}-{uuid.uuid4().hex[:8]}{suffix}"


@dataclass
class _Local:
    """What the ledger says of a local file: the shared generation it is, or was made
    from (``dirty``: saved here since, not uploaded yet)."""

    generation: int
    dirty: bool = False


class Ledger:
    """``auto-.shared.json``: name -> the shared generation the local file holds."""

    def __init__(self, path: Path):
        self.path = path
        self.entries: dict[str, _Local] = {}

    def load(self) -> None:
        try:
            raw = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return
        if isinstance(raw, dict):
            for name, entry in raw.items():
                if isinstance(entry, dict) and isinstance(entry.get("generation"), int):
                    self.entries[name] = _Local(entry["generation"], bool(entry.get("dirty")))

    def save(self) -> None:
        temp = self.path.with_name(temp_for(f"{PREFIX}ledger", ".json"))
        temp.write_text(json.dumps({name: {"generation": e.generation, "dirty": e.dirty}
                                    for name, e in self.entries.items()}))
        os.replace(temp, self.path)


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

    def __init__(self, tier: SharedTier, config: SharedConfig, parking: AutoSessions):
        assert parking.store is not None
        self.tier, self.config, self.parking = tier, config, parking
        self.directory = parking.store.directory
        self.stats = parking.stats
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

    @classmethod
    async def start(cls, parking: AutoSessions, service: Any, config: SharedConfig) -> SharedParking | None:
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
        shared = cls(tier, config, parking)
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
        self.ledger.entries[name] = _Local(entry.generation if entry else 0, dirty=True)
        if name in self._uploads:
            self._again.add(name)  # uploaded again once the one under way ends
            return
        self._uploads[name] = self._spawn(self._upload_loop(name))

    async def _upload_loop(self, name: str) -> None:
        try:
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
        assert self.parking.store is not None
        async with self.parking.store.lock_without_blocking(self.parking.config.lock_wait_s):
            snapshot = await asyncio.to_thread(self._snapshot, name)
        if snapshot is None:
            return  # pruned or removed here since: nothing to share
        bin_temp, json_temp, sidecar = snapshot
        try:
            await self._send(name, bin_temp, json_temp, sidecar)
        finally:
            bin_temp.unlink(missing_ok=True)
            json_temp.unlink(missing_ok=True)

    def _snapshot(self, name: str) -> tuple[Path, Path, Sidecar] | None:
        """Hard links to the file and its sidecar as they are now (a save may replace them
        during the upload), and the sidecar read."""
        path, side = self.directory / name, self.directory / sidecar_name(name)
        sidecar = Sidecar.read(side)
        if sidecar is None or not path.is_file() or path.is_symlink():
            return None
        bin_temp, json_temp = self.directory / temp_for(name, ".bin"), self.directory / temp_for(name, ".json")
        try:
            os.link(path, bin_temp)
            os.link(side, json_temp)
        except OSError:
            bin_temp.unlink(missing_ok=True)
            raise
        return bin_temp, json_temp, sidecar

    async def _send(self, name: str, bin_temp: Path, json_temp: Path, sidecar: Sidecar) -> None:
        began = time.monotonic()
        base = self.ledger.entries.get(name, _Local(0)).generation
        current = await self._call(self.tier.head(name))
        head, version = current if current is not None else (None, None)
        if head is not None and head.tombstone and head.removed is not None and head.removed >= sidecar.created:
            self.stats.shared_uploads_removed += 1
            log.info("[strata] auto sessions: shared tier: %s was removed by hand since its state began: not "
                     "uploaded, and its copy here removed", name)
            await self._remove_local(name)
            return
        if head is not None and not head.tombstone and head.generation > base:
            self.stats.shared_uploads_lost += 1
            self.ledger.entries[name] = _Local(base, dirty=False)
            log.warning("[strata] auto sessions: shared tier: not uploading %s: another server saved a newer turn "
                        "of it (generation %d, this copy was made from %d); its copy is kept", name,
                        head.generation, base)
            return
        digest = sidecar.digest or await asyncio.to_thread(sample_digest, bin_temp)
        upload = new_upload()
        objects = (object_name(name, upload), object_name(sidecar_name(name), upload))
        try:
            await self._call(self.tier.put(objects[0], bin_temp), self.config.transfer_timeout_s)
            await self._call(self.tier.put(objects[1], json_temp), self.config.transfer_timeout_s)
            new = Head(generation=(head.generation if head is not None else 0) + 1, upload=upload,
                       tokens=sidecar.tokens, bytes=sidecar.bytes, digest=digest, created=sidecar.created,
                       writer=self._writer)
            await self._call(self.tier.put_head(name, new, version))
        except ConditionFailed:
            self.stats.shared_uploads_lost += 1
            self.ledger.entries[name] = _Local(base, dirty=False)
            log.warning("[strata] auto sessions: shared tier: %s: another server saved it at the same time and "
                        "won; this save is not shared", name)
            await self._forget_objects(objects)
            return
        except BaseException:
            await self._forget_objects(objects)
            raise
        self.ledger.entries[name] = _Local(new.generation, dirty=name in self._again)
        ms = (time.monotonic() - began) * 1000
        self.stats.shared_uploads += 1
        self.stats.shared_uploaded_bytes += sidecar.bytes
        self.stats.shared_upload_ms += ms
        log.info("[strata] auto sessions: shared tier: uploaded %s (%s, generation %d) in %.0f ms", name,
                 size_text(sidecar.bytes), new.generation, ms)

    async def _forget_objects(self, objects: tuple[str, ...]) -> None:
        for obj in objects:
            try:
                await self._call(self.tier.delete(obj))
            except (SharedTierError, OSError):
                pass  # unreferenced: the sweep removes it once its lease is over

    # -- before a restore ---------------------------------------------------------------

    async def bring_in(self, key: str) -> None:
        """Bring the conversation ``key``'s files up to the shared tier's state, where that
        pays; any failure leaves the local files as they are (or a stale one set aside)."""
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
                     if name.endswith(".bin")]
        except (SharedTierError, OSError) as exc:
            self.stats.shared_fetch_failures += 1
            self._down_until = time.monotonic() + self.config.retry_s
            log.warning("[strata] auto sessions: shared tier: cannot look up %s: %s; local parking alone, and "
                        "no lookups for %g s (shared.retry_s)", key, exc, self.config.retry_s)
            return
        self._down_until = 0.0
        for name in names:
            try:
                await self._bring_in_file(name)
            except (SharedTierError, OSError, DamagedSidecar) as exc:
                self.stats.shared_fetch_failures += 1
                log.warning("[strata] auto sessions: shared tier: fetching %s failed: %s", name, exc)
                await self._set_aside_if_stale(name)
            except Exception:
                self.stats.shared_fetch_failures += 1
                log.exception("[strata] auto sessions: shared tier: fetching %s failed", name)
        await self._write_ledger()

    async def _bring_in_file(self, name: str) -> None:
        current = await self._call(self.tier.head(name))
        if current is None:
            return
        head = current[0]
        local = await asyncio.to_thread(Sidecar.read, self.directory / sidecar_name(name))
        has_local = local is not None and await asyncio.to_thread((self.directory / name).is_file)
        if head.tombstone:
            if has_local and local is not None and head.removed is not None and local.created <= head.removed:
                self.stats.shared_removed_here += 1
                log.info("[strata] auto sessions: shared tier: %s was removed by hand: its copy here is removed",
                         name)
                await self._remove_local(name)
            return
        entry = self.ledger.entries.get(name)
        if has_local and entry is not None and entry.generation >= head.generation:
            return  # this copy is the shared one, or newer
        if has_local and local is not None and entry is None and local.digest == head.digest:
            self.ledger.entries[name] = _Local(head.generation)  # the same file, from before the ledger
            return
        why_not = self._not_worth(head)
        if why_not is not None:
            self.stats.shared_fetches_not_worth += 1
            log.info("[strata] auto sessions: shared tier: not fetching %s: %s", name, why_not)
            await self._set_aside_if_stale(name)
            return
        await self._fetch(name, head)

    def _not_worth(self, head: Head) -> str | None:
        """Why fetching a file of ``head`` does not pay, or None when it does (or cannot be
        judged yet: when in doubt, fetch)."""
        config = self.parking.config
        if head.tokens < config.min_tokens:
            return f"{head.tokens:,} tokens is below min_tokens ({config.min_tokens:,})"
        prefill_s = self.parking.prefill_seconds(head.tokens)
        if config.min_prefill_s <= 0 or prefill_s is None:
            return None
        fetch_s = self.fetch_speed.seconds(head.bytes) or 0.0
        restore_s = self.parking.restore_seconds(head.bytes) or 0.0
        if prefill_s - fetch_s - restore_s < config.min_prefill_s:
            return (f"re-reading its {head.tokens:,} tokens takes about {prefill_s:.1f} s here, less than "
                    f"min_prefill_s ({config.min_prefill_s:g} s) more than fetching ({fetch_s:.1f} s) and "
                    f"restoring it ({restore_s:.1f} s)")
        return None

    async def _fetch(self, name: str, head: Head) -> None:
        objects = head.objects(name, sidecar_name(name))
        assert objects is not None
        began = time.monotonic()
        bin_temp, json_temp = self.directory / temp_for(name, ".bin"), self.directory / temp_for(name, ".json")
        try:
            await self._call(self.tier.fetch(objects[1], json_temp))
            sidecar = await asyncio.to_thread(Sidecar.load, json_temp)
            refusal = incompatibility(sidecar, self.parking.fingerprint, build_range=self.parking.config.build_range)
            if refusal is not None:
                self.stats.shared_fetches_not_worth += 1
                log.info("[strata] auto sessions: shared tier: not fetching %s (%s): %s", name, refusal.reason,
                         refusal.detail)
                await self._set_aside_if_stale(name)
                return
            n = await self._call(self.tier.fetch(objects[0], bin_temp), self.config.transfer_timeout_s)
            matches = await asyncio.to_thread(digest_matches, bin_temp, head.digest)
            if n != head.bytes or not matches:
                raise SharedTierError(f"{objects[0]} is not the file its head describes "
                                      f"({n:,} bytes, {head.bytes:,} expected)")
            assert self.parking.store is not None
            async with self.parking.store.lock_without_blocking(self.parking.config.lock_wait_s):
                await asyncio.to_thread(self._put_in_place, name, bin_temp, json_temp)
            self.ledger.entries[name] = _Local(head.generation)
        finally:
            await asyncio.to_thread(_unlink, bin_temp, json_temp)
        ms = (time.monotonic() - began) * 1000
        self.fetch_speed.add(n, ms)
        self.stats.shared_fetches += 1
        self.stats.shared_fetched_bytes += n
        self.stats.shared_fetch_ms += ms
        log.info("[strata] auto sessions: shared tier: fetched %s (%s, generation %d, saved by %s) in %.0f ms",
                 name, size_text(n), head.generation, head.writer or "another server", ms)

    def _put_in_place(self, name: str, bin_temp: Path, json_temp: Path) -> None:
        # The sidecar first, as a local commit does: a crash between the two leaves a
        # sidecar whose digest the old file fails, never restored.
        os.chmod(bin_temp, 0o600)
        os.chmod(json_temp, 0o600)
        os.replace(json_temp, self.directory / sidecar_name(name))
        os.replace(bin_temp, self.directory / name)

    async def _set_aside_if_stale(self, name: str) -> None:
        """A newer state of ``name`` is in the shared tier and was not brought in: the copy
        here is removed rather than restored stale."""
        current = None
        try:
            current = await self._call(self.tier.head(name))
        except (SharedTierError, OSError):
            return
        entry = self.ledger.entries.get(name)
        if current is None or current[0].tombstone or (entry is not None and entry.generation >= current[0].generation):
            return
        if await asyncio.to_thread((self.directory / name).is_file):
            self.stats.shared_stale_set_aside += 1
            log.info("[strata] auto sessions: shared tier: the copy of %s here is older than the shared one "
                     "(generation %d): removed, never restored stale", name, current[0].generation)
            await self._remove_local(name)

    async def _remove_local(self, name: str) -> None:
        assert self.parking.store is not None
        async with self.parking.store.lock_without_blocking(self.parking.config.lock_wait_s):
            await asyncio.to_thread(self._unlink_pair, name)
        self.ledger.entries.pop(name, None)

    def _unlink_pair(self, name: str) -> None:
        (self.directory / name).unlink(missing_ok=True)
        (self.directory / sidecar_name(name)).unlink(missing_ok=True)

    def _save_ledger(self) -> None:
        try:
            self.ledger.save()
        except OSError as exc:
            log.warning("[strata] auto sessions: shared tier: cannot record %s: %s", LEDGER_NAME, exc)

    async def _write_ledger(self) -> None:
        """:meth:`_save_ledger` in a thread, waited for at most ``timeout_s``: a request
        never waits longer on it (the write goes on; the next one records the same)."""
        try:
            await asyncio.wait_for(asyncio.to_thread(self._save_ledger), self.config.timeout_s)
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


async def sweep(tier: SharedTier, config: SharedConfig, call: Any, stats: Any = None) -> tuple[int, int]:
    """Forget conversations no server saved for ``max_age_days`` (their heads, by
    compare-and-swap: one saved meanwhile stays), tombstones as old, objects no head
    names once ``lease_s`` has passed since they were written (a fetch or an upload
    under way ends sooner), and what uploads that never ended left (a killed server's
    partial object or open multipart upload) once as old. A damaged head is logged,
    counted (``stats.shared_damaged_heads``) and passed over, its conversation's objects
    kept: it never stops the sweep. Returns (heads, objects) removed."""
    now = time.time()
    max_age = config.max_age_days * 86400
    live: set[str] = set()
    unknown: list[str] = []  # the objects' names of conversations whose head is damaged begin so
    heads_removed = 0
    for name in await call(tier.heads(PREFIX)):
        if not name.endswith(".bin"):
            continue
        try:
            current = await call(tier.head(name))
        except DamagedHead as exc:
            unknown.append(name[: -len(".bin")] + ".")
            if stats is not None:
                stats.shared_damaged_heads += 1
            log.warning("[strata] auto sessions: shared tier: %s: damaged head passed over by the sweep, its "
                        "objects kept: %s", name, exc)
            continue
        if current is None:
            continue
        head, version = current
        if now - head.written > max_age:
            try:
                await call(tier.delete_head(name, version))
                heads_removed += 1
                continue
            except ConditionFailed:
                current = await call(tier.head(name))
                if current is None:
                    continue
                head = current[0]
        objects = head.objects(name, sidecar_name(name))
        live.update(objects or ())
    objects_removed = 0
    for listed in await call(tier.list(PREFIX)):
        if listed.name not in live and not listed.name.startswith(tuple(unknown)) \
                and now - listed.modified > config.lease_s:
            await call(tier.delete(listed.name))
            objects_removed += 1
    remove_partial = getattr(tier, "remove_partial", None)  # a tier of a plugin's may have none
    if remove_partial is not None:
        objects_removed += await call(remove_partial(config.lease_s))
    if heads_removed or objects_removed:
        log.info("[strata] auto sessions: shared tier: expired %d conversation file(s), removed %d object(s) no "
                 "head names", heads_removed, objects_removed)
    return heads_removed, objects_removed


async def remove_by_hand(tier: SharedTier, config: SharedConfig, keys: list[str]) -> list[str]:
    """``strata-serve sessions rm``: a tombstone over each shared file of ``keys`` (its
    objects go at the next sweep), so no server's later upload of a state begun before
    now brings it back. Returns the names removed."""
    removed = []
    now = time.time()

    async def call(work: Awaitable[T]) -> T:
        return await asyncio.wait_for(work, config.timeout_s)

    for key in keys:
        for name in await call(tier.heads(f"{PREFIX}{file_key(key)}.")):
            if not name.endswith(".bin"):
                continue
            for _attempt in range(5):
                current = await call(tier.head(name))
                generation = current[0].generation if current is not None else 0
                try:
                    await call(tier.put_head(name, Head(generation=generation + 1, upload=None, removed=now,
                                                        writer=writer_name()),
                                             current[1] if current is not None else None))
                    removed.append(name)
                    break
                except ConditionFailed:
                    continue  # a server saved it meanwhile: over that one too
    return removed
