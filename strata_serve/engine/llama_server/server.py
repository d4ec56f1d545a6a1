"""One llama-server: started and supervised, or attached to by URL."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import secrets
import signal
import time
from pathlib import Path
from typing import Any
from collections.abc import Awaitable, Callable

from pydantic import SecretStr

from strata_serve.config import ConfigError, EngineSettings
from strata_serve.engine.base import (ContextOverflow, EngineInfo, EngineUnavailable, SlotErased, SlotReport,
                                      SlotRestored, SlotSaved)
from strata_serve.engine.llama_server import answers, process
from strata_serve.engine.llama_server.binary import resolve_binary
from strata_serve.engine.llama_server.chat_bodies import COUNT_PATHS
from strata_serve.engine.llama_server.client import EngineClient
from strata_serve.engine.llama_server.stream import StreamReply
from strata_serve.engine.llama_server.command import build_command, clears_idle_slots, free_port, state_layout
from strata_serve.engine.llama_server.output import forward_output
from strata_serve.engine.llama_server.prompts import prompt_text
from strata_serve.engine.llama_server.state import EngineState
from strata_serve.engine.llama_server.state_format import LlamaStateFormat, shifting_flag
from strata_serve.engine.state_blocks import StateFormat
from strata_serve.files import make_private_dir
from strata_serve.engine.results import EngineError, Timings

log = logging.getLogger("strata_serve.engine")

STOP_TIMEOUT_S = 10.0
#: After a failed restart, the next one is tried after this long, doubled each time up to the cap.
RESTART_BACKOFF_S = 0.5
RESTART_BACKOFF_MAX_S = 30.0


class LlamaServer:
    """One llama-server: started and supervised by us, or attached to by URL.

    ``on_start(restarted)`` is awaited after every successful (re)start.
    """

    capabilities = frozenset({"slots", "slot_files", "ram_cache", "tokens"})
    #: llama-server serves every engine path the built-in APIs are relayed to
    #: (``strata_serve.ENGINE_ROUTES``: ``tests/test_memory_engine.py`` holds the two equal).
    routes = frozenset({
        "/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/embeddings", "/v1/models",
        "/v1/messages", "/v1/messages/count_tokens",
        "/infill", "/tokenize", "/detokenize", "/apply-template", "/props",
    })
    # llama-server honours ``id_slot`` on these; its /v1/messages and /v1/embeddings
    # drop it (the Anthropic conversion keeps only the fields it knows), and /infill
    # has not been seen to honour it.
    pinned_routes = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/responses"})
    numbers_key = answers.NUMBERS_KEY
    #: Its slot files, cut into blocks of tokens and joined back.
    state_format: StateFormat | None = LlamaStateFormat()

    def __init__(
        self,
        settings: EngineSettings,
        on_start: Callable[[bool], Awaitable[None]] | None = None,
        *,
        avoid_ports: frozenset[int] = frozenset(),
    ):
        self.settings = settings
        self.managed = settings.url is None
        self.generation = 0
        self.on_start = on_start
        self._proc: asyncio.subprocess.Process | None = None
        self._pump: asyncio.Task | None = None
        self._monitor: asyncio.Task | None = None
        self._state = EngineState(settings.start_timeout_s)
        self._tail: collections.deque[str] = collections.deque(maxlen=40)
        #: Paths whose converted prompt the engine counted differently (logged once each).
        self._miscounted: set[str] = set()
        self.start_seconds: float | None = None
        self._api_key = settings.api_key
        if self._api_key is None and self.managed:
            # An engine we start answers us alone: a key of our own for each start,
            # never logged or shown (a SecretStr prints as stars).
            self._api_key = SecretStr(secrets.token_urlsafe(32))
        if self.managed:
            self._binary = resolve_binary(settings.binary)
            # ``avoid_ports``: the server's own, free until it binds once this engine is up.
            self._port = settings.port or free_port(settings.host, avoid_ports)
            url = f"http://{settings.host}:{self._port}"
        else:
            url = settings.url.rstrip("/")  # type: ignore[union-attr]
        self.info = EngineInfo(
            url=url,
            parallel=settings.engine_slots,
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
            self.state_format = LlamaStateFormat(shifting_flag(list(settings.extra_args), dict(os.environ)))
        self._client = EngineClient(url, self._state, lambda: self._proc, managed=self.managed,
                                    restart_on_crash=settings.restart_on_crash)

    # -- lifecycle ---------------------------------------------------------

    async def start(self) -> None:
        self._client.open(self._api_key, self.settings.request_timeout_s)
        try:
            if self.managed:
                if self.settings.slot_save_path is not None:
                    make_private_dir(Path(self.settings.slot_save_path))
                await self._spawn()
            else:
                log.info("[strata] attaching to the engine at %s", self.info.url)
                await self._wait_healthy()
                self.generation += 1
                self._state.set_up()
            await self._read_props()
        except BaseException:
            await self.stop()  # never leave a half-started engine behind
            raise
        # Hooks learn of the start before any request is let through.
        if self.on_start is not None:
            await self.on_start(False)
        self._state.set_ready()
        if self.managed:
            self._monitor = asyncio.create_task(self._supervise(), name="strata-engine-monitor")

    async def stop(self) -> None:
        self._state.set_stopping()
        if self._monitor is not None:
            self._monitor.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._monitor
        if self._proc is not None and self._proc.returncode is None:
            log.info("[strata] stopping the engine (pid %d)", self._proc.pid)
            self._proc.send_signal(signal.SIGTERM)
            if not await process.exited(self._proc, STOP_TIMEOUT_S):
                log.warning("[strata] engine ignored SIGTERM for %.0f s; killing it", STOP_TIMEOUT_S)
                await process.kill(self._proc)
        await self._end_pump()
        await self._client.close()

    def kill(self) -> None:
        """Stop at once (a second signal during a stop): SIGKILL, no restart.

        Calls in flight fail at once; :meth:`stop` then finds the process gone. An
        attached engine is not ours to kill.
        """
        self._state.set_stopping()
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
        return self._state.ready.is_set()

    async def wait_ready(self) -> None:
        """Wait (up to the start timeout) until requests may go to the engine.

        :raises EngineUnavailable: at once when the engine is down with no start under
            way (the message says whether a restart is coming), or past the start timeout.
        """
        await self._state.wait_ready()

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
        level = logging.getLevelName(self.settings.log_level.upper())
        assert proc.stdout is not None
        self._pump = asyncio.create_task(
            forward_output(proc.stdout, level if isinstance(level, int) else logging.INFO, self._tail),
            name="strata-engine-log")
        try:
            await self._wait_healthy(proc)
        except BaseException:
            # A start that timed out (or was cancelled) must not finish later unseen.
            await process.kill(proc)
            raise
        self.start_seconds = time.monotonic() - began
        self.generation += 1
        self._state.set_up()
        log.info(
            "[strata] engine ready at %s in %.2f s (pid %d)", self.info.url, self.start_seconds, proc.pid
        )

    async def _launch(self, cmd: list[str]) -> asyncio.subprocess.Process:
        """Create the engine's process (one place, so a test can stand in for a slow or failing one)."""
        return await process.launch(cmd, process.engine_env(self._binary, self._api_key))

    async def _wait_healthy(self, proc: asyncio.subprocess.Process | None = None) -> None:
        deadline = time.monotonic() + self.settings.start_timeout_s
        next_note = time.monotonic() + 5
        # A small model is up in about 0.1 s: look every 10 ms for the first 2 s, then
        # every 50 ms (a large one loads for minutes).
        often_until = time.monotonic() + 2
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
            await asyncio.sleep(0.01 if now < often_until else 0.05)

    async def _read_props(self) -> None:
        with contextlib.suppress(EngineError, EngineUnavailable):
            status, props = await self.request("GET", "/props", op="props")
            if status == 401:
                raise ConfigError(f"the engine at {self.info.url} asks for a key: set engine.api_key "
                                  "(STRATA_ENGINE__API_KEY) to the one it was started with")
            if status == 200 and isinstance(props, dict):
                answers.read_props(self.info, props, getattr(self, "_binary", None))

    async def _supervise(self) -> None:
        """Restart the engine when it dies unasked (a crash, an OOM kill, a SIGKILL).

        Survives any failure of a restart (see :meth:`_restart`); only a stop ends it.
        """
        try:
            while not self._state.stopping:
                proc = self._proc
                assert proc is not None
                await process.exited(proc, every=0.1)
                if self._state.stopping:
                    return
                code = proc.returncode
                if not self.settings.restart_on_crash:
                    log.error("[strata] engine exited with code %s; restart_on_crash is off", code)
                    self._state.set_down(EngineUnavailable(
                        f"the engine exited with code {code} and is not restarted "
                        "(engine.restart_on_crash is off)"))
                    return
                log.error("[strata] engine exited with code %s; restarting it", code)
                if not await self._restart() or self._state.stopping:
                    return
                if self.on_start is not None:
                    try:
                        await self.on_start(True)
                    except Exception:
                        log.exception("[strata] after the engine's restart, the start hooks failed")
                self._state.set_ready()
        except Exception:
            log.exception("[strata] the engine's supervisor failed; the engine is no longer restarted")
        finally:
            if not self._state.stopping and self._state.down is None:
                self._state.set_down(EngineUnavailable("the engine is down and no restart is coming"))

    async def _restart(self) -> bool:
        """Start the engine again until it is up; False when a stop comes first.

        A restart that fails (a start that times out, a spawn that raises) is logged and
        tried again after a growing pause; meanwhile requests are told when the next
        attempt is.
        """
        self._state.set_lost()
        failures = 0
        while not self._state.stopping:
            self._state.set_starting()
            try:
                await self._spawn()
                return True
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                failures += 1
                pause = min(RESTART_BACKOFF_MAX_S, RESTART_BACKOFF_S * 2 ** (failures - 1))
                reason = str(exc) if isinstance(exc, EngineUnavailable) else f"{type(exc).__name__}: {exc}"
                log.error("[strata] engine restart failed: %s; trying again in %g s", reason, pause,
                          exc_info=not isinstance(exc, (EngineUnavailable, OSError)))
                self._state.set_down(EngineUnavailable(
                    f"the engine is down: its restart failed ({reason.splitlines()[0]}); "
                    f"the next attempt is in {pause:g} s", retry_after=pause))
                await asyncio.sleep(pause)
        return False

    # -- calls -------------------------------------------------------------

    async def health(self) -> bool:
        return await self._client.health()

    async def request(
        self, method: str, path: str, json: Any = None, *, op: str = "request", resend: bool = True
    ) -> tuple[int, Any]:
        """One call; returns ``(status, body)`` with the body parsed as JSON when it is JSON.

        It waits until the engine is up, and is sent again when it delivered nothing
        (see :class:`EngineClient`); with ``resend=False`` never to an engine that
        came back, which holds nothing of what the call was about.

        :raises EngineUnavailable: when the engine cannot be reached.
        """
        return await self._client.request(method, path, json, resend=resend)

    def stream(self, path: str, json: Any) -> contextlib.AbstractAsyncContextManager[StreamReply]:
        """A streamed call; leaving it early drops the connection, which stops the engine's work.

        Like :meth:`request`, it waits until the engine is up and is sent again when it
        delivered nothing. Its own connection is not kept.
        """
        return self._client.stream(path, json)

    async def _slot_action(self, op: str, slot: int, body: dict[str, Any] | None) -> dict[str, Any]:
        status, answer = await self.request(
            "POST", f"/slots/{slot}?action={op}", json=body or {}, op=op, resend=False
        )
        if status != 200 or not isinstance(answer, dict):
            raise EngineError(op=op, message=answers.error_message(answer), status=status, body=answer)
        return answer

    async def save(self, filename: str, slot: int = 0) -> SlotSaved:
        return answers.slot_saved(await self._slot_action("save", slot, {"filename": filename}))

    async def restore(self, filename: str, slot: int = 0) -> SlotRestored:
        return answers.slot_restored(await self._slot_action("restore", slot, {"filename": filename}))

    async def erase(self, slot: int = 0) -> SlotErased:
        return answers.slot_erased(await self._slot_action("erase", slot, None))

    async def slots(self) -> list[SlotReport]:
        status, answer = await self.request("GET", "/slots", op="slots")
        if status != 200 or not isinstance(answer, list):
            raise EngineError(op="slots", message=answers.error_message(answer), status=status, body=answer)
        return answers.slot_reports(answer)

    async def prompt_tokens(self, path: str, body: dict[str, Any]) -> list[int] | None:
        """The prompt's tokens as llama-server reads it: a chat's messages through its own
        chat template (``/apply-template``, the same parsing as ``/v1/chat/completions``),
        then its tokenizer (``/tokenize`` with the special tokens a completion adds and
        parses). An Anthropic or Responses body is converted to its chat as the engine does
        (``chat_bodies.py``), and the tokens are kept only if the engine's own count of the
        body agrees. None for media, for a prompt that is not one text, for a count that
        differs, and for other paths."""
        if path not in COUNT_PATHS:
            return await self._tokens(path, body)
        # The engine counts while the copy converts, renders and tokenizes.
        tokens, counted = await asyncio.gather(self._tokens(path, body), self._count(path, body),
                                               return_exceptions=True)
        if isinstance(tokens, BaseException):
            raise tokens
        if tokens is None:
            return None
        if isinstance(counted, BaseException):
            if not isinstance(counted, (EngineError, EngineUnavailable)):
                raise counted
            counted = None
        return tokens if self._counts_agree(path, counted, len(tokens)) else None

    async def _tokens(self, path: str, body: dict[str, Any]) -> list[int] | None:
        text = await prompt_text(path, body, self.request)
        if text is None:
            return None
        status, answer = await self.request("POST", "/tokenize",
                                            {"content": text, "add_special": True, "parse_special": True},
                                            op="tokenize")
        tokens = answer.get("tokens") if status == 200 and isinstance(answer, dict) else None
        if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
            raise EngineError(op="tokenize", message=answers.error_message(answer), status=status, body=answer)
        return tokens

    async def _count(self, path: str, body: dict[str, Any]) -> int | None:
        """The engine's own count of ``body``'s prompt tokens; None where it refuses the body
        (a request it refuses needs no tokens)."""
        status, answer = await self.request("POST", COUNT_PATHS[path], body, op="count_tokens")
        counted = answer.get("input_tokens") if status == 200 and isinstance(answer, dict) else None
        return counted if isinstance(counted, int) else None

    def _counts_agree(self, path: str, counted: int | None, made: int) -> bool:
        """Whether the engine counted ``made`` tokens, as the conversion made them (a
        difference is logged once per path: the engine converts that API differently; no
        count, the engine refused the body, is no agreement either)."""
        if counted == made:
            return True
        if counted is not None and path not in self._miscounted:
            self._miscounted.add(path)
            log.warning("[strata] llama-server counts %d tokens for a %s request where strata-serve's copy of its "
                        "conversion makes %d: its prompts are restored by their key, not their tokens (this "
                        "engine converts that API differently from the version strata-serve knows)",
                        counted, path, made)
        return False

    def read_timings(self, numbers: Any) -> Timings | None:
        """llama-server's ``timings`` (see :func:`answers.read_llama_timings`)."""
        return answers.read_llama_timings(numbers)

    def read_overflow(self, error: dict[str, Any]) -> ContextOverflow | None:
        """llama-server's ``exceed_context_size_error`` (see :func:`answers.read_overflow`)."""
        return answers.read_overflow(error)
