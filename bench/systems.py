"""The systems the workloads compare, each started the way its user starts it, as its own process.

- ``bare``: llama-server alone (the command line strata-serve would give it, with a key);
- ``strata``: ``strata-serve run --config FILE``, which starts and supervises its engine;
- ``hearth``: ``hearth serve --model ...`` (PyPI ``hearth-llm``), which starts its own
  llama-server from ``PATH``: the same engine build is put first on its ``PATH``.

Every system can be restarted the same way at the same moment of a workload: its engine
process is killed (SIGKILL). strata-serve restarts its engine itself; the bare engine is
started again as its user would; hearth does not supervise its engine, so its user
restarts hearth (which starts a new engine and keeps its snapshot directory).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import requests

from bench.harness import BENCH_ENGINE_KEY
from strata_serve.config import EngineSettings
from strata_serve.engine.llama_server import build_command, free_port, library_dirs, resolve_binary

#: The engine's line after its RAM prompt cache work before a task.
RAM_CACHE_LINE = re.compile(r"prompt cache update took ([0-9.]+) ms")
#: How long a system may take to answer /health after a start or a restart.
START_DEADLINE_S = 300.0


@dataclass(frozen=True)
class System:
    """One setup of the comparison.

    :param kind: ``bare``, ``strata`` or ``hearth``.
    :param cache_ram_mib: the engine's RAM prompt cache; None leaves the engine's default.
    :param parallel: the engine's slots (``-np``).
    :param plugins: strata-serve's ``plugins`` section.
    :param server: strata-serve's ``server`` section, besides its port and queue limit.
    """

    name: str
    kind: str
    #: A short name to choose systems by (``bare-off``, ``strata-np4``, ...).
    key: str = ""
    cache_ram_mib: int | None = None
    parallel: int = 1
    plugins: dict[str, Any] = field(default_factory=dict)
    server: dict[str, Any] = field(default_factory=dict)
    #: Arguments added to the engine's command line (any system).
    extra_args: tuple[str, ...] | list[str] = ()
    #: strata-serve run from another checkout of its tree (an earlier revision, to compare):
    #: its core and bundled plugins come first on the process's path.
    source: str | None = None


def engine_env() -> dict[str, str]:
    """The environment a llama-server of this build needs (its shared libraries), for any process."""
    binary = resolve_binary()
    env = dict(os.environ)
    dirs = [str(d) for d in library_dirs(binary)]
    env["LD_LIBRARY_PATH"] = os.pathsep.join([*dirs, *filter(None, [env.get("LD_LIBRARY_PATH")])])
    env["PATH"] = os.pathsep.join([str(binary.parent), env.get("PATH", "")])
    return env


def children(pid: int) -> list[int]:
    """The child processes of ``pid`` (from /proc, every thread's list)."""
    found: list[int] = []
    try:
        for task in Path(f"/proc/{pid}/task").iterdir():
            try:
                found += [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                continue
    except OSError:
        pass
    return found


def wait_healthy(url: str, deadline_s: float = START_DEADLINE_S, headers: dict | None = None,
                 process: subprocess.Popen | None = None, log: Path | None = None) -> None:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if process is not None and process.poll() is not None:
            tail = log.read_text()[-3000:] if log is not None and log.exists() else ""
            raise RuntimeError(f"{url}: the process exited with {process.returncode}\n{tail}")
        try:
            if requests.get(url + "/health", headers=headers, timeout=5).status_code == 200:
                return
        except requests.RequestException:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{url} did not become healthy within {deadline_s:.0f} s")


def stop_process(process: subprocess.Popen, grace_s: float = 30.0) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(grace_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)


class Running:
    """A started system: its URL, its slot (or snapshot) directory, and how to restart it."""

    url: str
    slot_dir: Path
    #: The slot files this system writes (glob patterns in ``slot_dir``).
    file_patterns: tuple[str, ...] = ("*.bin",)

    def engine_pid(self) -> int | None:
        raise NotImplementedError

    def restart_engine(self) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    def stats(self) -> dict[str, Any] | None:
        """strata-serve's ``/stats`` (None for the others)."""
        return None

    def layer_cpu_s(self) -> float | None:
        """CPU seconds of the layer in front of the engine (its own process), None for the bare engine."""
        return None

    #: Where the engine's output goes (``ram_cache_ms`` reads it).
    log: Path

    def ram_cache_ms(self) -> list[float]:
        """The engine's own RAM prompt cache work before each task, as it logs it ("prompt cache
        update took N ms"): empty when its log does not say."""
        try:
            text = self.log.read_text(errors="replace")
        except OSError:
            return []
        return [float(found) for found in RAM_CACHE_LINE.findall(text)]


def bare_command(system: System, model: Path, ctx: int, slot_dir: Path, extra_args: list[str], binary: Path,
                 port: int) -> list[str]:
    """The bare engine's command line: the plain engine a user runs (``-np 1 -c CTX`` for one
    slot), not the two slots over one pool that strata-serve gives the engine it starts
    (``side_slot_tokens = 0``)."""
    settings = EngineSettings(model=model, ctx_size=ctx, slot_save_path=slot_dir, cache_ram_mib=system.cache_ram_mib,
                              parallel=system.parallel, extra_args=extra_args, side_slot_tokens=0, verbosity=None)
    return build_command(settings, binary, port)


class BareEngine(Running):
    def __init__(self, system: System, model: Path, ctx: int, work: Path, extra_args: list[str]) -> None:
        self.slot_dir = work / "slots"
        self.slot_dir.mkdir(parents=True, exist_ok=True)
        self.log = work / "engine.log"
        port = free_port("127.0.0.1")
        self.command = bare_command(system, model, ctx, self.slot_dir, extra_args, resolve_binary(), port)
        self.url = f"http://127.0.0.1:{port}"
        self.headers = {"Authorization": f"Bearer {BENCH_ENGINE_KEY}"}
        self.env = {**engine_env(), "LLAMA_API_KEY": BENCH_ENGINE_KEY}
        self._start()

    def _start(self) -> None:
        # A session of its own, as the engine strata-serve starts has: with the kernel's
        # autogroup scheduling (on in most distributions) the CPU is shared out by session
        # first, so an engine in the benchmark's session would get less of a busy machine
        # than strata-serve's.
        with open(self.log, "ab") as log:
            self.process = subprocess.Popen(self.command, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                            start_new_session=True)
        wait_healthy(self.url, headers=self.headers, process=self.process, log=self.log)

    def engine_pid(self) -> int | None:
        return self.process.pid if self.process.poll() is None else None

    def restart_engine(self) -> None:
        self.process.kill()
        self.process.wait(30)
        self._start()

    def stop(self) -> None:
        stop_process(self.process)


class StrataServe(Running):
    # Whole files, and a conversation parked in blocks: its blocks and its manifest.
    file_patterns = ("auto-*.bin", "tmp-*.bin", "*.bin", "blocks/objects/*/*", "blocks/manifests/*.json")

    def __init__(self, system: System, model: Path, ctx: int, work: Path, extra_args: list[str]) -> None:
        self.slot_dir = work / "slots"
        port = free_port("127.0.0.1")
        engine: dict[str, Any] = {"model": str(model), "ctx_size": ctx, "slot_save_path": str(self.slot_dir),
                                  "parallel": system.parallel, "extra_args": extra_args}
        if system.source is None:
            # The engine's lines for each request (its timings, its RAM cache's work) are
            # read from the log (engine_work, ram_cache_ms): the engine's own verbosity, as
            # the bare engine's, where strata-serve's default leaves them out. Reading and
            # logging them costs strata-serve 0.1-0.2 ms of CPU a request, which these runs
            # include. (An earlier tree knows no such setting, and leaves the engine at its own.)
            engine["verbosity"] = 3
        if system.cache_ram_mib is not None:
            engine["cache_ram_mib"] = system.cache_ram_mib
        config = {"server": {"port": port, "queue_limit": 256, **system.server}, "engine": engine, "plugins": system.plugins}
        path = work / "strata.json"
        path.write_text(json.dumps(config, indent=1))
        self.url = f"http://127.0.0.1:{port}"
        self.log = work / "strata.log"
        strata = Path(sys.executable).parent / "strata-serve"
        env = engine_env()
        if system.source is not None:
            tree = Path(system.source)
            paths = [tree, *sorted(p.parent for p in tree.glob("plugins/*/pyproject.toml"))]
            env["PYTHONPATH"] = os.pathsep.join(str(p) for p in paths)
        with open(self.log, "ab") as log:
            self.process = subprocess.Popen([str(strata), "run", "--config", str(path)], env=env,
                                            stdout=log, stderr=subprocess.STDOUT)
        wait_healthy(self.url, process=self.process, log=self.log)
        self._engine = self._wait_engine(None)

    def _wait_engine(self, old: int | None) -> int:
        end = time.monotonic() + START_DEADLINE_S
        while time.monotonic() < end:
            found = [pid for pid in children(self.process.pid) if pid != old]
            if found:
                return found[0]
            time.sleep(0.05)
        raise RuntimeError("strata-serve started no engine process")

    def engine_pid(self) -> int | None:
        return self._engine

    def restart_engine(self) -> None:
        old = self._engine
        os.kill(old, signal.SIGKILL)
        self._engine = self._wait_engine(old)
        wait_healthy(self.url, process=self.process, log=self.log)

    def stop(self) -> None:
        stop_process(self.process)

    def layer_cpu_s(self) -> float | None:
        from bench.layer_cost import cpu_seconds

        return cpu_seconds(self.process.pid) if self.process.poll() is None else None

    def stats(self) -> dict[str, Any] | None:
        try:
            reply = requests.get(self.url + "/stats", timeout=30)
            return reply.json() if reply.status_code == 200 else None
        except requests.RequestException:
            return None


class Hearth(Running):
    file_patterns = ("*.kv",)

    def __init__(self, system: System, model: Path, ctx: int, work: Path, extra_args: list[str]) -> None:
        self.slot_dir = work / "snapshots"
        self.port, self.engine_port = free_port("127.0.0.1"), free_port("127.0.0.1")
        hearth = shutil.which("hearth", path=str(Path(sys.executable).parent))
        if hearth is None:
            raise RuntimeError("hearth-llm is not installed (pip install -e '.[bench]')")
        self.command = [hearth, "serve", "--model", str(model), "--port", str(self.port),
                        "--upstream-port", str(self.engine_port), "--ctx", str(ctx),
                        "--cache-dir", str(self.slot_dir)]
        if system.cache_ram_mib is not None:
            extra_args = ["--cache-ram", str(system.cache_ram_mib), *extra_args]
        if extra_args:
            self.command += ["--", *extra_args]
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = work / "hearth.log"
        self._start()

    def _start(self) -> None:
        with open(self.log, "ab") as log:
            self.process = subprocess.Popen(self.command, env=engine_env(), stdout=log, stderr=subprocess.STDOUT)
        wait_healthy(self.url, process=self.process, log=self.log)

    def engine_pid(self) -> int | None:
        found = children(self.process.pid)
        return found[0] if found else None

    def restart_engine(self) -> None:
        pid = self.engine_pid()
        if pid is not None:
            os.kill(pid, signal.SIGKILL)
        stop_process(self.process)  # hearth does not restart its engine: its user restarts hearth
        self._start()

    def stop(self) -> None:
        stop_process(self.process)


def start(system: System, model: Path, ctx: int, work: Path) -> Running:
    """Start ``system`` with its files under ``work`` (its own directory)."""
    work.mkdir(parents=True, exist_ok=True)
    extra: list[str] = []
    if system.parallel > 1:
        # Four times the context either way. The bare engine runs its slots as its own
        # default (-np auto) does: one KV buffer they share. strata-serve starts its engine
        # with -np alone: a buffer per slot, so that the engine never empties an idle
        # slot on its own (with --kv-unified it would, and strata would have to save
        # every answer as it ends).
        ctx *= system.parallel
        if system.kind != "strata":
            extra = ["--kv-unified"]
    kind = {"bare": BareEngine, "strata": StrataServe, "hearth": Hearth}[system.kind]
    return kind(system, model, ctx, work, [*extra, *system.extra_args])


def hearth_installed() -> bool:
    return shutil.which("hearth", path=str(Path(sys.executable).parent)) is not None
