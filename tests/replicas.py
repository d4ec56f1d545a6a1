"""Several strata-serve replicas behind HAProxy, on loopback, for tests of routing.

:class:`Replicas` starts ``count`` ``strata-serve run`` processes, each with its own
managed llama-server (the real engine), its own slot directory and port, and config of
the test's own (``config``: a dict in the config file's shape, e.g.
``{"plugins": {"auto_sessions": {"shared": {"url": ...}}}}``), then HAProxy in front,
its configuration the one docs/several-servers.md shows (``docs/examples/haproxy.cfg``),
given this machine's addresses by :func:`balancer_config` and nothing else. A replica
can be killed (``kill -9``) and started again on its port and slot directory.

What a turn after a failover reused is :func:`after_a_failover`'s answer: without a
shared tier, :func:`reread_in_full` (the replica taking the conversation over never saw
it); with one (``{"plugins": {"auto_sessions": {"shared": {"url": ...}}}}``),
:func:`restored_from` the state the lost replica uploaded
(plugins/auto_sessions/tests/test_shared_replicas.py).

Every wait has a deadline. ``async with Replicas(tmp_path, model) as replicas:``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from multidict import CIMultiDict, CIMultiDictProxy

from strata_serve.testing import deep_merge
from tests.ports import listen_port

ROOT = Path(__file__).resolve().parent.parent
#: The configuration docs/several-servers.md includes: what the tests run.
HAPROXY_CONFIG = ROOT / "docs" / "examples" / "haproxy.cfg"
#: The backend of that configuration, as its stats name it.
BACKEND = "strata"
#: What every replica runs with, under the test's own ``config``.
BASE_CONFIG: dict[str, Any] = {
    "server": {"shutdown_grace_s": 0.5},
    "engine": {"ctx_size": 4096, "cache_ram_mib": 0, "start_timeout_s": 60},
    "plugins": {"auto_sessions": {"min_tokens": 100}},
}
START_TIMEOUT_S = 90
#: Long enough for the configuration's checks (``inter 1s fall 2 rise 2``) many times over.
CHECK_TIMEOUT_S = 30


def haproxy_binary() -> str:
    """HAProxy's binary (Debian installs it in /usr/sbin, off a user's PATH)."""
    found = shutil.which("haproxy") or shutil.which("haproxy", path="/usr/local/sbin:/usr/sbin:/sbin")
    if found is None:
        raise RuntimeError("haproxy not found: the test set-up (make test) installs Debian's haproxy "
                           "package as root (apt-get install -y haproxy)")
    return found


def _replace(text: str, pattern: str, make: Any, expected: int | None = 1) -> str:
    """``text`` with each line matching ``pattern`` replaced by ``make(match)``; fails unless
    ``expected`` lines matched (None: at least one), so a change of the docs' config that this
    harness no longer understands fails loudly instead of testing something else."""
    regex = re.compile(pattern, re.M)
    found = len(regex.findall(text))
    assert found == expected if expected is not None else found >= 1, (
        f"{HAPROXY_CONFIG.name}: {found} line(s) match {pattern!r}")
    return regex.sub(make, text)


def balancer_config(template: str, *, bind: str, servers: Sequence[tuple[str, str]], stats_socket: Path) -> str:
    """The docs' HAProxy configuration with this machine's addresses: where it listens, its
    stats socket, and one ``server`` line per ``(name, address)``, in place of the docs'
    example lines. Everything else is the docs' own."""
    text = _replace(template, r"^([ \t]*bind )\S+$", lambda m: m.group(1) + bind)
    text = _replace(text, r"^([ \t]*stats socket )\S+", lambda m: m.group(1) + str(stats_socket))
    indent = re.search(r"^([ \t]*)server ", text, re.M)
    assert indent is not None, f"{HAPROXY_CONFIG.name}: no server line"
    lines = "".join(f"{indent.group(1)}server {name} {address}\n" for name, address in servers)
    return _replace(text, r"(?:^[ \t]*server \S+ \S+\n)+", lambda m: lines)


def toml_text(config: Mapping[str, Any], prefix: tuple[str, ...] = ()) -> str:
    """``config`` (tables of strings, numbers, booleans and lists of them) as TOML."""
    scalars = {k: v for k, v in config.items() if not isinstance(v, Mapping)}
    text = f"[{'.'.join(prefix)}]\n" if prefix and scalars else ""
    text += "".join(f"{key} = {json.dumps(value)}\n" for key, value in scalars.items())
    for key, value in config.items():
        if isinstance(value, Mapping):
            text += toml_text(value, (*prefix, key))
    return text


@dataclass
class Reuse:
    """What a turn reused of its conversation's prompt: ``state`` is the replica's
    ``X-Strata-State`` (``slot``, ``disk``, ``ram``, ``none``), ``cached`` the engine's
    ``cache_n``, ``prompt`` the tokens it prefilled (``prompt_n``)."""

    state: str
    cached: int
    prompt: int


