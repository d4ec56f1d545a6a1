"""The shared tier on a directory every server mounts (NFS, CephFS, any POSIX file system).

Objects are files in ``objects/``, heads in ``heads/``, written to a temporary beside
them and renamed into place (never half a file under its name); a temporary a killed
server left is removed by the sweep once ``lease_s`` old (:meth:`DirectoryTier.remove_partial`).
A head's compare-and-swap holds a lock file in ``locks/``, made with ``O_EXCL`` (``flock``
does not hold across machines on every network file system) and holding its expiry: one
left by a server that died is broken once expired. Files are made 0600 and directories
0700 whatever the umask (the objects hold transcripts): every server sharing the directory
runs as the same user.

Every call runs in one of the tier's own threads (:class:`TierThreads`), never the event
loop's default executor: a slow mount never blocks the event loop, and a hung one
(``open()`` that never returns) holds the tier's threads alone.
"""

from __future__ import annotations

import builtins

import json
import os
import shutil
import time
import uuid
from pathlib import Path
from typing import Any

from strata_auto_sessions.shared.tier import (
    ConditionFailed, DamagedHead, Head, Listed, SharedTierError, TierThreads, new_upload,
)

#: How long a lock file holds before another server may break it.
LOCK_EXPIRY_S = 30.0
#: How long a compare-and-swap waits for the lock.
LOCK_WAIT_S = 5.0
#: What a file of the tier may be: its owner's alone.
FILE_MODE, DIRECTORY_MODE = 0o600, 0o700


