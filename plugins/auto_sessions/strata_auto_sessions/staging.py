"""The engine's saves staged in memory, and the newest states kept there whole.

With ``blocks = true`` a save is the engine's whole file, cut into blocks, of which only
those the store lacks reach the disk. The engine writes its file into the slot directory
by name: strata-serve puts there, under the temporary's name, a symbolic link into a
private directory in memory (tmpfs, ``/dev/shm`` by default), so the whole file never
reaches the disk. Once cut, the file is kept there as the conversation's newest state,
within ``stage_keep_mb``, least recently used out first: a switch back to it has the
engine read that file through a link, as fast as a whole file, instead of joining the
blocks (docs/sessions.md, "Blocks").

A kept file stands for exactly one manifest (its identity: the tokens, the chain and the
tail, each named by its content); a manifest changed since (a save elsewhere, a fetch
from a shared tier, a removal) no longer matches and the blocks are joined as before.
Staging is only for an engine strata-serve started on this machine (it must reach the
directory), or a ``stage_dir`` the operator chose; a save that fails while staged turns
it off for the process (logged once), and the save is tried again on disk.

One writer: the session store (:class:`~strata_auto_sessions.store.SessionStore`) under
the slot directory's lock.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import stat
import threading
from collections import OrderedDict
from pathlib import Path

__all__ = ["DEFAULT_ROOT", "Staging", "default_keep_bytes", "staged_link"]

log = logging.getLogger("strata_auto_sessions")

#: Where a stage directory is made when ``stage_dir`` is not set (when it is a directory).
DEFAULT_ROOT = Path("/dev/shm")
#: The default budget of kept files: this share of the machine's memory...
KEEP_SHARE_OF_RAM = 1 / 8
#: ... and at most this many bytes.
KEEP_MAX_BYTES = 4 << 30


def default_keep_bytes() -> int:
    """``stage_keep_mb``'s default: an eighth of the machine's memory, at most 4 GiB."""
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (OSError, ValueError):
        return 0
    return min(KEEP_MAX_BYTES, int(ram * KEEP_SHARE_OF_RAM))


#: A stage directory's mode: its owner's alone (it holds transcripts' states).
PRIVATE_DIR_MODE = 0o700
#: How a stage directory's name begins.
DIR_PREFIX = "strata-serve-"


def staged_link(path: Path) -> bool:
    """Whether ``path`` is a link into a stage directory (one a stopped server left)."""
    try:
        return path.is_symlink() and Path(os.readlink(path)).parent.name.startswith(DIR_PREFIX)
    except OSError:
        return False


def _private_dir(path: Path) -> bool:
    """Make ``path`` (0700), or accept it when it is already a directory of this user
    that no one else may enter: never one another user made in a shared place."""
    try:
        path.mkdir(mode=PRIVATE_DIR_MODE)
    except FileExistsError:
        pass
    except OSError as exc:
        log.info("[strata] auto sessions: no staging in memory (%s: %s)", path, exc)
        return False
    st = path.lstat()
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
        log.warning("[strata] auto sessions: no staging in memory: %s is not a private directory of this user",
                    path)
        return False
    return True


class Staging:
    """A private directory in memory holding the engine's saves while they are cut, and
    the newest state of recently saved conversations, within ``keep_bytes``."""

    def __init__(self, directory: Path, keep_bytes: int):
        self.directory = directory
        self.keep_bytes = keep_bytes
        #: ``(key, sibling)`` -> (the kept file, the manifest identity it stands for, bytes),
        #: least recently used first.
        self._kept: OrderedDict[tuple[str, int], tuple[Path, tuple[object, ...], int]] = OrderedDict()
        #: False once a staged save failed: the engine's saves go to the slot directory.
        self.on = True
        #: Restores read from a kept file (a switch back at a whole file's speed).
        self.hits = 0
        self._lock = threading.Lock()

    @classmethod
    def open(cls, slot_dir: Path, root: Path | None, keep_bytes: int) -> Staging | None:
        """The stage directory of ``slot_dir`` under ``root`` (default :data:`DEFAULT_ROOT`),
        emptied of what an earlier server left; None where there is none to use."""
        root = root if root is not None else DEFAULT_ROOT
        if not root.is_dir():
            log.info("[strata] auto sessions: no staging in memory (%s is not a directory)", root)
            return None
        tag = hashlib.sha256(str(slot_dir.resolve()).encode()).hexdigest()[:16]
        directory = root / f"{DIR_PREFIX}{os.geteuid()}-{tag}"
        if not _private_dir(directory):
            return None
        staging = cls(directory, keep_bytes)
        staging.clear()
        return staging

    def clear(self) -> None:
        """Remove every file of the directory (at a start: an earlier server's)."""
        with self._lock:
            self._kept.clear()
            for path in self.directory.iterdir():
                path.unlink(missing_ok=True)

    def close(self) -> None:
        """Remove the directory and everything in it (at a stop)."""
        with self._lock:
            self._kept.clear()
        shutil.rmtree(self.directory, ignore_errors=True)

    # -- saving --------------------------------------------------------------------------

    def link(self, temp: Path) -> None:
        """Have the engine's save to ``temp`` (in the slot directory) land here instead."""
        if self.on:
            os.symlink(self.directory / temp.name, temp)

    def owns(self, temp: Path) -> bool:
        """Whether ``temp`` is one of this directory's links."""
        try:
            return temp.is_symlink() and Path(os.readlink(temp)).parent == self.directory
        except OSError:
            return False

    def failed(self, temp: Path, exc: BaseException) -> None:
        """The engine's save to ``temp`` failed: if it was staged, staging stops (the save
        is tried again in the slot directory)."""
        if self.on and self.owns(temp):
            self.on = False
            log.warning("[strata] auto sessions: a save staged in memory (%s) failed (%s): the engine's saves "
                        "go to the slot directory from now on", self.directory, exc)

    def make_real(self, temp: Path) -> None:
        """Replace the link ``temp`` by a copy of its file (a state kept whole goes to the
        slot directory itself)."""
        if not self.owns(temp):
            return
        target = Path(os.readlink(temp))
        copy = temp.with_name(f"{temp.stem}-copy{temp.suffix}")  # a temporary's name: a start clears it
        shutil.copyfile(target, copy)
        os.replace(copy, temp)
        target.unlink(missing_ok=True)

    def keep(self, temp: Path, key: str, sibling: int, identity: tuple[object, ...]) -> None:
        """The staged file behind ``temp`` was cut into the manifest ``identity``: keep it
        as the conversation's newest state (the link goes), within the budget."""
        if not self.owns(temp):
            return
        target = Path(os.readlink(temp))
        temp.unlink(missing_ok=True)
        try:
            size = target.stat().st_size
        except FileNotFoundError:
            return
        if size > self.keep_bytes:
            target.unlink(missing_ok=True)
            self.drop(key, sibling)
            return
        kept = self.directory / f"kept-{hashlib.sha256(f'{key}#{sibling}'.encode()).hexdigest()[:24]}.bin"
        os.replace(target, kept)
        with self._lock:
            self._kept.pop((key, sibling), None)
            self._kept[(key, sibling)] = (kept, identity, size)
            self._evict()

    def _evict(self) -> None:
        total = sum(size for _p, _i, size in self._kept.values())
        while total > self.keep_bytes and self._kept:
            _found, (path, _identity, size) = self._kept.popitem(last=False)
            path.unlink(missing_ok=True)
            total -= size

    def discard(self, temp: Path) -> None:
        """Before the link ``temp`` goes: remove the staged save behind it (a kept file a
        restore linked to stays)."""
        if self.owns(temp):
            target = Path(os.readlink(temp))
            if target.name == temp.name:
                target.unlink(missing_ok=True)

    # -- restoring -----------------------------------------------------------------------

    def link_kept(self, key: str, sibling: int, identity: tuple[object, ...], dest: Path) -> bool:
        """Link ``dest`` (in the slot directory) to the kept file of the conversation when
        it stands for the manifest ``identity``; False when there is none such."""
        with self._lock:
            found = self._kept.get((key, sibling))
            if found is None:
                return False
            path, kept_identity, _size = found
            if kept_identity != identity or not path.is_file():
                self._kept.pop((key, sibling), None)
                path.unlink(missing_ok=True)
                return False
            self._kept.move_to_end((key, sibling))
            os.symlink(path, dest)
            self.hits += 1
            return True

    def drop(self, key: str, sibling: int) -> None:
        """Forget the conversation's kept file (its manifest went or changed)."""
        with self._lock:
            found = self._kept.pop((key, sibling), None)
        if found is not None:
            found[0].unlink(missing_ok=True)

    @property
    def kept_bytes(self) -> int:
        with self._lock:
            return sum(size for _p, _i, size in self._kept.values())