@dataclass
class Answer:
    status: int
    #: The replica that answered (the balancer's X-Strata-Replica), None without one.
    replica: str | None
    #: The conversation key the replica answered (X-Strata-Conversation).
    key: str | None
    body: Any
    headers: CIMultiDictProxy[str]

    @property
    def reuse(self) -> Reuse:
        timings = self.body["timings"]
        return Reuse(self.headers["X-Strata-State"], timings["cache_n"], timings["prompt_n"])


@dataclass
class Replica:
    name: str
    port: int
    slot_dir: Path
    config_file: Path
    log_file: Path
    model: Path
    proc: subprocess.Popen[bytes] | None = None
    starts: int = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.starts += 1
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        with open(self.log_file, "a") as log:
            log.write(f"--- start {self.starts}\n")
            log.flush()
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "strata_serve.cli", "run", "--config", str(self.config_file),
                 "--model", str(self.model), "--host", "127.0.0.1", "--port", str(self.port),
                 "--slot-save-path", str(self.slot_dir)],
                stdout=log, stderr=log, stdin=subprocess.DEVNULL, env=env,
            )

    def engine_pids(self) -> list[int]:
        return [int(pid) for pid in re.findall(r"engine ready at .* \(pid (\d+)\)", self.log_file.read_text())]

    async def wait_ready(self, timeout: float = START_TIMEOUT_S) -> None:
        """Until its ``/health`` answers 200 (fails at once if the process ended)."""
        deadline = time.monotonic() + timeout
        async with aiohttp.ClientSession() as session:
            while True:
                assert self.proc is not None and self.proc.poll() is None, (
                    f"{self.name} ended:\n{self.log_file.read_text()[-3000:]}")
                with contextlib.suppress(aiohttp.ClientError):
                    async with session.get(self.url + "/health") as resp:
                        if resp.status == 200:
                            return
                assert time.monotonic() < deadline, (
                    f"{self.name} not ready in {timeout:g} s:\n{self.log_file.read_text()[-3000:]}")
                await asyncio.sleep(0.1)

    async def kill(self) -> None:
        """``kill -9`` of strata-serve; its engine follows (it gets SIGKILL when its parent dies)."""
        assert self.proc is not None
        engines = self.engine_pids()
        self.proc.kill()
        await asyncio.to_thread(self.proc.wait, 10)
        for pid in engines:
            await _ended(pid, 15)

    async def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            await asyncio.to_thread(self.proc.wait, 30)
        except subprocess.TimeoutExpired:
            await self.kill()


