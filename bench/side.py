"""What side requests cost the main conversation: ``python -m bench.side`` (``make bench-side``).

Replays two clients' patterns (the shapes of their captured traffic, scaled to an 8k
context) against four set-ups on the same model, and writes
``bench/results/side-requests.md``:

- **Open WebUI**: each main turn streamed, then its follow-ups (and after the first turn
  its title and tags), one after another, not streamed, on ``/v1/chat/completions``;
- **Claude Code**: each main turn streamed on ``/v1/messages``, with its session-title
  request (another system prompt, streamed) sent at the same instant.

The set-ups: llama-server alone with one slot (``-np 1``) and with its own default (4 slots
over one KV pool), strata-serve with the plain one-slot engine (``side_slot_tokens = 0``, the default)
and strata-serve with a side slot beside the main one (``side_slot_tokens = 2048``). For each main turn after the
first: time to first token, prompt tokens the engine read again, and strata-serve's saves
and restores. Side requests ask for a short answer (the title 64 tokens, not Claude Code's
32,000), so that the set-ups that do not bound them spend no minutes writing.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any
from collections.abc import AsyncIterator

import aiohttp
from aiohttp import web

from bench.harness import BENCH_ENGINE_KEY, client_session
from strata_serve.config import EngineSettings, Settings
from strata_serve.engine import LlamaServer
from strata_serve.engine.llama_server import free_port
from strata_serve.models import packaged_model_path
from strata_serve.service import Service

RESULTS = Path(__file__).resolve().parent / "results"
CTX = 8192
SETUPS = ("llama-server -np 1", "llama-server default (4 slots)", "strata-serve side_slot_tokens = 0",
          "strata-serve side_slot_tokens = 2048")


def words(name: str, tokens: int) -> str:
    """About ``tokens`` tokens of text (SmolLM2: about 4 characters a token)."""
    unit = f" {name} checks the harbour log;"
    return (unit * (tokens * 4 // len(unit) + 1))[:tokens * 4]


@contextlib.asynccontextmanager
async def setup(name: str, model: Path, work: Path) -> AsyncIterator[tuple[str, Service | None]]:
    """The set-up ``name``; yields its URL and strata-serve's service (None for a bare engine)."""
    slot_dir = work / name.replace(" ", "-").replace("=", "")
    if name.startswith("llama-server"):
        # The engine's own default is -np -1: 4 slots over one pool (the last -np wins).
        extra = ["-np", "-1"] if "default" in name else []
        engine = LlamaServer(EngineSettings(model=model, ctx_size=CTX, slot_save_path=slot_dir, side_slot_tokens=0,
                                            log_level="DEBUG", api_key=BENCH_ENGINE_KEY, extra_args=extra))
        await engine.start()
        try:
            yield engine.info.url, None
        finally:
            await engine.stop()
        return
    from strata_serve.api import SERVICE, create_app
    from strata_serve.plugins import get_plugin_manager

    side = {"side_slot_tokens": 0 if name.endswith("= 0") else 2048}
    settings = Settings(server={"port": free_port("127.0.0.1")},
                        engine={"model": model, "ctx_size": CTX, "slot_save_path": slot_dir, "log_level": "DEBUG",
                                **side})
    app = create_app(settings, get_plugin_manager(settings))
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", settings.server.port).start()
    try:
        yield f"http://127.0.0.1:{settings.server.port}", app[SERVICE]
    finally:
        await runner.cleanup()


async def stream(session: aiohttp.ClientSession, url: str, path: str, body: dict) -> dict[str, Any]:
    """One streamed request: time to first token, the tokens read and reused, X-Strata-State."""
    began = time.perf_counter()
    first = None
    read = reused = None
    headers = {"anthropic-version": "2023-06-01"} if path == "/v1/messages" else {}
    async with session.post(url + path, json={**body, "stream": True}, headers=headers) as resp:
        if resp.status != 200:
            raise RuntimeError(f"{url}{path}: HTTP {resp.status}: {await resp.text()}")
        state = resp.headers.get("X-Strata-State", "-")
        async for raw in resp.content:
            line = raw.strip()
            if not line.startswith(b"data:") or line == b"data: [DONE]":
                continue
            event = json.loads(line[5:])
            if first is None and (event.get("type") == "content_block_delta" or any(
                    (c.get("delta") or {}).get("content") for c in event.get("choices") or [])):
                first = time.perf_counter()
            if event.get("timings"):
                read, reused = event["timings"]["prompt_n"], event["timings"]["cache_n"]
            usage = event.get("usage") or (event.get("message") or {}).get("usage")
            if path == "/v1/messages" and usage and "input_tokens" in usage:
                read, reused = usage["input_tokens"], usage.get("cache_read_input_tokens", 0)
    end = time.perf_counter()
    return {"ttft_s": (first or end) - began, "read": read, "reused": reused, "state": state}


async def plain(session: aiohttp.ClientSession, url: str, body: dict) -> None:
    async with session.post(url + "/v1/chat/completions", json={**body, "stream": False}) as resp:
        if resp.status != 200:
            raise RuntimeError(f"{url}: HTTP {resp.status}: {await resp.text()}")
        await resp.read()


