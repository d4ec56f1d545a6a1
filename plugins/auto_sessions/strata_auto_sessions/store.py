"""The store: where parked sessions rest (the :class:`ParkingStore` contract auto-sessions
asks of one), and :class:`SessionStore`, the default, which keeps them in the engine's
slot directory, written so nothing is half-done.

What the files are named is :mod:`~strata_auto_sessions.naming`'s; what a sidecar holds,
:mod:`~strata_auto_sessions.sidecar`'s; which model a file belongs to,
:mod:`~strata_auto_sessions.fingerprint`'s; whether the running engine can restore it,
:mod:`~strata_auto_sessions.compat`'s; the directory's locks,
:mod:`~strata_auto_sessions.locks`'.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
from pathlib import Path
from stat import S_ISREG
from typing import Any, Protocol
from collections.abc import Callable

from strata_serve import PRIVATE_FILE_MODE, make_private_dir, span

from strata_auto_sessions.clock import CLOCK_SLACK_S, as_of, last_use
from strata_auto_sessions.compat import BUILD_RANGE, REFUSAL_REASONS, Refusal, incompatibility, swa_unusable
from strata_auto_sessions.digests import DIGEST_BLOCK_BYTES, DIGEST_BLOCKS, digest_matches, sample_digest
from strata_auto_sessions.fingerprint import (
    FINGERPRINT_BYTES, WEIGHT_BLOCK_BYTES, WEIGHT_SPREAD_BLOCKS, WEIGHT_WHOLE_BYTES, engine_fingerprint,
    fingerprint, same_model, sliding_window, weights_digest,
)
from strata_auto_sessions.known import KnownFiles
from strata_auto_sessions.locks import DirectoryInUse, DirectoryLock, LockTimeout, ServerClaim
from strata_auto_sessions.naming import (
    ENGINE_NAME, HELD_NAME, PREFIX, REMOVED_NAME, SERVER_LOCK_NAME, SESSION_NAME, TEMP_NAME, TEMP_PREFIX,
    file_key, fresh_json_temp_name, fresh_temp_name, key_of_file, session_name, sibling_of,
)
from strata_auto_sessions.blocks import Chain
from strata_auto_sessions.parked_blocks import ParkedBlocks
from strata_auto_sessions.sidecar import SIDECAR_VERSION, DamagedSidecar, Sidecar
from strata_auto_sessions.staging import Staging, staged_link

log = logging.getLogger("strata_auto_sessions")

#: What this module exports: its own names and those of the modules the store is made of
#: that plugins and tests import from here.
__all__ = [
    "BUILD_RANGE", "CLOCK_SLACK_S", "DIGEST_BLOCKS", "DIGEST_BLOCK_BYTES", "ENGINE_NAME", "FINGERPRINT_BYTES",
    "HELD_NAME", "PREFIX", "REFUSAL_REASONS", "REMOVED_NAME", "SERVER_LOCK_NAME", "SESSION_NAME",
    "SIDECAR_VERSION", "TEMP_NAME", "TEMP_PREFIX", "WEIGHT_BLOCK_BYTES", "WEIGHT_SPREAD_BLOCKS",
    "WEIGHT_WHOLE_BYTES", "DamagedSidecar", "DirectoryInUse", "LockTimeout", "ParkingStore", "Refusal",
    "SessionStore", "Sidecar", "as_of", "engine_fingerprint", "file_key", "fingerprint", "incompatibility",
    "key_of_file", "last_use", "same_model", "sample_digest", "sliding_window", "swa_unusable",
    "weights_digest",
]


class ParkingStore(Protocol):
    """What auto-sessions asks of the place where parked sessions rest.

    Names are file names in the engine's slot directory: the engine saves into
    ``temp_name(key)`` there and restores from ``bin_name(key, sibling)`` there. A store that
    keeps files elsewhere too copies them out in :meth:`commit` and back in :meth:`stage`.
    Choose one with the ``auto_sessions_store`` hook.

    A key may have several files, its *siblings*: conversations that share the key (clients
    without ids that open alike) and are kept apart, numbered from 0 (``sibling``; a
    sidecar says its own in ``Sidecar.sibling``). Where a method takes ``sibling``, 0 is
    the first, the one a key had before there were siblings.
    """

    directory: Path

    def bin_name(self, key: str, sibling: int = 0) -> str: ...

    def bin_path(self, key: str, sibling: int = 0) -> Path: ...

    def stage(self, key: str, sibling: int = 0) -> bool:
        """Make ``bin_name(key, sibling)`` available in the slot directory; False when there is no file."""
        ...

    def sidecar(self, key: str, sibling: int = 0) -> Sidecar | None:
        """The file's sidecar; None when there is no file (never made, removed or pruned)."""
        ...

    def siblings(self, key: str) -> list[Sidecar]:
        """The sidecars of every file of ``key`` (each names its ``sibling``), newest first."""
        ...

    def intact(self, key: str, sidecar: Sidecar) -> bool:
        """Whether the file ``sidecar`` describes (its key and sibling) is the one saved."""
        ...

    def sidecar_problem(self, key: str, sibling: int = 0) -> str | None:
        """Why the conversation's sidecar is refused (:class:`DamagedSidecar`); None when it
        reads or there is none."""
        ...

    def damaged(self) -> list[tuple[str, Path, str]]:
        """``(key, path, why)`` of every session file whose sidecar is refused."""
        ...

    def temp_name(self, key: str) -> str: ...

    def prepare(self) -> int: ...

    def lock(self) -> contextlib.AbstractContextManager[None]:
        """Held around every change of the files and every restore, by the server and by
        ``strata-serve sessions``, so neither sees the other's work half-done."""
        ...

    def lock_without_blocking(self, timeout_s: float) -> contextlib.AbstractAsyncContextManager[None]:
        """:meth:`lock` as the server takes it: never blocking the event loop, and given up
        after ``timeout_s`` (:class:`LockTimeout`); the calls made while it is held take
        :meth:`lock` without waiting."""
        ...

    def commit(self, temp_name: str, key: str, sidecar: Sidecar) -> bool | None:
        """Put a finished save under its name (``key``'s ``sidecar.sibling``); False when the
        session was removed by hand (``strata-serve sessions rm``) since its state began
        (``sidecar.created``): the save is dropped."""
        ...

    def record_held(self, keys: list[str]) -> None:
        """Record the conversations the server holds in its slots or is running, saved or
        not, for ``strata-serve sessions rm`` (another process)."""
        ...

    def release(self) -> None:
        """The server stops: let go of the directory (a store that claims none does nothing)."""
        ...

    def describe_engine(self, fingerprint: dict[str, Any]) -> None:
        """Record what the running engine is, for ``strata-serve sessions ls``."""
        ...

    def discard(self, temp_name: str) -> None: ...

    def touch(self, key: str, sibling: int = 0) -> None: ...

    def prune(self, keep: int, max_bytes: int, protect: frozenset[str] = frozenset()) -> list[tuple[str, int]]:
        """Keep the newest ``keep`` files within ``max_bytes``, every sibling of a key in
        ``protect`` spared; ``(key, bytes)`` of each file removed."""
        ...

    def prune_siblings(self, key: str, keep: int, spare: frozenset[int] = frozenset()) -> list[tuple[int, int]]:
        """Keep ``key``'s ``keep`` most recently used siblings, and those in ``spare``;
        ``(sibling, bytes)`` of each file removed."""
        ...

    def usage(self) -> tuple[int, int]: ...

    def sessions(self) -> list[tuple[str, Sidecar]]:
        """``(key, sidecar)`` of every parked conversation (one per sibling), newest first."""
        ...


