"""What strict tenant isolation costs: ``python -m bench.tenants`` (bench model, two tenants).

Writes ``bench/results/tenants.md`` (tables, and the raw figures as JSON at its end)
and puts :func:`summary` of those figures between the README's ``tenants-summary``
markers; a test checks that both say what the figures say.

Two workloads, each run in shared mode (the engine's RAM cache at its default) and in
strict mode (RAM cache off, the slot erased when the tenant changes):

- **common prefix**: alice and bob take turns, every request opening with the same
  long system prompt and ending with a short question of its own;
- **return**: alice's long conversation, one short request of bob's, then alice's next
  turn; in strict mode once without and once with auto-sessions (which parks alice's
  conversation on disk at the switch and restores it on her return).
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

from bench.harness import chat, conversation, follow_up
from strata_serve.config import Settings
from strata_serve.demo_model import write_demo_model
from strata_serve.engine.llama_server import free_port

RESULTS = Path(__file__).resolve().parent / "results"
KEYS = {"admin": "k-plain", "alice": "ka", "bob": "kb"}


@contextlib.asynccontextmanager
async def server(model: Path, ctx: int, slot_dir: Path, mode: str, auto_sessions: bool) -> AsyncIterator[str]:
    from strata_serve.api import create_app
    from strata_serve.plugins import get_plugin_manager

    settings = Settings(
        server={"port": free_port("127.0.0.1"), "api_key": KEYS["admin"],
                "api_keys": {"alice": KEYS["alice"], "bob": KEYS["bob"]}, "tenant_isolation": mode},
        engine={"model": model, "ctx_size": ctx, "slot_save_path": slot_dir, "log_level": "DEBUG"},
        plugins={"auto_sessions": {"enabled": auto_sessions, "min_tokens": 256},
                 "ram_cache_stats": {"enabled": False}},
    )
    pm = get_plugin_manager(settings)
    runner = web.AppRunner(create_app(settings, pm), handler_cancellation=True, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", settings.server.port).start()
    try:
        yield f"http://127.0.0.1:{settings.server.port}"
    finally:
        await runner.cleanup()


def session(tenant: str) -> aiohttp.ClientSession:
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True),
                                 headers={"Authorization": f"Bearer {KEYS[tenant]}"})


async def common_prefix(url: str, prefix_tokens: int, rounds: int) -> dict[str, Any]:
    """Alternating tenants, one shared system prompt: time to first token after each switch."""
    system = conversation("Everyone", prefix_tokens)[0]["content"]
    found: dict[str, list[float]] = {"ttft_s": [], "cache_n": [], "prompt_n": [], "prompt_ms": []}
    async with session("alice") as alice, session("bob") as bob:
        for n in range(rounds + 1):
            for name, client in (("alice", alice), ("bob", bob)):
                messages = [{"role": "system", "content": system},
                            {"role": "user", "content": f"{name} asks question {n}"}]
                reply = await chat(client, url, messages)
                if n:  # the first round fills the cache; each later request follows the other tenant
                    record(found, reply)
    return found


def record(found: dict[str, list[float]], reply: Any) -> None:
    """Time to first token, and the engine's own figures: tokens reused, re-read, and how long."""
    found["ttft_s"].append(reply.ttft_s)
    for name in ("cache_n", "prompt_n", "prompt_ms"):
        found[name].append(reply.timings.get(name, 0))


async def tenant_return(url: str, tokens: int, rounds: int) -> dict[str, Any]:
    """Alice's long conversation, bob's short request, alice's next turn: her time to first token."""
    history = conversation("Alice", tokens)
    found: dict[str, Any] = {"ttft_s": [], "cache_n": [], "prompt_n": [], "prompt_ms": []}
    async with session("alice") as alice, session("bob") as bob:
        first = await chat(alice, url, history)
        history = follow_up(history, first.text, "Question 0?")
        for n in range(rounds):
            await chat(bob, url, [{"role": "user", "content": f"bob's short question {n}"}])
            reply = await chat(alice, url, history)
            record(found, reply)
            history = follow_up(history, reply.text, f"Question {n + 1}?")
    return {"first_prefill_s": first.ttft_s, "first_prompt_ms": first.timings.get("prompt_ms", 0), **found}


async def erase_ms(url: str, runs: int = 5) -> list[float]:
    found = []
    async with session("admin") as admin:
        for _ in range(runs):
            began = time.perf_counter()
            async with admin.post(url + "/slots/0?action=erase") as resp:
                assert resp.status == 200, await resp.text()
            found.append((time.perf_counter() - began) * 1000)
    return found


SETUPS = {
    # name: (tenant_isolation, auto-sessions on?)
    "shared": ("shared", False),
    "strict": ("strict", False),
    "strict + auto-sessions": ("strict", True),
}


