"""The slot directory's two locks: the one held around every change of the files (by the
server and by ``strata-serve sessions``), and the one a running server holds for its
lifetime (one server per directory)."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import os
import threading
import time
from pathlib import Path
from collections.abc import AsyncIterator, Iterator

from strata_serve import PRIVATE_FILE_MODE, span

from strata_auto_sessions.naming import SERVER_LOCK_NAME


class LockTimeout(TimeoutError):
    """The slot directory's lock was held elsewhere for longer than the server waits."""


class DirectoryInUse(Exception):
    """Another live server uses the slot directory (it holds :data:`SERVER_LOCK_NAME`)."""


class DirectoryLock:
    """An exclusive ``flock`` on the directory itself, reentrant in this process: shared by
    the event loop's tasks and the threads they hand work to (a save's commit), each
    holder counted under a mutex, the ``flock`` let go when the last one leaves."""

    def __init__(self, directory: Path):
        self.directory = directory
        self._depth = 0
        self._fd: int | None = None
        #: Guards ``_depth`` and ``_fd``, never held while waiting for the ``flock``.
        self._mutex = threading.Lock()

    @contextlib.contextmanager
    def lock(self) -> Iterator[None]:
        """An exclusive ``flock`` on the slot directory itself (reentrant in this process),
        waited for as long as it takes: for ``strata-serve sessions`` and for a thread a
        holder on the event loop hands work to, never on the event loop (the server takes
        it with :meth:`lock_without_blocking`)."""
        if not self._share():
            fd = os.open(self.directory, os.O_RDONLY | os.O_DIRECTORY)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
            except BaseException:
                os.close(fd)
                raise
            self._held(fd)
        try:
            yield
        finally:
            self._unlock()

    @contextlib.asynccontextmanager
    async def lock_without_blocking(self, timeout_s: float) -> AsyncIterator[None]:
        """The same lock, taken without blocking the event loop: tried (``LOCK_NB``) until
        it is free, sleeping in between, for at most ``timeout_s``. A task or thread of
        this process that holds it already shares it (as :meth:`lock` does).

        :raises LockTimeout: when another process (a server whose engine hangs in a
            restore, a ``strata-serve sessions`` command) held it all that time.
        """
        deadline = time.monotonic() + timeout_s
        while not self._share():
            fd = os.open(self.directory, os.O_RDONLY | os.O_DIRECTORY)
            try:
                with span("auto_sessions.lock"):
                    taken = await self._take_lock(fd, deadline, timeout_s)
            except BaseException:
                os.close(fd)
                raise
            if taken:
                self._held(fd)
                break
            os.close(fd)  # a task or thread of this process took it meanwhile: shared, if it still holds it
        try:
            yield
        finally:
            self._unlock()

    def _share(self) -> bool:
        """One more holder, when this process holds the lock already."""
        with self._mutex:
            if self._depth:
                self._depth += 1
                return True
            return False

    def _held(self, fd: int) -> None:
        """``fd`` took the ``flock``: the first holder (no other can hold it meanwhile)."""
        with self._mutex:
            self._fd = fd
            self._depth += 1

    async def _take_lock(self, fd: int, deadline: float, timeout_s: float) -> bool:
        """True once ``fd`` holds the lock; False when a task or thread of this process took it meanwhile."""
        pause = 0.005
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return True
            except BlockingIOError:
                if self._depth:
                    return False
            if time.monotonic() >= deadline:
                raise LockTimeout(f"the lock on {self.directory} was held elsewhere (another server, or "
                                   f"strata-serve sessions) for more than {timeout_s:g} s")
            await asyncio.sleep(pause)
            pause = min(pause * 2, 0.05)

    def _unlock(self) -> None:
        with self._mutex:
            self._depth -= 1
            if self._depth or self._fd is None:
                return
            fd, self._fd = self._fd, None
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


class ServerClaim:
    """The lock a server holds on :data:`SERVER_LOCK_NAME` for its lifetime."""

    def __init__(self, directory: Path):
        self.directory = directory
        self.path = directory / SERVER_LOCK_NAME
        #: The lock, while this process holds it.
        self._fd: int | None = None

    def claim(self) -> None:
        """Hold the directory for this server's lifetime: an exclusive ``flock`` on
        :data:`SERVER_LOCK_NAME`, kept until :meth:`release` or the process ends (the
        kernel lets go of a killed server's, so a stale file never blocks a start).

        A second server would undo the first one's pending removals and save over its
        files; sharing a directory between servers is not supported yet.

        :raises DirectoryInUse: when another live server holds it.
        """
        if self._fd is not None:
            return
        path = self.path
        # Held open read-only: a file open for writing would keep the directory's file
        # system from being remounted read-only while the server runs.
        fd = os.open(path, os.O_RDONLY | os.O_CREAT | os.O_NOFOLLOW, PRIVATE_FILE_MODE)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            try:
                holder = json.loads(os.pread(fd, 256, 0))["pid"]
            except (ValueError, KeyError, TypeError):
                holder = "unknown"
            os.close(fd)
            raise DirectoryInUse(
                f"another strata-serve server (pid {holder}) uses the slot directory {self.directory}; "
                "two servers on one directory would undo each other's removals and save over each "
                "other's files: give this one its own directory (engine.slot_save_path)") from None
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        os.fchmod(fd, PRIVATE_FILE_MODE)  # the mode given to open passes through the umask
        with open(path, "w") as handle:  # who holds it, for the next one's message
            json.dump({"pid": os.getpid(), "since": time.time()}, handle)

    def release(self) -> None:
        """Let go of the directory (:meth:`claim`): the server stops."""
        if self._fd is not None:
            os.close(self._fd)  # closing the last descriptor releases the flock
            self._fd = None

    def server_running(self) -> bool:
        """Whether a live server holds the directory (:meth:`claim`), this process's included."""
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        finally:
            os.close(fd)
        return False
