"""Fixtures for testing strata-serve and its plugins against the real engine.

Installed as a pytest plugin (``pytest11``), so any project with strata-serve
installed gets them:

- ``strata_demo_model``: a tiny random-weight GGUF, written once per test session.
- ``strata_settings_factory``: ``make(**sections)`` -> :class:`~strata_serve.config.Settings`
  for the tiny model, a fresh slot directory and ``--cache-ram 0``.
- ``strata_client_factory``: ``await make(*plugins, settings=..., entrypoints=False)`` -> an
  aiohttp ``TestClient`` for a real server that starts (and stops) its own llama-server.
- ``chat_body()``, ``conversation()``, ``assert_openai_error()`` and the ``KeyRecorder``
  plugin: helpers to build requests, check errors and see which key each request got.
- ``llama_server_factory``: ``await make(**engine_settings)`` -> a started bare
  :class:`~strata_serve.engine.LlamaServer`, for comparing against the engine alone.
- ``strata_memory_client_factory``: like ``strata_client_factory``, on the in-memory
  engine double (:class:`~strata_serve.memory_engine.MemoryEngine`, chosen through the
  ``engine_backend`` hook by the :class:`MemoryBackend` plugin): a keying or quirk
  plugin's unit tests run in milliseconds. The real engine stays the judge of what the
  engine does.

Async tests need pytest-asyncio (``asyncio_mode = "auto"`` or ``@pytest.mark.asyncio``).
"""

from __future__ import annotations

import asyncio
import copy
import inspect
import time
from pathlib import Path
from typing import Any
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from strata_serve.config import Settings
from strata_serve.hookspecs import hookimpl
from strata_serve.engine import LlamaServer
from strata_serve.plugins import get_plugin_manager
from strata_serve.service import Service

# Async fixtures in strict mode need pytest-asyncio's marker; without it (strata-serve
# installed without its test extra), plain pytest's: this plugin must still load.
async_fixture: Any = pytest.fixture
try:
    import pytest_asyncio

    async_fixture = pytest_asyncio.fixture
except ImportError:
    pass


def chat_body(text: str = "Hello there", *, max_tokens: int = 8, **extra: Any) -> dict[str, Any]:
    """A greedy chat request with one user message (same text, same answer)."""
    return {
        "messages": [{"role": "user", "content": text}],
        "max_tokens": max_tokens,
        "temperature": 0,
        **extra,
    }


def chat(messages: list[dict[str, Any]], *, max_tokens: int = 8, **extra: Any) -> dict[str, Any]:
    """A greedy chat request with these messages."""
    return {"messages": messages, "max_tokens": max_tokens, "temperature": 0, **extra}


async def ask(client: Any, messages: list[dict[str, Any]], *, key: str | None = None,
              headers: dict[str, str] | None = None, **extra: Any) -> dict[str, Any]:
    """Send :func:`chat` of ``messages`` to a test client's server (as the holder of
    ``key``, when given), fail unless it answers 200, and return its JSON answer."""
    headers = {**(headers or {}), **({"Authorization": f"Bearer {key}"} if key else {})}
    resp = await client.post("/v1/chat/completions", json=chat(messages, **extra), headers=headers)
    assert resp.status == 200, await resp.text()
    return await resp.json()