async def main(out: Path, prefix_tokens: int, return_tokens: int, rounds: int) -> dict[str, Any]:
    results: dict[str, Any] = {"prefix_tokens": prefix_tokens, "return_tokens": return_tokens, "rounds": rounds,
                               "common_prefix": {}, "return": {}}
    with tempfile.TemporaryDirectory(prefix="strata-bench-tenants-") as tmp:
        work = Path(tmp)
        model = write_demo_model(work / "bench.gguf", size="bench")
        ctx = max(prefix_tokens, return_tokens) + 1024
        for index, (name, (mode, auto)) in enumerate(SETUPS.items()):
            async with server(model, ctx, work / f"slots-{index}", mode, auto) as url:
                if not auto:
                    results["common_prefix"][name] = await common_prefix(url, prefix_tokens, rounds)
                results["return"][name] = await tenant_return(url, return_tokens, rounds)
                if name == "strict":
                    results["erase_ms"] = await erase_ms(url)
            print(f"  {name}: done", flush=True)
    out.mkdir(parents=True, exist_ok=True)
    (out / "tenants.md").write_text(report(results))
    if out == RESULTS:
        update_readme(results)
    return results


README = RESULTS.parent.parent / "README.md"
START, END = "<!-- tenants-summary: generated from bench/results/tenants.md by bench.tenants.summary -->", \
    "<!-- end tenants-summary -->"


def update_readme(results: dict[str, Any]) -> None:
    text = README.read_text()
    before, rest = text.split(START, 1)
    after = rest.split(END, 1)[1]
    README.write_text(f"{before}{START}\n{summary(results)}\n{END}{after}")


def _median(values: list[float]) -> float:
    return statistics.median(values)


def summary(results: dict[str, Any]) -> str:
    """The README's sentence on what strict mode costs, from the results file.

    Tokens re-read are the engine's own count (``prompt_n``) and do not depend on the
    machine; times are medians of the engine's prefill time (``prompt_ms``) and of the
    time to first token, on a machine shared with other work.
    """
    prefix, back = results["common_prefix"], results["return"]

    def reread(found: dict[str, Any]) -> str:
        return (f"re-read {_median(found['prompt_n']):,.0f} tokens in {_median(found['prompt_ms']) / 1000:.2f} s "
                f"(first token after {_median(found['ttft_s']):.2f} s)")

    return (
        f"Measured on the bench model (`python -m bench.tenants`, {results['rounds']} rounds, medians). "
        f"Two tenants taking turns with the same {results['prefix_tokens']:,}-token system prompt: each "
        f"request {reread(prefix['shared'])} shared, {reread(prefix['strict'])} strict. Returning to a "
        f"{results['return_tokens']:,}-token conversation after another tenant's request: "
        f"{reread(back['shared'])} shared (from the engine's RAM cache), {reread(back['strict'])} strict, "
        f"and {reread(back['strict + auto-sessions'])} strict with auto-sessions (restored from disk). "
        f"The erase itself takes {_median(results['erase_ms']):.1f} ms."
    )


def report(results: dict[str, Any]) -> str:
    lines = ["# Strict tenant isolation: what it costs", "",
             "Made by `python -m bench.tenants`; medians over the rounds of one run, on a machine "
             "shared with other work (the token counts do not depend on it, the times do).", "",
             summary(results), "",
             f"## Two tenants, one {results['prefix_tokens']:,}-token system prompt, taking turns", "",
             "| setup | tokens reused (cache_n) | tokens re-read (prompt_n) | prefill s | first token s |",
             "|---|---|---|---|---|"]
    for name, found in results["common_prefix"].items():
        lines.append(f"| {name} | {_median(found['cache_n']):,.0f} | {_median(found['prompt_n']):,.0f} | "
                     f"{_median(found['prompt_ms']) / 1000:.2f} | {_median(found['ttft_s']):.2f} |")
    lines += ["", f"## Returning to a {results['return_tokens']:,}-token conversation after another tenant's request",
              "", "| setup | first prefill s | tokens reused on return | tokens re-read | prefill s | first token s |",
              "|---|---|---|---|---|---|"]
    for name, found in results["return"].items():
        lines.append(f"| {name} | {found['first_prompt_ms'] / 1000:.2f} | {_median(found['cache_n']):,.0f} | "
                     f"{_median(found['prompt_n']):,.0f} | {_median(found['prompt_ms']) / 1000:.2f} | "
                     f"{_median(found['ttft_s']):.2f} |")
    lines += ["", RAW, "", "```json", json.dumps(results, indent=1), "```"]
    return "\n".join(lines) + "\n"


RAW = "## Raw figures"


def read_results(path: Path = RESULTS / "tenants.md") -> dict[str, Any]:
    """The figures a run wrote at the end of ``tenants.md``."""
    raw = path.read_text().split(RAW, 1)[1]
    return json.loads(raw.split("```json", 1)[1].split("```", 1)[0])


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--prefix-tokens", type=int, default=2000)
    parser.add_argument("--return-tokens", type=int, default=4000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    asyncio.run(main(args.out, args.prefix_tokens, args.return_tokens, args.rounds))
