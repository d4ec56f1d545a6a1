"""Concurrent coding agents: each grows a main context, runs sub-agent contexts, returns to main.

The clients behave as agent frameworks do: they stream with ``requests``, several at
once, and close the connection as soon as they have read the event that carries the
timings (before ``[DONE]``). A return to a main context "re-read its context" when the
engine reused less than half of what that context held at its previous turn.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import requests

from bench.harness import BENCH_ENGINE_KEY, bare_engine, conversation, strata

#: The engine's RAM prompt cache: off, limited below the working set, and at its default.
RAM_SETTINGS = ("off", "limited", "default")


def stream_until_timings(url: str, messages: list[dict], max_tokens: int = 4) -> tuple[dict, str]:
    """Stream one answer; close the connection right after the event with the timings."""
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    text = []
    # The bare engine asks for its key; strata-serve, run here without keys, ignores it.
    headers = {"Authorization": f"Bearer {BENCH_ENGINE_KEY}"}
    with requests.post(url + "/v1/chat/completions", json=body, headers=headers, stream=True,
                       timeout=600) as reply:
        if reply.status_code != 200:
            raise RuntimeError(f"{url}: HTTP {reply.status_code}: {reply.text}")
        for line in reply.iter_lines():
            if not line.startswith(b"data:") or line[5:].strip() == b"[DONE]":
                continue
            event = json.loads(line[5:])
            for choice in event.get("choices") or []:
                text.append((choice.get("delta") or {}).get("content") or "")
            if "timings" in event:
                return event["timings"], "".join(text)
    raise RuntimeError("the stream ended without timings")


def agent(url: str, name: str, steps: int, step_tokens: int) -> dict[str, Any]:
    """One agent session: main turn, a sub-agent context, back to main, ``steps`` times."""
    main = conversation(f"{name} main", step_tokens)
    returns, reread, reread_tokens = 0, 0, 0
    held_before = 0
    for step in range(steps):
        timings, text = stream_until_timings(url, main)
        prompt = int(timings.get("cache_n", 0)) + int(timings.get("prompt_n", 0))
        if step:
            returns += 1
            if timings.get("cache_n", 0) < 0.5 * held_before:
                reread += 1
                reread_tokens += int(timings.get("prompt_n", 0))
        held_before = prompt
        stream_until_timings(url, conversation(f"{name} sub-agent {step}", step_tokens // 2))
        question = conversation(f"{name} step {step}", step_tokens)[0]["content"]
        main = main + [{"role": "assistant", "content": text}, {"role": "user", "content": question}]
    return {"returns": returns, "reread": reread, "reread_tokens": reread_tokens}


async def concurrent_agents(model: Path, work: Path, *, sessions: int, steps: int, step_tokens: int,
                            limited_mib: int, min_tokens: int) -> dict[str, Any]:
    """Bare engine and strata-serve with auto-sessions, each RAM setting, side by side in one run."""
    ctx = (steps + 2) * step_tokens * 2 + 1024
    found: dict[str, Any] = {}
    for ram in RAM_SETTINGS:
        cache = {"off": 0, "limited": limited_mib, "default": None}[ram]
        for through_strata in (False, True):
            name = f"{'strata + auto-sessions' if through_strata else 'llama-server'}, RAM cache {ram}"
            slot_dir = work / f"agents-{ram}-{int(through_strata)}"
            setup = (strata(model, ctx, slot_dir, cache, plugins={"auto_sessions": {"min_tokens": min_tokens}})
                     if through_strata else bare_engine(model, ctx, slot_dir, cache))
            began = time.perf_counter()
            async with setup as url:
                results = await asyncio.gather(*(
                    asyncio.to_thread(agent, url, f"Agent{n}", steps, step_tokens) for n in range(sessions)))
            found[name] = {
                "wall_s": time.perf_counter() - began,
                "returns": sum(r["returns"] for r in results),
                "reread": sum(r["reread"] for r in results),
                "reread_tokens": sum(r["reread_tokens"] for r in results),
            }
            print(f"  concurrent agents, {name}: {found[name]}", flush=True)
    return found