class SessionStore:
    """The plugin's files in the slot directory: the default :class:`ParkingStore`."""

    def __init__(self, directory: Path, blocks: ParkedBlocks | None = None):
        self.directory = directory
        #: Where conversations are parked in blocks of tokens (``blocks = true``); None:
        #: whole files only. Whole files are read either way (earlier versions', and
        #: states the format refuses).
        self.blocks = blocks
        #: Where the engine's saves land while they are cut, and the newest states are
        #: kept whole (with blocks only; :mod:`strata_auto_sessions.staging`); None: none.
        self.staging: Staging | None = None
        #: A join in memory failed once (said once in the log).
        self._join_fell_back = False
        self._lock = DirectoryLock(directory)
        #: The server lock (:meth:`claim`).
        self._claim = ServerClaim(directory)
        #: True: a commit leaves its fsyncs to :meth:`sync_written` (auto-sessions' ``fsync =
        #: "background"``), called off the request's path; False: it fsyncs before it returns.
        self.sync_later = False
        #: Files and sidecars committed since the last :meth:`sync_written`, not yet fsynced.
        self._unsynced: list[Path] = []
        #: Earlier versions of files replaced since, under a temporary's name: removed by
        #: :meth:`sync_written` (freeing a file's blocks takes milliseconds on some disks).
        self._retired: list[Path] = []
        self._unsynced_lock = threading.Lock()
        #: ``(key, sibling)`` of each conversation a commit is putting in place now (in a
        #: thread, beside the event loop): its manifest, its file and its sidecar are
        #: written one after the other, and a prune meanwhile must not take the ones
        #: already there for a save a crash cut short.
        self._committing: set[tuple[str, int]] = set()
        self._committing_lock = threading.Lock()
        #: Sidecars read and digests checked, while their files are unchanged.
        self._known = KnownFiles()

    def lock(self) -> contextlib.AbstractContextManager[None]:
        """An exclusive ``flock`` on the slot directory itself (reentrant in this process),
        waited for as long as it takes: for ``strata-serve sessions``, never on the event
        loop (the server takes it with :meth:`lock_without_blocking`)."""
        return self._lock.lock()

    def lock_without_blocking(self, timeout_s: float) -> contextlib.AbstractAsyncContextManager[None]:
        """The same lock, taken without blocking the event loop, for at most ``timeout_s``
        (:meth:`DirectoryLock.lock_without_blocking`).

        :raises LockTimeout: when another process held it all that time.
        """
        return self._lock.lock_without_blocking(timeout_s)

    def bin_name(self, key: str, sibling: int = 0) -> str:
        return session_name(key, "bin", sibling)

    def bin_path(self, key: str, sibling: int = 0) -> Path:
        return self.directory / self.bin_name(key, sibling)

    def restorable(self, key: str, sibling: int = 0) -> bool:
        """A regular file of ours, not a symlink that could lead outside the directory."""
        path = self.bin_path(key, sibling)
        return path.is_file() and not path.is_symlink()

    def stage(self, key: str, sibling: int = 0) -> bool:
        """The file is in the slot directory already, or its blocks are in the block
        store (:meth:`joined` makes the file); False when neither."""
        return self.restorable(key, sibling) or self._in_blocks(key, sibling)

    def _in_blocks(self, key: str, sibling: int) -> bool:
        return self.blocks is not None and self.blocks.manifest(key, sibling) is not None

    def joined(self, key: str, sibling: int = 0) -> str | None:
        """The name of a file in the slot directory to restore the conversation from: None
        when its whole file is there (``bin_name``); else its blocks joined into a
        temporary, which the caller removes (:meth:`discard`) once the engine read it.

        :raises CorruptBlock: a block missing or damaged.
        :raises ValueError: no manifest, or blocks that do not fit their layout.
        """
        if self.restorable(key, sibling) or self.blocks is None:
            return None
        name = fresh_temp_name(key, ".bin")
        if self.staging is not None:
            manifest = self.blocks.manifest(key, sibling)
            if manifest is not None and self.staging.link_kept(key, sibling, manifest.identity, self.directory / name):
                return name  # its newest state, kept whole in memory since it was saved
        blocks = self.blocks
        self._join(name, lambda dest: blocks.join_into(key, sibling, dest))
        return name

    def joined_chain(self, chain: Chain) -> str:
        """``chain``'s blocks (found by tokens, of any conversation) joined into a temporary
        in the slot directory; its name, removed by the caller (:meth:`discard`) once read.

        :raises CorruptBlock: a block missing or damaged.
        """
        assert self.blocks is not None
        name = fresh_temp_name("by-tokens", ".bin")
        blocks = self.blocks
        self._join(name, lambda dest: blocks.join_chain(chain, dest))
        return name

    def _join(self, name: str, write: Callable[[Path], object]) -> None:
        """Have ``write`` join a file restored under ``name``: in memory behind a link of
        that name when saves are staged (the file lives until the engine has read it, and
        never reaches the disk), else in the slot directory. A join in memory that fails
        for room (tmpfs full) is made again in the slot directory."""
        dest = self.directory / name
        if self.staging is not None and self.staging.on:
            try:
                self.staging.link(dest)
                if self.staging.owns(dest):
                    write(Path(os.readlink(dest)))
                    return
            except OSError as exc:
                self.discard(name)
                (log.debug if self._join_fell_back else log.info)(
                    "[strata] auto sessions: a join in memory failed (%s): joined in the slot directory (said "
                    "once)", exc)
                self._join_fell_back = True
            except BaseException:
                self.discard(name)
                raise
        write(dest)

    def intact(self, key: str, sidecar: Sidecar) -> bool:
        """The file is the one that was saved: same size, same sampled digest (read again
        unless this very file was digested since it last changed). A conversation in blocks:
        its manifest holds the sidecar's tokens and every block it names is there."""
        path = self.bin_path(key, sidecar.sibling)
        if not self.restorable(key, sidecar.sibling) and self.blocks is not None:
            return self.blocks.intact(key, sidecar.sibling, sidecar.tokens)
        stat = path.stat()
        if stat.st_size != sidecar.bytes:
            return False
        if self._known.digest_known(path, stat, sidecar.digest):
            return True
        if not digest_matches(path, sidecar.digest):
            return False
        self._known.remember_digest(path, sidecar.digest)
        return True

    def sidecar_path(self, key: str, sibling: int = 0) -> Path:
        return self.directory / session_name(key, "json", sibling)

    def temp_name(self, key: str) -> str:
        """A fresh temporary's name for the engine to save ``key``'s state to (in memory,
        through a link, when saves are staged)."""
        name = fresh_temp_name(key, ".bin")
        if self.staging is not None:
            try:
                self.staging.link(self.directory / name)
            except OSError as exc:
                self.staging.failed(self.directory / name, exc)
        return name

    def prepare(self) -> int:
        """Create the directory, claim it for this server (:meth:`claim`), and remove
        temporaries a crash left behind; returns how many.

        :raises DirectoryInUse: when another live server uses the directory.
        """
        make_private_dir(self.directory)
        self.claim()
        removed = 0
        with self.lock():
            for leftover in self.directory.iterdir():
                if TEMP_NAME.fullmatch(leftover.name) and (not leftover.is_symlink() or staged_link(leftover)):
                    leftover.unlink(missing_ok=True)
                    removed += 1
            if self.blocks is not None:
                # Manifests whose sidecar a crash left unwritten, blocks no manifest holds.
                self.blocks.free_unheld(self._with_sidecars())
            # A new engine holds nothing a removal by hand was about.
            (self.directory / REMOVED_NAME).unlink(missing_ok=True)
            self.record_held([])
        return removed

    def claim(self) -> None:
        """Hold the directory for this server's lifetime (:meth:`ServerClaim.claim`).

        :raises DirectoryInUse: when another live server holds it.
        """
        self._claim.claim()

    def release(self) -> None:
        """Let go of the directory (:meth:`claim`): the server stops."""
        self._claim.release()

    def server_running(self) -> bool:
        """Whether a live server holds the directory (:meth:`claim`), this process's included."""
        return self._claim.server_running()

    def record_held(self, keys: list[str]) -> None:
        # Written at every switch: onto a free name (see _write_private_json), read with
        # that in mind (held_by_server).
        _write_private_json(self.directory / HELD_NAME, {"keys": sorted(keys), "pid": os.getpid()},
                            onto_a_free_name=True)

    def held_by_server(self) -> list[str]:
        """The conversations a live server holds in its slots or is running (recorded by
        :meth:`record_held`); none when no server runs."""
        if not self.server_running():
            return []  # what a killed server recorded is held by no one
        for _attempt in range(HELD_READ_TRIES):
            try:
                data = json.loads((self.directory / HELD_NAME).read_text())
                break
            except FileNotFoundError:
                # Between the two renames of record_held, for microseconds.
                time.sleep(0.001)
            except (OSError, ValueError):
                return []
        else:
            return []
        keys = data.get("keys") if isinstance(data, dict) else None
        return [key for key in keys if isinstance(key, str)] if isinstance(keys, list) else []

    def describe_engine(self, fingerprint: dict[str, Any]) -> None:
        _write_private_json(self.directory / ENGINE_NAME, {"fingerprint": fingerprint, "since": time.time()})

    def engine_description(self) -> dict[str, Any] | None:
        """What :meth:`describe_engine` recorded last, or None."""
        try:
            data = json.loads((self.directory / ENGINE_NAME).read_text())
            return data if isinstance(data, dict) and isinstance(data.get("fingerprint"), dict) else None
        except (OSError, ValueError):
            return None

    def removed_by_hand(self) -> dict[str, float]:
        """Keys removed by hand while a server may have held them, and when."""
        try:
            data = json.loads((self.directory / REMOVED_NAME).read_text())
        except (OSError, ValueError):
            return {}
        return {k: v for k, v in data.items() if isinstance(k, str) and isinstance(v, (int, float))} \
            if isinstance(data, dict) else {}

    def remove_by_hand(self, keys: list[str]) -> list[tuple[str, int]]:
        """Remove these sessions now, and drop a save of any of them that a running server
        has under way or makes next (it may hold one in its slot). Returns ``(key, bytes)``
        of the files removed."""
        removed = []
        with self.lock():
            pending = self.removed_by_hand()
            for key in keys:
                sidecars = self.siblings(key)
                size = sum(self.size_of(key, sidecar.sibling) for sidecar in sidecars)
                if sidecars or size:
                    removed.append((key, size))
                self.remove(key)
                pending[key] = time.time()
            _write_private_json(self.directory / REMOVED_NAME, pending)
            self._free_blocks()
        return removed

    def size_of(self, key: str, sibling: int) -> int:
        """Bytes of the conversation's state: its whole file, or the blocks its manifest names."""
        path = self.bin_path(key, sibling)
        if path.is_file() and not path.is_symlink():
            return path.stat().st_size
        if self.blocks is not None:
            sizes = self.blocks.sizes()
            return sum(sizes.get(name, 0) for name in self.blocks.objects_of(key, sibling))
        return 0

    def _free_blocks(self) -> None:
        """Remove the blocks no manifest holds (after manifests were removed)."""
        if self.blocks is not None:
            self.blocks.free_unheld()

    def _with_sidecars(self) -> set[tuple[str, int]]:
        """``(key, sibling)`` of every conversation in blocks whose sidecar is there: one
        that is refused keeps its manifest too (left alone, as a whole file beside one is;
        listed as damaged). A manifest without one is a save a crash cut short."""
        assert self.blocks is not None
        return {found for found in self.blocks.parked() if self.sidecar_path(*found).exists()}

    def _own(self, ext: str, key: str | None = None) -> list[tuple[str, Path, Sidecar]]:
        """``(key, path, sidecar)`` of each ``auto-<name>[.<n>].<ext>`` whose sidecar names
        its key and sibling (of ``key`` alone, when given).

        A name alone proves nothing (an older version let ``/slots`` write any name):
        only a file with our sidecar is ours. Symlinks are never ours.
        """
        found = []
        start = None if key is None else session_name(key, "")[:-1]
        with os.scandir(self.directory) as entries:
            names = [entry.name for entry in entries if start is None or entry.name.startswith(start)]
        for name in names:
            match = SESSION_NAME.fullmatch(name)
            path = self.directory / name
            if match is None or match["ext"] != ext or path.is_symlink():
                continue
            its_key, sibling = key_of_file(match["key"]), sibling_of(match)
            if key is not None and its_key != key:
                continue
            sidecar = self.sidecar(its_key, sibling)
            if sidecar is not None and sidecar.key == its_key and sidecar.sibling == sibling:
                found.append((its_key, path, sidecar))
        if ext == "bin" and self.blocks is not None:
            # Conversations in blocks: a sidecar and a manifest, no file (its name stands for it).
            in_blocks = self.blocks.parked()
            files = {(its_key, sidecar.sibling) for its_key, _p, sidecar in found}
            for its_key, _path, sidecar in self._own("json", key):
                if (its_key, sidecar.sibling) in in_blocks and (its_key, sidecar.sibling) not in files:
                    found.append((its_key, self.bin_path(its_key, sidecar.sibling), sidecar))
        return found

    def siblings(self, key: str) -> list[Sidecar]:
        """The sidecars of ``key``'s files (one per sibling, each naming its own), newest first."""
        found = [sidecar for _key, path, sidecar in self._own("bin", key)
                 if path.is_file() or self._in_blocks(key, sidecar.sibling)]
        now = time.time()
        return sorted(found, key=lambda sidecar: last_use(sidecar.last_used, now=now) or 0.0, reverse=True)

    def commit(self, temp_name: str, key: str, sidecar: Sidecar) -> bool:
        """Move a finished save under its real name, private to this user, with its sidecar.

        :returns: False when the session was removed by hand (``strata-serve sessions
            rm``) at or after ``sidecar.created``, when the saved state began: the save is
            dropped (each time: an erase that failed leaves the same state to be saved
            again). A state begun after the removal (the conversation started anew) is
            kept, and the removal is done with.
        :raises OSError: when the file on disk is not the size the engine reported
            (a full disk can leave a short file behind a reported success).
        """
        ident = (key, sidecar.sibling)
        with self.lock():
            with self._committing_lock:
                self._committing.add(ident)
            try:
                pending = self.removed_by_hand()
                if key in pending:
                    if pending[key] >= sidecar.created:
                        self.discard(temp_name)
                        return False
                    del pending[key]
                    _write_private_json(self.directory / REMOVED_NAME, pending)
                self._commit(temp_name, key, sidecar)
                return True
            finally:
                with self._committing_lock:
                    self._committing.discard(ident)

    def _commit(self, temp_name: str, key: str, sidecar: Sidecar) -> None:
        temp = self.directory / temp_name
        size = temp.stat().st_size
        if sidecar.bytes and size != sidecar.bytes:
            raise OSError(f"{temp_name} holds {size:,} bytes; the engine reported {sidecar.bytes:,}")
        os.chmod(temp, PRIVATE_FILE_MODE)
        target = self.bin_path(key, sidecar.sibling)
        if self.blocks is not None:
            with span("auto_sessions.blocks"):
                report = self.blocks.save(key, sidecar.sibling, temp)
            if report.refused is None:
                self._commit_blocks(temp, target, key, sidecar, report.paths)
                return
            # Kept whole (the format refused the state): an earlier manifest goes.
            self.blocks.remove(key, sidecar.sibling)
            if self.staging is not None:
                self.staging.drop(key, sidecar.sibling)
                self.staging.make_real(temp)
        with span("auto_sessions.digest"):  # a whole file's (a manifest names its blocks by their digests)
            sidecar.digest = sample_digest(temp)
        with span("auto_sessions.sidecar"):
            self._put_in_place(temp, target, key, sidecar)

    def _commit_blocks(self, temp: Path, target: Path, key: str, sidecar: Sidecar, written: tuple[Path, ...]) -> None:
        """The state is in the block store (its manifest written): the whole file of an
        earlier version goes, the sidecar is written, the engine's temporary removed.
        A crash before the sidecar leaves the old sidecar beside the new manifest, whose
        tokens differ: refused at its restore, never a wrong state. With ``sync_later``
        the new blocks and the manifest (``written``) are fsynced with the sidecar, by
        :meth:`sync_written`."""
        target.unlink(missing_ok=True)
        sidecar.write(self.sidecar_path(key, sidecar.sibling), sync=not self.sync_later)
        if self.staging is not None and self.blocks is not None:
            manifest = self.blocks.manifest(key, sidecar.sibling)
            if manifest is not None:  # the engine's file, kept whole in memory as this state
                self.staging.keep(temp, key, sidecar.sibling, manifest.identity)
        temp.unlink(missing_ok=True)
        if self.sync_later:
            with self._unsynced_lock:
                self._unsynced += [*written, self.sidecar_path(key, sidecar.sibling)]

    def _put_in_place(self, temp: Path, target: Path, key: str, sidecar: Sidecar) -> None:
        if self.sync_later:
            # Made durable by sync_written, beside the next request. Until then a power cut
            # may leave the name over data that never reached the disk: the size and digest
            # in the sidecar refuse such a file at its restore.
            sidecar.write(self.sidecar_path(key, sidecar.sibling), sync=False)
            # The earlier file is moved aside, its blocks freed by sync_written, not here.
            retired = _rename_onto_a_free_name(temp, target, self.directory / fresh_temp_name(key, ".bin"))
            self._known.remember_digest(target, sidecar.digest)
            with self._unsynced_lock:
                self._unsynced += [target, self.sidecar_path(key, sidecar.sibling)]
                if retired is not None:
                    self._retired.append(retired)
            return
        with span("auto_sessions.fsync"):
            _fsync(temp)  # the data is on disk before the name says it is there
        # The sidecar first: a file is ours only with it, so a crash between the two
        # leaves a sidecar without its file (swept by prune), never a file nobody owns.
        self.write_sidecar(sidecar)
        os.replace(temp, target)
        self._known.remember_digest(target, sidecar.digest)
        with span("auto_sessions.fsync"):
            _fsync(self.directory)

    def sync_written(self) -> int:
        """fsync what was committed without it (``sync_later``), then the directory: the
        number of files synced. Blocking: run it in a thread. A file gone since (pruned,
        replaced by a newer save, which is listed itself) is passed over."""
        with self._unsynced_lock:
            paths, self._unsynced = self._unsynced, []
            retired, self._retired = self._retired, []
        for path in retired:
            path.unlink(missing_ok=True)
        synced = 0
        for path in dict.fromkeys(paths):
            try:
                _fsync(path)
                synced += 1
            except FileNotFoundError:
                continue
        # The directories their names were made in: the slot directory's, and the block
        # store's (a block's fan-out directory, the manifests').
        for directory in dict.fromkeys(path.parent for path in paths if path.parent != self.directory):
            with contextlib.suppress(FileNotFoundError):
                _fsync(directory)
        if paths or retired:
            _fsync(self.directory)
        return synced

    @property
    def unsynced(self) -> int:
        """Files committed and not yet fsynced."""
        return len(self._unsynced) + len(self._retired)

    def discard(self, temp_name: str) -> None:
        if self.staging is not None:
            self.staging.discard(self.directory / temp_name)
        (self.directory / temp_name).unlink(missing_ok=True)

    def write_sidecar(self, sidecar: Sidecar) -> None:
        sidecar.write(self.sidecar_path(sidecar.key, sidecar.sibling))

    def sidecar(self, key: str, sibling: int = 0) -> Sidecar | None:
        try:
            return self._known.sidecar(self.sidecar_path(key, sibling))
        except (OSError, DamagedSidecar):
            return None

    def sidecar_problem(self, key: str, sibling: int = 0) -> str | None:
        try:
            sidecar = self._known.sidecar(self.sidecar_path(key, sibling))
        except FileNotFoundError:
            return None
        except (OSError, DamagedSidecar) as exc:
            return str(exc)
        if sidecar.key != key:
            return f"it names another conversation ({sidecar.key!r})"
        return None if sidecar.sibling == sibling else f"it names another sibling ({sidecar.sibling})"

    def damaged(self) -> list[tuple[str, Path, str]]:
        """``(key, path, why)`` of each ``auto-<name>.bin`` (or manifest) beside a sidecar that is refused:
        never restored, pruned or removed (without a sidecar that reads, nothing says the
        file is ours), listed as damaged by ``strata-serve sessions ls``."""
        found = []
        for path in self.directory.iterdir():
            match = SESSION_NAME.fullmatch(path.name)
            if match is None or match["ext"] != "bin" or path.is_symlink():
                continue
            key = key_of_file(match["key"])
            why = self.sidecar_problem(key, sibling_of(match))
            if why is not None:
                found.append((key, path, why))
        if self.blocks is not None:  # in blocks: a manifest, its name standing for the file
            for key, sibling in self.blocks.parked():
                path = self.bin_path(key, sibling)
                if not path.exists() and (why := self.sidecar_problem(key, sibling)) is not None:
                    found.append((key, path, why))
        return found

    def touch(self, key: str, sibling: int = 0) -> None:
        sidecar = self.sidecar(key, sibling)
        if sidecar is not None:
            sidecar.last_used = time.time()
            path = self.sidecar_path(key, sibling)
            sidecar.write(path, sync=not self.sync_later)
            if self.sync_later:
                with self._unsynced_lock:
                    self._unsynced.append(path)

    def remove(self, key: str, sibling: int | None = None) -> None:
        """Remove ``key``'s file ``sibling`` with its sidecar; every sibling's when None."""
        numbers = [s.sibling for s in self.siblings(key)] + [0] if sibling is None else [sibling]
        for number in numbers:
            self.bin_path(key, number).unlink(missing_ok=True)
            self.sidecar_path(key, number).unlink(missing_ok=True)
            if self.blocks is not None:
                self.blocks.remove(key, number)  # its blocks go when no other manifest holds them

    def files(self) -> list[tuple[str, Path, int, float]]:
        """``(key, path, bytes, last used)`` of every session file (one per sibling), newest first; a file
        whose every time is stamped ahead of the clock (:func:`last_use`) counts as used at
        0, the oldest."""
        found = []
        now = time.time()
        holdings = self.blocks.holdings() if self.blocks is not None else {}
        for key, path, sidecar in self._own("bin"):
            try:
                stat = path.stat()
                size, mtime = stat.st_size, stat.st_mtime
            except FileNotFoundError:
                held = holdings.get((key, sidecar.sibling))
                if held is None:
                    continue
                # In blocks: every byte it holds (shared or not; usage() counts each block once).
                size, mtime = held.own + held.shared, held.used
            used = last_use(mtime, sidecar.last_used, now=now)
            found.append((key, path, size, 0.0 if used is None else used))
        return sorted(found, key=lambda item: item[3], reverse=True)

    def sessions(self) -> list[tuple[str, Sidecar]]:
        by_path = {path: (key, sidecar) for key, path, sidecar in self._own("bin")}
        return [by_path[path] for _key, path, *_ in self.files() if path in by_path]

    def _sibling_of_path(self, path: Path) -> int:
        match = SESSION_NAME.fullmatch(path.name)
        return 0 if match is None else sibling_of(match)

    def prune(self, keep: int, max_bytes: int, protect: frozenset[str] = frozenset()) -> list[tuple[str, int]]:
        """Keep the newest ``keep`` files within ``max_bytes``; returns ``(key, bytes)`` removed.

        ``protect`` names files never removed (the conversation just saved, the one about
        to be restored): they count against the limits, the others make way.
        """
        with self.lock():
            return self._prune(keep, max_bytes, protect)

    def _prune(self, keep: int, max_bytes: int, protect: frozenset[str]) -> list[tuple[str, int]]:
        removed = []
        files = self.files()
        # A conversation in blocks weighs what it adds to those kept before it (newest
        # first): a block several hold counts once, against the first of them.
        sizes = self.blocks.sizes() if self.blocks is not None else {}
        counted: set[str] = set()

        def weight(key: str, path: Path, size: int) -> tuple[int, set[str]]:
            if self.blocks is None or path.is_file():
                return size, set()
            names = self.blocks.objects_of(key, self._sibling_of_path(path)) - counted
            return sum(sizes.get(name, 0) for name in names), names

        total = kept = 0
        for key, path, size, _used in files:
            if key in protect:
                added, names = weight(key, path, size)
                total += added
                kept += 1
                counted |= names
        for key, path, size, _used in files:
            if key in protect:
                continue
            added, names = weight(key, path, size)
            if kept + 1 > keep or total + added > max_bytes:
                self.remove(key, self._sibling_of_path(path))
                removed.append((key, added))
                continue
            total += added
            kept += 1
            counted |= names
        with self._committing_lock:
            committing = set(self._committing)  # being put in place: left alone
        for key, sidecar_path, sidecar in self._own("json"):
            if (key, sidecar.sibling) in committing:
                continue
            if not self.bin_path(key, sidecar.sibling).exists() and not self._in_blocks(key, sidecar.sibling):
                sidecar_path.unlink(missing_ok=True)
        if self.blocks is not None:
            self.blocks.free_unheld(self._with_sidecars() | committing)
        return removed

    def prune_siblings(self, key: str, keep: int, spare: frozenset[int] = frozenset()) -> list[tuple[int, int]]:
        """Keep ``key``'s ``keep`` most recently used siblings, and those in ``spare`` (which
        count against ``keep``); returns ``(sibling, bytes)`` of each file removed."""
        with self.lock():
            removed = []
            siblings = self.siblings(key)  # newest first
            kept = sum(1 for sidecar in siblings if sidecar.sibling in spare)
            for sidecar in siblings:
                if sidecar.sibling in spare:
                    continue
                kept += 1
                if kept > keep:
                    size = self.size_of(key, sidecar.sibling)
                    self.remove(key, sidecar.sibling)
                    removed.append((sidecar.sibling, size))
                    kept -= 1
            if removed:
                self._free_blocks()
            return removed

    def usage(self) -> tuple[int, int]:
        """Conversations parked and their bytes on disk (a block several hold counted once)."""
        files = self.files()
        if self.blocks is None:
            return len(files), sum(size for _key, _path, size, _used in files)
        whole = sum(size for _key, path, size, _used in files if path.is_file())
        return len(files), whole + self.blocks.bytes()