async def _ended(pid: int, timeout: float) -> None:
    """Wait for ``pid`` to end; past ``timeout``, SIGKILL it (a test leaves no engine behind)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            return
        if state == "Z":
            return
        await asyncio.sleep(0.05)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    raise AssertionError(f"process {pid} still ran {timeout:g} s after its parent was killed")


@dataclass
class Replicas:
    root: Path
    model: Path
    count: int = 3
    config: Mapping[str, Any] = field(default_factory=dict)
    #: The balancer's configuration before its addresses are filled in: the docs' own,
    #: unless a test tries another on purpose.
    template: str = field(default_factory=HAPROXY_CONFIG.read_text)
    replicas: list[Replica] = field(default_factory=list)
    haproxy: subprocess.Popen[bytes] | None = None
    port: int = 0

    @property
    def url(self) -> str:
        """The balancer's address: where clients send their requests."""
        return f"http://127.0.0.1:{self.port}"

    @property
    def stats_socket(self) -> Path:
        return self.root / "haproxy.sock"

    def __getitem__(self, name: str) -> Replica:
        return next(replica for replica in self.replicas if replica.name == name)

    @property
    def names(self) -> list[str]:
        return [replica.name for replica in self.replicas]

    async def __aenter__(self) -> Replicas:
        try:
            await self.start()
        except BaseException:
            await self.close()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def start(self) -> None:
        config = deep_merge(BASE_CONFIG, dict(self.config))
        for n in range(1, self.count + 1):
            home = self.root / f"replica{n}"
            home.mkdir(parents=True)
            config_file = home / "strata.toml"
            config_file.write_text(toml_text(config))
            assert tomllib.loads(config_file.read_text()) == config, "the config file says what was asked"
            self.replicas.append(Replica(f"replica{n}", listen_port(), home / "slots", config_file,
                                         home / "server.log", self.model))
        for replica in self.replicas:
            replica.start()
        for replica in self.replicas:
            await replica.wait_ready()
        self.port = listen_port()
        config_path = self.root / "haproxy.cfg"
        config_path.write_text(balancer_config(
            self.template, bind=f"127.0.0.1:{self.port}", stats_socket=self.stats_socket,
            servers=[(replica.name, f"127.0.0.1:{replica.port}") for replica in self.replicas],
        ))
        self.haproxy_log = self.root / "haproxy.log"
        with open(self.haproxy_log, "a") as log:
            # -db: in the foreground, this process its own (no daemon, no master).
            self.haproxy = subprocess.Popen([haproxy_binary(), "-db", "-f", str(config_path)],
                                            stdout=log, stderr=log, stdin=subprocess.DEVNULL)
        for replica in self.replicas:
            await self.wait_for_state(replica.name, "UP")

    async def close(self) -> None:
        if self.haproxy is not None and self.haproxy.poll() is None:
            self.haproxy.terminate()
            try:
                await asyncio.to_thread(self.haproxy.wait, 10)
            except subprocess.TimeoutExpired:
                self.haproxy.kill()
                await asyncio.to_thread(self.haproxy.wait, 10)
        await asyncio.gather(*(replica.stop() for replica in self.replicas))

    # -- the balancer's view ------------------------------------------------------

    async def admin(self, command: str) -> str:
        """The answer of HAProxy's stats socket to ``command``."""
        reader, writer = await asyncio.wait_for(asyncio.open_unix_connection(str(self.stats_socket)), 5)
        try:
            writer.write(command.encode() + b"\n")
            await writer.drain()
            return (await asyncio.wait_for(reader.read(), 5)).decode()
        finally:
            writer.close()
            await writer.wait_closed()

    async def states(self) -> dict[str, str]:
        """Each replica's state as HAProxy's checks see it: ``UP``, ``DOWN``, ``UP 1/2``..."""
        lines = (await self.admin("show stat")).lstrip("# ").splitlines()
        rows = [dict(zip(lines[0].split(","), line.split(","), strict=False)) for line in lines[1:] if line]
        return {row["svname"]: row["status"] for row in rows
                if row.get("pxname") == BACKEND and row["svname"] in self.names}

    async def wait_for_state(self, name: str, state: str, timeout: float = CHECK_TIMEOUT_S) -> float:
        """Until HAProxy holds ``name`` to be ``state``; returns the seconds it took."""
        began = time.monotonic()
        seen = None
        while time.monotonic() - began < timeout:
            with contextlib.suppress(OSError, TimeoutError):
                seen = (await self.states()).get(name)
                if seen == state:
                    return time.monotonic() - began
            assert self.haproxy is not None and self.haproxy.poll() is None, (
                f"haproxy ended:\n{self.haproxy_log.read_text()[-3000:]}")
            await asyncio.sleep(0.1)
        raise AssertionError(f"HAProxy held {name} {seen!r}, not {state!r}, after {timeout:g} s:\n"
                             f"{self.haproxy_log.read_text()[-3000:]}")

    # -- replicas -----------------------------------------------------------------

    async def kill(self, name: str) -> None:
        """``kill -9`` the replica ``name`` (and see its engine end)."""
        await self[name].kill()

    async def restart(self, name: str) -> None:
        """Start the replica ``name`` again, on its port and slot directory, until it is ready."""
        replica = self[name]
        replica.start()
        await replica.wait_ready()

    async def stats(self, name: str) -> dict[str, Any]:
        """The replica's own ``/stats``, asked directly (not through the balancer)."""
        async with aiohttp.ClientSession() as session, session.get(self[name].url + "/stats") as resp:
            assert resp.status == 200, await resp.text()
            return await resp.json()

    # -- clients ------------------------------------------------------------------

    async def ask(self, messages: list[dict[str, Any]], headers: Mapping[str, str] | None = None,
                  timeout: float = 120, via: str | None = None, **extra: Any) -> Answer:
        """One greedy chat turn through the balancer, or straight to the replica ``via``
        (its answer then names no replica)."""
        body = {"messages": messages, "max_tokens": 8, "temperature": 0, **extra}
        url = self.url if via is None else self[via].url
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as session:
            async with session.post(url + "/v1/chat/completions", json=body, headers=dict(headers or {})) as resp:
                text = await resp.text()
                try:
                    answer: Any = json.loads(text)
                except ValueError:
                    answer = text
                return Answer(resp.status, resp.headers.get("X-Strata-Replica"),
                              resp.headers.get("X-Strata-Conversation"), answer, CIMultiDictProxy(CIMultiDict(resp.headers)))


# -- what a failover costs ----------------------------------------------------------


async def after_a_failover(replicas: Replicas, messages: list[dict], headers: dict[str, str]) -> tuple[Answer, Reuse]:
    """The next turn of a conversation whose replica is gone, and what that turn reused."""
    answer = await replicas.ask(messages, headers)
    assert answer.status == 200, answer.body
    return answer, answer.reuse


def reread_in_full(reuse: Reuse) -> bool:
    """The answer after a failover without a shared tier: the replica that takes the
    conversation over never saw it and reads its whole prompt again. The few tokens every
    chat opens with (its template's first ones, left in the slot by another conversation)
    are all it finds."""
    return reuse.state == "none" and reuse.cached < 0.05 * (reuse.cached + reuse.prompt)


#: Tokens a restored state may fall short of what was saved: the engine re-reads the last
#: few to sample the next one.
RESTORE_SLACK = 3


def restored_from(reuse: Reuse, tokens: int) -> bool:
    """Whether the turn was restored from a saved state of ``tokens`` tokens (the answer
    after a failover with a shared tier, or of a replica restoring its own copy), and reused
    it all but the last few: a state of fewer tokens (an older turn) is not it."""
    return reuse.state == "disk" and tokens - RESTORE_SLACK <= reuse.cached <= tokens
