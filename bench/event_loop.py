"""strata-serve on asyncio's own event loop against uvloop (``server.event_loop``), side by side.

Two ``strata-serve run`` processes of this tree, each with its own engine on the packaged
SmolLM2, one on each loop. The same request goes to one and then the other, the order
turned at each pair (A B B A), so both meet the machine alike: a plain 1-token request on a
new connection and on a kept one, a streamed 1-token request, and a streamed 150-token
answer. Each pair's difference (uvloop minus asyncio) is kept; the table gives their median,
each side's p50, and the CPU each strata-serve process took a request.

``python -m bench.event_loop [--pairs 200] [--json FILE]``
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import tempfile
from pathlib import Path
from typing import Any

import aiohttp

from bench.harness import chat, client_session, conversation
from bench.layer_cost import cpu_seconds, plain_one, strata_process

LOOPS = ("asyncio", "uvloop")
#: kind: (streamed?, tokens, a kept connection?, pairs as a share of --pairs)
KINDS = {
    "1-token, JSON, new connection": (False, 1, False, 1.0),
    "1-token, JSON, kept connection": (False, 1, True, 1.0),
    "1-token, streamed, new connection": (True, 1, False, 1.0),
    "150 tokens, streamed": (True, 150, False, 0.2),
}


async def _one(session: aiohttp.ClientSession, url: str, messages: list[dict], stream: bool, tokens: int) -> float:
    if stream:
        return (await chat(session, url, messages, max_tokens=tokens, ignore_eos=True)).total_s
    return (await plain_one(session, url, messages))[0]  # one token


async def measure(model: Path, work: Path, pairs: int) -> dict[str, Any]:
    found: dict[str, Any] = {}
    async with contextlib.AsyncExitStack() as stack:
        servers = {}
        for loop in LOOPS:
            (work / loop).mkdir()
            url, _, pid = await stack.enter_async_context(
                strata_process(model, work / loop, extra_env={"STRATA_SERVER__EVENT_LOOP": loop}))
            runs_uvloop = "uvloop" in Path(f"/proc/{pid}/maps").read_text()
            if runs_uvloop != (loop == "uvloop"):
                raise RuntimeError(f"the strata-serve asked to run on {loop} runs on another loop")
            servers[loop] = (url, pid)
        new = await stack.enter_async_context(client_session())  # a connection a request
        kept = await stack.enter_async_context(aiohttp.ClientSession())
        messages = conversation("loops", 60)
        for url, _ in servers.values():
            for _ in range(5):
                await _one(kept, url, messages, False, 1)  # warm: the prompt cached, a connection kept
        for kind, (stream, tokens, keep, share) in KINDS.items():
            session = kept if keep else new
            times: dict[str, list[float]] = {loop: [] for loop in LOOPS}
            cpu = dict.fromkeys(LOOPS, 0.0)
            for n in range(max(4, int(pairs * share))):
                for loop in (LOOPS if n % 2 == 0 else LOOPS[::-1]):
                    url, pid = servers[loop]
                    before = cpu_seconds(pid)
                    times[loop].append(await _one(session, url, messages, stream, tokens))
                    cpu[loop] += cpu_seconds(pid) - before
            count = len(times[LOOPS[0]])
            found[kind] = {
                "p50_ms": {loop: statistics.median(t) * 1000 for loop, t in times.items()},
                "paired_ms": statistics.median(b - a for a, b in zip(times["asyncio"], times["uvloop"])) * 1000,
                "cpu_ms": {loop: cpu[loop] / count * 1000 for loop in LOOPS},
                "pairs": count,
            }
            print(_row(kind, found[kind]), flush=True)
    return found


def _row(kind: str, v: dict[str, Any]) -> str:
    return (f"| {kind} | {v['pairs']} | {v['p50_ms']['asyncio']:.2f} | {v['p50_ms']['uvloop']:.2f} | "
            f"{v['paired_ms']:+.2f} | {v['cpu_ms']['asyncio']:.2f} | {v['cpu_ms']['uvloop']:.2f} |")


HEADER = ("| request | pairs | p50 ms, asyncio | p50 ms, uvloop | uvloop - asyncio, median of pairs, ms "
          "| layer CPU ms a request, asyncio | layer CPU ms a request, uvloop |\n|---|---|---|---|---|---|---|")


def cli() -> None:
    from strata_serve.models import resolve_model

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=200)
    parser.add_argument("--json", type=Path, help="write the figures here")
    options = parser.parse_args()
    model = resolve_model("smollm2")
    if model is None:
        raise SystemExit("the packaged SmolLM2 model is not installed: make setup installs it")
    print(HEADER, flush=True)
    with tempfile.TemporaryDirectory(prefix="strata-loops-") as tmp:
        found = asyncio.run(measure(Path(model), Path(tmp), options.pairs))
    if options.json:
        options.json.write_text(json.dumps(found, indent=1))


if __name__ == "__main__":
    cli()