def _write_private_json(target: Path, data: Any, *, onto_a_free_name: bool = False) -> None:
    """Write ``data`` at ``target``, whole or not at all (a temporary, then a rename).

    ``onto_a_free_name``: the earlier file is moved away first, so the rename takes a free
    name (a rename over a file makes ext4 write the new one out at once, a few tenths of
    a millisecond even for a few bytes); ``target`` is then missing for microseconds, which
    its reader allows for.
    """
    temp = target.with_name(fresh_json_temp_name())
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, PRIVATE_FILE_MODE)
    try:
        os.fchmod(fd, PRIVATE_FILE_MODE)
        with os.fdopen(fd, "wb") as handle:
            handle.write(json.dumps(data).encode())  # one C call; json.dump writes piece by piece
        if not onto_a_free_name:
            os.replace(temp, target)
            return
        moved = _rename_onto_a_free_name(temp, target, target.with_name(fresh_json_temp_name()))
    except BaseException:
        temp.unlink(missing_ok=True)  # a full disk must not leave one temporary per write
        raise
    if moved is not None:
        moved.unlink(missing_ok=True)


def _rename_onto_a_free_name(temp: Path, target: Path, moved: Path) -> Path | None:
    """Rename ``temp`` to ``target`` after moving the regular file ``target`` names, if
    any, to ``moved`` (a temporary's name, removed at a start if left): the rename then
    takes a free name. A rename over an existing file makes ext4 write the new file's
    data out at once (``auto_da_alloc``): measured here, 2-20 ms on a switch's path for a
    few MB, a few tenths of a millisecond for a few bytes. ``target`` is missing for the
    microseconds between the two renames; a crash there leaves the new sidecar without a
    file, and the conversation is read anew, as after a crash just before the rename.

    :returns: ``moved`` when a file was moved there (the caller removes it), else None.
    :raises OSError: when the rename fails; the earlier file is back under ``target``.
    """
    try:
        if not S_ISREG(os.lstat(target).st_mode):
            moved_away = None  # a symlink or anything else is replaced as it is
        else:
            os.rename(target, moved)
            moved_away = moved
    except OSError:
        moved_away = None  # gone already, or not ours to move: replaced as it is
    try:
        os.replace(temp, target)
    except OSError:
        if moved_away is not None:
            with contextlib.suppress(OSError):
                os.rename(moved_away, target)  # the earlier file back under its name
        raise
    return moved_away


#: Reads of the held conversations' record that find it missing (being replaced) before
#: taking it for none, a millisecond apart.
HELD_READ_TRIES = 20


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