class DirectoryTier:
    """:class:`~strata_auto_sessions.shared.tier.SharedTier` on a shared directory."""

    def __init__(self, root: Path, lock_expiry_s: float = LOCK_EXPIRY_S, lock_wait_s: float = LOCK_WAIT_S):
        self.root = root
        self.where = f"file://{root}"
        self.lock_expiry_s = lock_expiry_s
        self.lock_wait_s = lock_wait_s
        self._objects, self._heads, self._locks = root / "objects", root / "heads", root / "locks"
        self._blocks = root / "blocks"
        self.threads = TierThreads(self.where)

    def _ready(self) -> None:
        if not self.root.is_dir():
            raise SharedTierError(f"{self.root} is not a directory (is the shared file system mounted?)")
        for sub in (self._objects, self._heads, self._locks, self._blocks):
            try:
                sub.mkdir(mode=DIRECTORY_MODE)
            except FileExistsError:
                continue
            os.chmod(sub, DIRECTORY_MODE)  # whatever the umask

    @staticmethod
    def _safe(name: str) -> str:
        if not name or "/" in name or name.startswith(".") or "\0" in name:
            raise ValueError(f"not an object name: {name!r}")
        return name

    # -- objects ------------------------------------------------------------

    async def put(self, name: str, source: Path) -> None:
        await self.threads.run(self._put, self._safe(name), source)

    def _put(self, name: str, source: Path) -> None:
        self._ready()
        target = self._objects / name
        temp = target.with_name(_temporary(name))
        try:
            with open(source, "rb") as src, _create(temp, "wb") as dst:
                shutil.copyfileobj(src, dst, 1024 * 1024)
                dst.flush()
                os.fsync(dst.fileno())
            os.replace(temp, target)
        except BaseException:
            temp.unlink(missing_ok=True)
            raise

    async def fetch(self, name: str, target: Path) -> int:
        return await self.threads.run(self._fetch, self._safe(name), target)

    def _fetch(self, name: str, target: Path) -> int:
        with open(self._objects / name, "rb") as src, _create(target, "wb", exclusive=False) as dst:
            shutil.copyfileobj(src, dst, 1024 * 1024)
            return dst.tell()

    async def list(self, prefix: str) -> builtins.list[Listed]:
        return await self.threads.run(self._list, prefix)

    def _list(self, prefix: str) -> builtins.list[Listed]:
        self._ready()
        found = []
        for entry in os.scandir(self._objects):
            if entry.name.startswith(prefix) and not entry.name.startswith("."):
                try:
                    stat = entry.stat()
                except FileNotFoundError:
                    continue
                found.append(Listed(entry.name, stat.st_size, stat.st_mtime))
        return sorted(found, key=lambda listed: listed.name)

    async def delete(self, name: str) -> None:
        await self.threads.run((self._objects / self._safe(name)).unlink, True)

    async def put_bytes(self, name: str, data: builtins.bytes) -> None:
        await self.threads.run(self._put_bytes, self._safe(name), data)

    def _put_bytes(self, name: str, data: builtins.bytes) -> None:
        self._ready()
        target = self._objects / name
        temp = _written_beside(target, data)
        try:
            os.replace(temp, target)
        except BaseException:
            temp.unlink(missing_ok=True)
            raise

    async def fetch_bytes(self, name: str) -> builtins.bytes:
        return await self.threads.run((self._objects / self._safe(name)).read_bytes)

    # -- blocks ---------------------------------------------------------------

    async def put_block(self, name: str, data: builtins.bytes) -> bool:
        return await self.threads.run(self._put_block, self._safe(name), data)

    def _put_block(self, name: str, data: builtins.bytes) -> bool:
        """A private temporary made with ``O_EXCL``, then linked to the block's name: a link
        never replaces a file, so a block is written once, and never seen half written."""
        self._ready()
        target = self._blocks / name
        temp = _written_beside(target, data)
        try:
            try:
                os.link(temp, target)
            except FileExistsError:
                return False
            return True
        finally:
            temp.unlink(missing_ok=True)

    async def fetch_block(self, name: str) -> builtins.bytes:
        return await self.threads.run((self._blocks / self._safe(name)).read_bytes)

    async def blocks(self) -> builtins.list[Listed]:
        return await self.threads.run(self._list_blocks)

    def _list_blocks(self) -> builtins.list[Listed]:
        self._ready()
        found = []
        for entry in os.scandir(self._blocks):
            if not entry.name.startswith("."):
                try:
                    stat = entry.stat()
                except FileNotFoundError:
                    continue
                found.append(Listed(entry.name, stat.st_size, stat.st_mtime))
        return found

    async def delete_block(self, name: str) -> None:
        await self.threads.run((self._blocks / self._safe(name)).unlink, True)

    # -- heads ----------------------------------------------------------------

    async def head(self, name: str) -> tuple[Head, str] | None:
        return await self.threads.run(self._head, self._safe(name))

    def _head(self, name: str) -> tuple[Head, str] | None:
        try:
            raw = json.loads((self._heads / name).read_bytes())
        except FileNotFoundError:
            return None
        except ValueError as exc:
            raise DamagedHead(f"head {name} is damaged: {exc}") from None
        if not isinstance(raw, dict) or not isinstance(raw.get("version"), str):
            raise DamagedHead(f"head {name} is damaged: no version")
        try:
            return Head.decode(json.dumps(raw.get("head")).encode()), raw["version"]
        except DamagedHead as exc:
            raise DamagedHead(f"head {name} is damaged: {exc}") from None

    async def heads(self, prefix: str) -> builtins.list[str]:
        return await self.threads.run(self._heads_named, prefix)

    def _heads_named(self, prefix: str) -> builtins.list[str]:
        self._ready()
        return sorted(entry.name for entry in os.scandir(self._heads)
                      if entry.name.startswith(prefix) and not entry.name.startswith("."))

    async def put_head(self, name: str, head: Head, expect: str | None) -> str:
        return await self.threads.run(self._put_head, self._safe(name), head, expect)

    def _put_head(self, name: str, head: Head, expect: str | None) -> str:
        self._ready()
        with self._locked(name):
            self._check(name, expect)
            version = uuid.uuid4().hex
            target = self._heads / name
            temp = target.with_name(_temporary(name))
            try:
                with _create(temp, "w") as handle:
                    json.dump({"version": version, "head": json.loads(head.encode())}, handle)
                    handle.flush()
                    os.fsync(handle.fileno())
                os.replace(temp, target)
            except BaseException:
                temp.unlink(missing_ok=True)
                raise
            return version

    async def delete_head(self, name: str, expect: str) -> None:
        await self.threads.run(self._delete_head, self._safe(name), expect)

    def _delete_head(self, name: str, expect: str) -> None:
        self._ready()
        with self._locked(name):
            self._check(name, expect)
            (self._heads / name).unlink(missing_ok=True)

    def _check(self, name: str, expect: str | None) -> None:
        current = self._head(name)
        if expect is None and current is not None:
            raise ConditionFailed(f"{name} has a head already")
        if expect is not None and (current is None or current[1] != expect):
            raise ConditionFailed(f"{name}'s head is not the version read")

    def _locked(self, name: str) -> _LockFile:
        return _LockFile(self._locks / f"{name}.lock", self.lock_expiry_s, self.lock_wait_s)

    # -- what killed uploads left ---------------------------------------------------------

    async def remove_partial(self, older_than_s: float) -> int:
        return await self.threads.run(self._remove_partial, older_than_s)

    def _remove_partial(self, older_than_s: float) -> int:
        """Temporaries (an object or a head being written) not touched for ``older_than_s``:
        their writer died (one under way writes them as it goes)."""
        self._ready()
        now, removed = time.time(), 0
        for sub in (self._objects, self._heads, self._blocks):
            for entry in os.scandir(sub):
                if not (entry.name.startswith(".") and entry.name.endswith(".tmp")):
                    continue
                try:
                    if now - entry.stat(follow_symlinks=False).st_mtime > older_than_s:
                        os.unlink(entry.path)
                        removed += 1
                except FileNotFoundError:
                    continue
        return removed

    async def close(self) -> None:
        self.threads.close()