async def until(condition: Callable[[], Any], timeout: float = 10, what: str = "the condition") -> None:
    """Wait until ``condition()`` is true (it may return an awaitable), looking every 10 ms;
    fail naming ``what`` past ``timeout`` seconds. The way a test waits for something to
    happen, instead of sleeping for a time it hopes is enough."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return
        assert time.monotonic() < deadline, f"{what} did not happen within {timeout:g} s"
        await asyncio.sleep(0.01)


async def until_idle(service: Service, timeout: float = 10) -> None:
    """Wait until no request holds a turn: every ``post_request`` step has finished.

    A plain answer reaches the client before its request's ``post_request`` steps have
    run (a stream's always did): a test that checks what they do, or what the core does
    as a turn ends (the FIFO idle, ``GET /stats``' ``phases``), waits for this first.
    """
    await asyncio.wait_for(service.fifo.wait_idle(), timeout)


def conversation(name: str, turns: int = 1) -> list[dict[str, Any]]:
    """Messages of a conversation whose first user message is about 750 tokens on the demo model.

    Long enough to be worth parking with a small ``min_tokens``; ``turns`` user messages.
    """
    opening = f"Conversation {name}: " + " ".join(f"{name}{n} ship sea wind" for n in range(40))
    messages = [{"role": "user", "content": opening}]
    for n in range(1, turns):
        messages += [{"role": "assistant", "content": f"reply {n}"},
                     {"role": "user", "content": f"and then {name} {n}?"}]
    return messages


class MemoryBackend:
    """A plugin that makes the server drive the in-memory engine double (``engine_backend``)."""

    strata_name = "memory_backend"

    def __init__(self) -> None:
        self.engine: Any = None

    @hookimpl(tryfirst=True)
    def engine_backend(self, settings: Settings) -> Any:
        from strata_serve.memory_engine import MemoryEngine

        self.engine = MemoryEngine(settings.engine.slot_save_path, settings.engine.ctx_size)
        return self.engine


class KeyRecorder:
    """A throwaway plugin that writes down the key of every request reaching the engine."""

    strata_name = "key_recorder"

    def __init__(self) -> None:
        self.seen: list[str | None] = []

    @hookimpl
    def pre_request(self, request: Any) -> None:
        self.seen.append(request.conversation_key)


def assert_openai_error(body: Any, status: int | None = None, actual_status: int | None = None) -> None:
    """Fail unless ``body`` is an error in the OpenAI shape (and, if given, the status matches)."""
    if status is not None:
        assert actual_status == status, f"expected HTTP {status}, got {actual_status}: {body}"
    assert isinstance(body, dict) and set(body) == {"error"}, body
    error = body["error"]
    assert isinstance(error.get("message"), str) and error["message"], body
    assert isinstance(error.get("type"), str), body
    assert "param" in error and "code" in error, body


def deep_merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    merged = copy.deepcopy(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


@pytest.fixture(scope="session")
def strata_demo_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from strata_serve.demo_model import write_demo_model

    return write_demo_model(tmp_path_factory.mktemp("models") / "tiny.gguf", size="tiny")


@pytest.fixture
def strata_settings_factory(tmp_path: Path, strata_demo_model: Path) -> Callable[..., Settings]:
    """``make(engine={...}, server={...}, plugins={...})``: settings for a test server.

    Its engine is the plain one-slot engine (``side_slot_tokens = 0``), which most tests
    are about; ``engine={"side_slot_tokens": 2048}`` gives the side lane, a side slot
    beside the main one (off by default).
    """

    def make(**sections: Any) -> Settings:
        defaults: dict[str, Any] = {
            "server": {"port": 0, "shutdown_grace_s": 10},
            "engine": {
                "model": str(strata_demo_model),
                "ctx_size": 4096,
                "side_slot_tokens": 0,
                "slot_save_path": str(tmp_path / "slots"),
                "cache_ram_mib": 0,
                "start_timeout_s": 60,
                "log_level": "DEBUG",
            },
        }
        return Settings(**deep_merge(defaults, sections))

    return make


@pytest.fixture
def strata_client_factory(aiohttp_client: Any, strata_settings_factory: Callable[..., Settings]):
    """``await make(*plugins, settings=None, entrypoints=False, engine=None)``: a test client.

    Only the plugins passed (plus the built-in defaults) are registered unless
    ``entrypoints=True``, so a test controls exactly what runs.
    """
    from strata_serve.api import create_app

    async def make(
        *plugins: object,
        settings: Settings | None = None,
        entrypoints: bool = False,
        engine: Any = None,
    ):
        settings = settings or strata_settings_factory()
        pm = get_plugin_manager(settings, entrypoints=entrypoints, plugins=plugins)
        app = create_app(settings, pm, engine=engine)
        return await aiohttp_client(app)

    return make


@pytest.fixture
def strata_memory_client_factory(strata_client_factory: Any):
    """``await make(*plugins, settings=None)``: a test client on the in-memory engine double."""

    async def make(*plugins: object, settings: Settings | None = None):
        return await strata_client_factory(MemoryBackend(), *plugins, settings=settings)

    return make


@async_fixture
async def llama_server_factory(
    tmp_path: Path, strata_demo_model: Path
) -> AsyncIterator[Callable[..., Awaitable[LlamaServer]]]:
    """``await make(cache_ram_mib=0, ...)``: a bare llama-server on the tiny model."""
    from strata_serve.config import EngineSettings

    started: list[LlamaServer] = []

    async def make(**engine: Any) -> LlamaServer:
        values = {
            "model": strata_demo_model,
            "ctx_size": 4096,
            "side_slot_tokens": 0,
            "slot_save_path": tmp_path / f"bare-slots-{len(started)}",
            "cache_ram_mib": 0,
            "start_timeout_s": 60,
            "log_level": "DEBUG",
        }
        values.update(engine)
        server = LlamaServer(EngineSettings(**values))
        started.append(server)
        await server.start()
        return server

    yield make
    for server in started:
        await server.stop()
