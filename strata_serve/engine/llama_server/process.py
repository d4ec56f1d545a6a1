"""The engine's process: how it is created, how its end is awaited, how it is killed."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import signal
import time
from pathlib import Path

from pydantic import SecretStr

from strata_serve.engine.llama_server.binary import library_dirs

#: prctl(2) option: the signal a process gets when its parent dies.
PR_SET_PDEATHSIG = 1


def engine_preexec() -> None:
    """In the engine's process, before exec: its files private, and SIGKILL when strata-serve dies.

    Not SIGTERM: llama-server's graceful exit joins its HTTP threads first, and an engine
    was once seen still running 15 s after strata-serve's ``kill -9``, holding its port and
    memory. Nothing is lost by the harder signal: the engine keeps nothing worth a graceful
    exit, and a save it was writing is a temporary the next start removes.

    The umask is set here rather than through ``umask=``, which uvloop's subprocesses refuse.
    """
    os.umask(0o077)  # what it writes (slot files, their temporaries) is private, whatever our umask
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass  # not Linux: a crash of strata-serve may leave the engine behind


def engine_env(binary: Path, api_key: SecretStr | None) -> dict[str, str]:
    """The engine's environment: ours, its libraries found, its key (never on its command line)."""
    env = dict(os.environ)
    dirs = [str(d) for d in library_dirs(binary)]
    env["LD_LIBRARY_PATH"] = os.pathsep.join([*dirs, *filter(None, [env.get("LD_LIBRARY_PATH")])])
    # The engine's --api-key, from its environment: /proc/<pid>/environ is readable by
    # its owner alone, its command line by everyone.
    env.pop("LLAMA_API_KEY", None)
    if api_key is not None:
        env["LLAMA_API_KEY"] = api_key.get_secret_value()
    return env


async def launch(cmd: list[str], env: dict[str, str]) -> asyncio.subprocess.Process:
    """Create the engine's process, its output (both streams) in one pipe.

    :raises OSError: naming the binary (uvloop's error for a binary that is gone does not).
    """
    try:
        return await asyncio.create_subprocess_exec(
            *cmd,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            env=env,
            # Its own session: a Ctrl-C meant for us must not stop the engine before
            # we have drained and saved. But if we die unasked, it goes with us.
            start_new_session=True,
            preexec_fn=engine_preexec,
        )
    except OSError as exc:
        if exc.filename is not None or exc.errno is None:
            raise
        raise type(exc)(exc.errno, exc.strerror, cmd[0]) from exc


async def exited(proc: asyncio.subprocess.Process, timeout: float | None = None, every: float = 0.02) -> bool:
    """Wait until ``proc`` has exited (at most ``timeout`` seconds); True when it has.

    Watches the exit code rather than ``proc.wait()``, which also waits for the
    process's output to be closed, and a child of the engine may keep it open. On Linux
    the wait wakes as the process ends (the event loop watches a pidfd of it, taken
    anew each second so that a pid collected meanwhile is never watched for long);
    where that cannot be had, it looks every ``every`` seconds.
    """
    deadline = None if timeout is None else time.monotonic() + timeout
    ended: bool | None = False
    while proc.returncode is None:
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            return False
        if ended:
            await asyncio.sleep(0.001)  # ended: the exit code is the event loop's to collect
            continue
        ended = await _ended(proc.pid, 1.0 if left is None else min(left, 1.0))
        if ended is None:
            await asyncio.sleep(every)
    return True


async def _ended(pid: int, timeout: float) -> bool | None:
    """Wait on a pidfd of ``pid`` until it is readable (the process ended) or ``timeout``.

    True when it ended, False past the timeout; None when no pidfd can be watched (not
    Linux, an old kernel, a process already collected, a loop that cannot watch it).
    """
    try:
        fd = os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None
    loop = asyncio.get_running_loop()
    ended: asyncio.Future[None] = loop.create_future()

    def readable() -> None:
        if not ended.done():
            ended.set_result(None)

    try:
        loop.add_reader(fd, readable)
    except (NotImplementedError, OSError, ValueError):
        os.close(fd)
        return None
    try:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(ended, timeout)
        return ended.done() and not ended.cancelled()
    finally:
        loop.remove_reader(fd)
        os.close(fd)


async def kill(proc: asyncio.subprocess.Process) -> None:
    """SIGKILL ``proc`` and wait for its end (it cannot refuse)."""
    with contextlib.suppress(ProcessLookupError):
        proc.kill()
    await exited(proc)