def _temporary(name: str) -> str:
    """A temporary beside ``name``'s file: a dot-file, which no listing shows."""
    return f".{name}.{new_upload()[:8]}.tmp"


def _create(path: Path, mode: str, *, exclusive: bool = True) -> Any:
    """``path`` opened for writing, made 0600 whatever the umask (``exclusive``: only if new)."""
    flags = os.O_WRONLY | os.O_CREAT | (os.O_EXCL if exclusive else os.O_TRUNC)
    fd = os.open(path, flags, FILE_MODE)
    try:
        os.fchmod(fd, FILE_MODE)
        return os.fdopen(fd, mode)
    except BaseException:
        os.close(fd)
        raise


class _LockFile:
    """A lock held by creating a file with ``O_EXCL``; it names its expiry, past which
    another server breaks it (a server that died holding it)."""

    def __init__(self, path: Path, expiry_s: float, wait_s: float):
        self.path, self.expiry_s, self.wait_s = path, expiry_s, wait_s
        self.token = uuid.uuid4().hex

    def __enter__(self) -> None:
        deadline = time.monotonic() + self.wait_s
        while True:
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            except FileExistsError:
                self._break_if_expired()
                if time.monotonic() >= deadline:
                    raise SharedTierError(f"{self.path.name} is locked by another server") from None
                time.sleep(0.02)
                continue
            os.fchmod(fd, FILE_MODE)
            with os.fdopen(fd, "w") as handle:
                json.dump({"token": self.token, "expires": time.time() + self.expiry_s}, handle)
            return

    def _break_if_expired(self) -> None:
        try:
            raw = json.loads(self.path.read_text())
            expires = float(raw["expires"])
        except FileNotFoundError:
            return
        except (OSError, ValueError, KeyError, TypeError):
            # Being written this very moment, or damaged: judged by its age instead.
            try:
                expires = self.path.stat().st_mtime + self.expiry_s
            except FileNotFoundError:
                return
        if time.time() > expires:
            self.path.unlink(missing_ok=True)

    def __exit__(self, *exc: object) -> None:
        try:
            raw = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return
        if isinstance(raw, dict) and raw.get("token") == self.token:  # never another's, taken after ours expired
            self.path.unlink(missing_ok=True)


def _written_beside(target: Path, data: builtins.bytes) -> Path:
    """``data`` in a private temporary beside ``target``, synced to disk; the temporary's path
    (removed again if the write fails)."""
    temp = target.with_name(_temporary(target.name))
    try:
        with _create(temp, "wb") as dst:
            dst.write(data)
            dst.flush()
            os.fsync(dst.fileno())
    except BaseException:
        temp.unlink(missing_ok=True)
        raise
    return temp
