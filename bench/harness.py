"""Start what a user would run (a bare llama-server, or strata-serve in front of one) and time it."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from collections.abc import AsyncIterator, Mapping

import aiohttp
from aiohttp import web

from strata_serve.config import EngineSettings, Settings
from strata_serve.engine import LlamaServer
from strata_serve.engine.llama_server import free_port


#: The key of the bare engine the benchmarks start (an engine started by LlamaServer asks for one).
BENCH_ENGINE_KEY = "strata-bench"


@dataclass
class Reply:
    ttft_s: float
    total_s: float
    timings: dict[str, Any]
    text: str
    #: The answer's headers (strata-serve's ``X-Strata-*`` among them), any case.
    headers: Mapping[str, str] = field(default_factory=dict)


@contextlib.asynccontextmanager
async def bare_engine(model: Path, ctx: int, slot_dir: Path, cache_ram_mib: int | None) -> AsyncIterator[str]:
    """A llama-server on its own; yields its base URL."""
    engine = LlamaServer(EngineSettings(model=model, ctx_size=ctx, slot_save_path=slot_dir, side_slot_tokens=0,
                                        cache_ram_mib=cache_ram_mib, log_level="DEBUG", api_key=BENCH_ENGINE_KEY))
    await engine.start()
    try:
        yield engine.info.url
    finally:
        await engine.stop()


@contextlib.asynccontextmanager
async def strata(model: Path, ctx: int, slot_dir: Path, cache_ram_mib: int | None,
                 plugins: dict[str, dict[str, Any]] | None = None, entrypoints: bool = True,
                 engine: dict[str, Any] | None = None) -> AsyncIterator[str]:
    """strata-serve with its installed plugins (minus those marked ``enabled: False``); yields its URL.
    ``engine``: engine settings beyond the model, context, slot directory and RAM cache."""
    from strata_serve.api import create_app
    from strata_serve.plugins import get_plugin_manager

    settings = Settings(
        server={"port": free_port("127.0.0.1"), "queue_limit": 256},
        engine={"model": model, "ctx_size": ctx, "slot_save_path": slot_dir,
                "cache_ram_mib": cache_ram_mib, "log_level": "DEBUG", **(engine or {})},
        plugins=plugins or {},
    )
    pm = get_plugin_manager(settings, entrypoints=entrypoints)
    runner = web.AppRunner(create_app(settings, pm), handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", settings.server.port)
    await site.start()
    try:
        yield f"http://127.0.0.1:{settings.server.port}"
    finally:
        await runner.cleanup()


def client_session() -> aiohttp.ClientSession:
    """The benchmark client: a new connection per request, as the engine may close one after a stream."""
    # The bare engine asks for its key; strata-serve, run here without keys, ignores it.
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True),
                                 headers={"Authorization": f"Bearer {BENCH_ENGINE_KEY}"})


async def chat(session: aiohttp.ClientSession, url: str, messages: list[dict], max_tokens: int = 1,
               headers: dict[str, str] | None = None, **extra: Any) -> Reply:
    """One streamed chat request: time to first token, total time, the engine's timings."""
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True, **extra}
    began = time.perf_counter()
    first = None
    timings: dict[str, Any] = {}
    text = []
    async with session.post(url + "/v1/chat/completions", json=body, headers=headers) as resp:
        if resp.status != 200:
            raise RuntimeError(f"{url}: HTTP {resp.status}: {await resp.text()}")
        async for raw in resp.content:
            line = raw.strip()
            if not line.startswith(b"data:") or line == b"data: [DONE]":
                continue
            event = json.loads(line[5:])
            for choice in event.get("choices") or []:
                piece = (choice.get("delta") or {}).get("content")
                if piece:
                    text.append(piece)
                    if first is None:
                        first = time.perf_counter()
            timings = event.get("timings") or timings
        answered = resp.headers
    end = time.perf_counter()
    return Reply(ttft_s=(first or end) - began, total_s=end - began, timings=timings, text="".join(text),
                 headers=answered)


def conversation(name: str, tokens: int) -> list[dict]:
    """A first user message of about ``tokens`` tokens (the demo vocabulary: one per character)."""
    unit = f" {name} sails the northern sea;"
    return [{"role": "user", "content": (unit * (tokens // len(unit) + 1))[:tokens]}]


def follow_up(messages: list[dict], reply: str, question: str = "And then?") -> list[dict]:
    return messages + [{"role": "assistant", "content": reply}, {"role": "user", "content": question}]


def spread(values: list[float], digits: int = 3) -> str:
    """Median with the range, e.g. ``0.210 (0.190-0.240)``."""
    if len(values) == 1:
        return f"{values[0]:.{digits}f}"
    return f"{statistics.median(values):.{digits}f} ({min(values):.{digits}f}-{max(values):.{digits}f})"


def percentile(values: list[float], pct: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(pct / 100 * (len(ordered) - 1))))]


def paired_ratio(through: list[float], alone: list[float]) -> float:
    """The median of ``through[i] / alone[i]``, each pair measured in turn (one round).

    The machine's speed moves between rounds (a 150-token stream took 1.0-1.9 s alone within
    one run on a quiet 2-core machine): a ratio of the two medians mixes that into the figure,
    the ratio of each round's pair cancels what the two share. A round whose ``alone`` is 0
    (no figure: an answer without the engine's timings) is left out."""
    return statistics.median(_ratios(through, alone))


def _ratios(through: list[float], alone: list[float]) -> list[float]:
    ratios = [t / a for t, a in zip(through, alone) if a]
    if not ratios:
        raise ValueError("no round has a figure to compare with")
    return ratios


def ratio_interval(through: list[float], alone: list[float], rounds: int = 2000,
                   seed: int = 39) -> tuple[float, float]:
    """A 90% interval for :func:`paired_ratio`: the rounds resampled with replacement, each
    keeping its pair together, ``rounds`` times (seeded, so a run's figures repeat)."""
    picks = random.Random(seed)
    pairs = _ratios(through, alone)
    ratios = sorted(statistics.median(picks.choices(pairs, k=len(pairs))) for _ in range(rounds))
    return ratios[int(rounds * 0.05)], ratios[int(rounds * 0.95) - 1]


async def disk_speed(directory: Path, size_mb: int = 256) -> tuple[float, float]:
    """Sequential write (with fsync) and read speed of ``directory`` in MB/s."""
    path = directory / "disk-probe.bin"
    block = b"\0" * (1 << 20)

    def run() -> tuple[float, float]:
        began = time.perf_counter()
        with open(path, "wb") as handle:
            for _ in range(size_mb):
                handle.write(block)
            handle.flush()
            import os

            os.fsync(handle.fileno())
        write = size_mb / (time.perf_counter() - began)
        began = time.perf_counter()
        with open(path, "rb") as handle:
            while handle.read(1 << 20):
                pass
        read = size_mb / (time.perf_counter() - began)
        path.unlink()
        return write, read

    return await asyncio.to_thread(run)
