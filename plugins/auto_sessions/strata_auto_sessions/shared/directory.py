"""The shared tier on a directory every server mounts (NFS, CephFS, any POSIX file system).

Objects are files in ``objects/``, heads in ``heads/``, written to a temporary beside
them and renamed into place (never half a file under its name). A head's
compare-and-swap holds a lock file in ``locks/``, made with ``O_EXCL`` (``flock`` does
not hold across machines on every network file system) and holding its expiry: one
left by a server that died is broken once expired. Every call runs in a thread
(``asyncio.to_thread``): a slow mount never blocks the event loop.
"""

from __future__ import annotations

import builtins

import asyncio
import json
import os
import shutil
import time
import uuid
from pathlib import Path

from strata_auto_sessions.shared.tier import ConditionFailed, Head, Listed, SharedTierError

#: How long a lock file holds before another server may break it.
LOCK_EXPIRY_S = 30.0
#: How long a compare-and-swap waits for the lock.
LOCK_WAIT_S = 5.0


class DirectoryTier:
    """:class:`~strata_auto_sessions.shared.tier.SharedTier` on a shared directory."""

    def __init__(self, root: Path, lock_expiry_s: float = LOCK_EXPIRY_S, lock_wait_s: float = LOCK_WAIT_S):
        self.root = root
        self.where = f"file://{root}"
        self.lock_expiry_s = lock_expiry_s
        self.lock_wait_s = lock_wait_s
        self._objects, self._heads, self._locks = root / "objects", root / "heads", root / "locks"

    def _ready(self) -> None:
        if not self.root.is_dir():
            raise SharedTierError(f"{self.root} is not a directory (is the shared file system mounted?)")
        for sub in (self._objects, self._heads, self._locks):
            sub.mkdir(mode=0o700, exist_ok=True)

    @staticmethod
    def _safe(name: str) -> str:
        if not name or "/" in name or name.startswith(".") or "\0" in name:
            raise ValueError(f"not an object name: {name!r}")
        return name

    # -- objects ------------------------------------------------------------

    async def put(self, name: str, source: Path) -> None:
        await asyncio.to_thread(self._put, self._safe(name), source)

    def _put(self, name: str, source: Path) -> None:
        self._ready()
        target = self._objects / name
        temp = target.with_name(f".{name}.{uuid.uuid4().hex[:8]}.tmp")
        try:
            with open(source, "rb") as src, open(temp, "xb") as dst:
                shutil.copyfileobj(src, dst, 1024 * 1024)
                dst.flush()
                os.fsync(dst.fileno())
            os.replace(temp, target)
        except BaseException:
            temp.unlink(missing_ok=True)
            raise

    async def fetch(self, name: str, target: Path) -> int:
        return await asyncio.to_thread(self._fetch, self._safe(name), target)

    def _fetch(self, name: str, target: Path) -> int:
        with open(self._objects / name, "rb") as src, open(target, "wb") as dst:
            shutil.copyfileobj(src, dst, 1024 * 1024)
            return dst.tell()

    async def list(self, prefix: str) -> builtins.list[Listed]:
        return await asyncio.to_thread(self._list, prefix)

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
        await asyncio.to_thread((self._objects / self._safe(name)).unlink, True)

    # -- heads ----------------------------------------------------------------

    async def head(self, name: str) -> tuple[Head, str] | None:
        return await asyncio.to_thread(self._head, self._safe(name))

    def _head(self, name: str) -> tuple[Head, str] | None:
        try:
            raw = json.loads((self._heads / name).read_bytes())
        except FileNotFoundError:
            return None
        except ValueError as exc:
            raise SharedTierError(f"head {name} is damaged: {exc}") from None
        if not isinstance(raw, dict) or not isinstance(raw.get("version"), str):
            raise SharedTierError(f"head {name} is damaged: no version")
        return Head.decode(json.dumps(raw.get("head")).encode()), raw["version"]

    async def heads(self, prefix: str) -> builtins.list[str]:
        return await asyncio.to_thread(self._heads_named, prefix)

    def _heads_named(self, prefix: str) -> builtins.list[str]:
        self._ready()
        return sorted(entry.name for entry in os.scandir(self._heads)
                      if entry.name.startswith(prefix) and not entry.name.startswith("."))

    async def put_head(self, name: str, head: Head, expect: str | None) -> str:
        return await asyncio.to_thread(self._put_head, self._safe(name), head, expect)

    def _put_head(self, name: str, head: Head, expect: str | None) -> str:
        self._ready()
        with self._locked(name):
            self._check(name, expect)
            version = uuid.uuid4().hex
            target = self._heads / name
            temp = target.with_name(f".{name}.{version[:8]}.tmp")
            try:
                with open(temp, "x") as handle:
                    json.dump({"version": version, "head": json.loads(head.encode())}, handle)
                    handle.flush()
                    os.fsync(handle.fileno())
                os.replace(temp, target)
            except BaseException:
                temp.unlink(missing_ok=True)
                raise
            return version

    async def delete_head(self, name: str, expect: str) -> None:
        await asyncio.to_thread(self._delete_head, self._safe(name), expect)

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

    async def close(self) -> None:
        return None


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