def task(kind: str, history: list[dict], tokens: int) -> dict:
    flat = "\n".join(f"{m['role'].upper()}: {m['content']}" for m in history if m["role"] != "system")
    text = f"### Task:\n{kind} {words('task', tokens - len(flat) // 4)}\n### Chat History:\n<chat_history>\n{flat}\n"
    return {"messages": [{"role": "user", "content": text + "</chat_history>"}], "max_tokens": 24, "temperature": 0}


async def open_webui(session: aiohttp.ClientSession, url: str, turns: int) -> list[dict[str, Any]]:
    chat = [{"role": "system", "content": words("system", 150)}, {"role": "user", "content": words("q1", 60)}]
    found = []
    for turn in range(turns):
        reply = await stream(session, url, "/v1/chat/completions",
                             {"messages": chat, "max_tokens": 120, "temperature": 0})
        if turn:
            found.append(reply)
        chat = [*chat, {"role": "assistant", "content": words(f"a{turn}", 120)},
                {"role": "user", "content": words(f"q{turn + 2}", 40)}]
        await plain(session, url, task("Suggest 3-5 follow-up questions.", chat[-6:], 650))
        if turn == 0:
            await plain(session, url, task("Generate a concise title.", chat[-2:], 650))
            await plain(session, url, task("Generate 1-3 broad tags.", chat[-6:], 600))
    return found


async def claude_code(session: aiohttp.ClientSession, url: str, turns: int) -> list[dict[str, Any]]:
    system = [{"type": "text", "text": "You are Claude Code, Anthropic's official CLI for Claude."},
              {"type": "text", "text": words("agent", 1200)}]
    title_system = [{"type": "text", "text": "You are Claude Code, Anthropic's official CLI for Claude."},
                    {"type": "text", "text": "Write a 2-3 word title for this coding session. JSON {title}"}]
    prompts = [f"Fix the failing test number {n} in utils.py" for n in range(turns)]
    messages = [{"role": "user", "content": words("reminders", 700) + "\n" + prompts[0]}]
    found = []
    for turn in range(turns):
        title = {"model": "haiku", "max_tokens": 64, "system": title_system,
                 "messages": [{"role": "user", "content": prompts[turn]}]}

        async def main(body: dict) -> dict[str, Any]:
            await asyncio.sleep(0.05)
            return await stream(session, url, "/v1/messages", body)

        _, reply = await asyncio.gather(
            stream(session, url, "/v1/messages", title),
            main({"model": "sonnet", "max_tokens": 48, "system": system, "messages": messages}))
        if turn:
            found.append(reply)
        messages = [*messages, {"role": "assistant", "content": words(f"r{turn}", 40)},
                    {"role": "user", "content": words(f"tool{turn}", 450) + "\n" + prompts[min(turn + 1, turns - 1)]}]
    return found


def parking_counts(service: Service | None) -> tuple[int, int]:
    if service is None:
        return 0, 0
    parking = service.state.get("auto_sessions")
    return (parking.stats.saves, parking.stats.restores) if parking is not None else (0, 0)


async def main(out: Path, turns: int) -> dict[str, Any]:
    model = packaged_model_path("smollm2")
    figures: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="strata-bench-side-") as tmp:
        for name in SETUPS:
            for client, run in (("Open WebUI", open_webui), ("Claude Code", claude_code)):
                async with setup(name, model, Path(tmp) / client.replace(" ", "")) as (url, service):
                    async with client_session() as session:
                        before = parking_counts(service)
                        replies = await run(session, url, turns)
                        after = parking_counts(service)
                figures.setdefault(client, {})[name] = {
                    "replies": replies, "saves": after[0] - before[0], "restores": after[1] - before[1],
                    "main_turns": len(replies)}
                print(f"[bench] {client} on {name}: {replies}", flush=True)
    out.write_text(report(figures, turns))
    return figures


def report(figures: dict[str, Any], turns: int) -> str:
    lines = ["# Side requests and the main conversation", "",
             f"`python -m bench.side` (`make bench-side`): SmolLM2-135M Q4_1, context {CTX}, {turns} main turns per "
             "client, figures for every main turn after the first (after side requests). Saves and restores: "
             "auto-sessions', all conversations, per main turn (side requests' own included), counted over the "
             "whole replay. One run on a 2-core machine shared with other work: read the times as a rough guide, "
             "the tokens and states as exact.", ""]
    for client, setups in figures.items():
        lines += [f"## {client}", "", "| set-up | time to first token, s | tokens read again | tokens reused | "
                  "X-Strata-State | saves / main turn | restores / main turn |", "|---|---|---|---|---|---|---|"]
        for name, found in setups.items():
            replies = found["replies"]
            ttft = statistics.median(r["ttft_s"] for r in replies)
            read = "/".join(str(r["read"]) for r in replies)
            reused = "/".join(str(r["reused"]) for r in replies)
            states = "/".join(r["state"] for r in replies)
            per = max(1, found["main_turns"] + 1)
            lines.append(f"| {name} | {ttft:.2f} | {read} | {reused} | {states} | {found['saves'] / per:.1f} | "
                         f"{found['restores'] / per:.1f} |")
        lines.append("")
    lines += ["Raw figures:", "", "```json", json.dumps(figures, indent=1), "```", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=3, help="main turns per client (default 3)")
    parser.add_argument("--out", type=Path, default=RESULTS / "side-requests.md")
    args = parser.parse_args()
    asyncio.run(main(args.out, args.turns))
