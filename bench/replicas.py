"""Several servers sharing parked conversations: ``python -m bench.replicas``
(``make bench-replicas``; ``make bench`` runs it too).

Two strata-serve replicas, each with its own llama-server on the bench model and its own
slot directory, behind HAProxy with the configuration docs/several-servers.md shows
(tests/replicas.py starts them), three times: with no shared tier, with a shared
directory, and with S3 (moto's standalone server, in a process of its own on loopback).
Each time, a conversation of a few thousand tokens is answered by one replica and
saved; that replica is killed (``kill -9``), and the conversation's next turn, sent
through the balancer, is answered by the other. Measured: that turn's time to first
token and total time, the engine's ``prompt_n`` (tokens read) and ``cache_n`` (tokens
reused), and the bytes moved (uploaded by the lost replica, fetched by the other).
Without a shared tier, that turn is the same turn re-read on a server that never saw
the conversation.

Then fetch throughput from each tier on this machine: one file, put once and fetched
several times through the tier's own client (the one the servers use).

Writes ``bench/results/several-servers.md`` (the tables, and the raw figures as JSON).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import aiohttp

from bench.harness import chat, conversation, follow_up, spread
from strata_auto_sessions.shared import DirectoryTier, S3Tier, SharedTier
from strata_serve.demo_model import write_demo_model
from tests.ports import listen_port
from tests.replicas import Replicas

RESULTS = Path(__file__).resolve().parent / "results"
#: The engines' context, and the conversation's length in tokens (one per character).
CTX = 8192
TOKENS = 4000
QUICK_TOKENS = 1024
TIERS = ("none", "directory", "s3")
TIER_NAMES = {"none": "none (the same turn re-read)", "directory": "a shared directory",
              "s3": "S3 (moto, loopback)"}
#: The header the conversation's client sends: the balancer hashes on it.
HEADER = "X-Claude-Code-Session-Id"
S3_ENV = {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1"}
#: Each wait's deadline.
WAIT_S = 120.0
MB = 1e6


@dataclass
class Turn:
    ttft_s: float
    total_s: float
    prompt_n: int
    cache_n: int
    state: str
    replica: str
    text: str


async def turn(url: str, messages: list[dict], session_id: str) -> Turn:
    """One streamed greedy turn through the balancer."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        reply = await chat(session, url, messages, max_tokens=4, headers={HEADER: session_id})
    timings, headers = reply.timings, reply.headers
    return Turn(reply.ttft_s, reply.total_s, timings.get("prompt_n", 0), timings.get("cache_n", 0),
                headers.get("X-Strata-State", "?"), headers.get("X-Strata-Replica", "?"), reply.text)


@contextlib.contextmanager
def s3_server() -> Any:
    """moto's standalone S3 server in a process of its own: its endpoint; the usual AWS
    variables point at it for the replicas started meanwhile."""
    port = listen_port()
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    endpoint = f"http://127.0.0.1:{port}"
    saved = {name: os.environ.get(name) for name in [*S3_ENV, "AWS_ENDPOINT_URL"]}
    os.environ.update({**S3_ENV, "AWS_ENDPOINT_URL": endpoint})
    try:
        yield endpoint
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        proc.terminate()
        proc.wait(10)


async def new_bucket(endpoint: str) -> str:
    from aiobotocore.session import get_session

    bucket = f"bench-{uuid.uuid4().hex[:12]}"
    deadline = time.monotonic() + 30
    async with get_session().create_client("s3", endpoint_url=endpoint, region_name="us-east-1",
                                           aws_access_key_id="bench", aws_secret_access_key="bench") as client:
        while True:  # the server may still be starting
            try:
                await client.create_bucket(Bucket=bucket)
                return bucket
            except Exception:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.2)


@contextlib.asynccontextmanager
async def open_tier(kind: str, work: Path, endpoint: str | None) -> AsyncIterator[tuple[str | None, SharedTier | None]]:
    """The tier's URL for the replicas, and a handle of the bench's own on it."""
    if kind == "none":
        yield None, None
        return
    tier: SharedTier
    if kind == "directory":
        root = work / f"shared-{uuid.uuid4().hex[:6]}"
        root.mkdir(parents=True)
        url, tier = f"file://{root}", DirectoryTier(root)
    else:
        assert endpoint is not None
        bucket = await new_bucket(endpoint)
        url, tier = f"s3://{bucket}/strata", S3Tier(bucket, "strata", endpoint_url=endpoint)
    try:
        yield url, tier
    finally:
        await tier.close()


async def parking(replicas: Replicas, name: str) -> dict[str, Any]:
    return (await replicas.stats(name))["plugins"]["auto_sessions"]


async def until(what: str, check: Any) -> Any:
    deadline = time.monotonic() + WAIT_S
    while True:
        found = await check()
        if found:
            return found
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what}: not within {WAIT_S:g} s")
        await asyncio.sleep(0.1)


async def failovers(kind: str, model: Path, work: Path, tokens: int, repeats: int,
                    endpoint: str | None) -> list[dict[str, Any]]:
    """``repeats`` failovers with the shared tier ``kind``: each a conversation of
    ``tokens`` answered and saved by one replica, that replica killed, and the next turn."""
    found = []
    async with open_tier(kind, work, endpoint) as (url, _tier):
        parked: dict[str, Any] = {"idle_save_s": 0.5, "min_tokens": 256}
        if url is not None:
            parked["shared"] = {"url": url, "retry_s": 1}
        config = {"engine": {"ctx_size": CTX}, "plugins": {"auto_sessions": parked}}
        async with Replicas(work / f"replicas-{kind}", model, count=2, config=config) as replicas:
            for n in range(repeats):
                session_id = f"voyage-{kind}-{n}"
                messages = conversation(f"Voyage {n} of {kind}", tokens)
                first = await turn(replicas.url, messages, session_id)
                holder = first.replica
                other = next(name for name in replicas.names if name != holder)
                before = await parking(replicas, holder)

                async def saved(before: dict[str, Any] = before, holder: str = holder) -> dict[str, Any] | None:
                    now = await parking(replicas, holder)
                    done = now["saves"] > before["saves"] and (
                        url is None or now["shared_uploads"] > before["shared_uploads"])
                    return now if done else None

                # The state the lost replica leaves is saved, and uploaded, before it dies.
                held = await until(f"{holder} saved the conversation", saved)
                taking = await parking(replicas, other)
                await replicas.kill(holder)
                await replicas.wait_for_state(holder, "DOWN")
                after = await turn(replicas.url, follow_up(messages, first.text), session_id)
                took = await parking(replicas, other)
                assert after.replica == other, (after.replica, other)
                found.append({
                    "first": asdict(first), "after": asdict(after),
                    "saved_bytes": held["saved_bytes"] - before["saved_bytes"],
                    "uploaded_bytes": held["shared_uploaded_bytes"] - before["shared_uploaded_bytes"],
                    "upload_ms": held["shared_upload_ms"] - before["shared_upload_ms"],
                    "fetched_bytes": took["shared_fetched_bytes"] - taking["shared_fetched_bytes"],
                    "fetch_ms": took["shared_fetch_ms"] - taking["shared_fetch_ms"],
                    "restore_ms": took["restore_ms"] - taking["restore_ms"],
                })
                print(f"[bench] {kind}: failover turn {after.ttft_s:.2f} s to first token, read {after.prompt_n}, "
                      f"reused {after.cache_n} ({after.state})", flush=True)
                await replicas.restart(holder)
                await replicas.wait_for_state(holder, "UP")
    return found


async def throughput(kind: str, work: Path, endpoint: str | None, size_mb: int, runs: int) -> dict[str, Any]:
    """MB/s of one put and ``runs`` fetches of a ``size_mb`` file through the tier."""
    source = work / "throughput.bin"
    if not source.exists() or source.stat().st_size != size_mb * 1024 * 1024:
        with open(source, "wb") as handle:
            for _ in range(size_mb):
                handle.write(os.urandom(1024 * 1024))
    async with open_tier(kind, work, endpoint) as (_url, tier):
        assert tier is not None
        began = time.perf_counter()
        await tier.put("bench.bin", source)
        put_s = time.perf_counter() - began
        fetches = []
        for n in range(runs):
            target = work / f"fetched-{n}.bin"
            began = time.perf_counter()
            got = await tier.fetch("bench.bin", target)
            fetches.append(time.perf_counter() - began)
            assert got == source.stat().st_size
            target.unlink()
    size = source.stat().st_size / MB
    return {"mb": size, "put_mbps": size / put_s, "fetch_mbps": [size / s for s in fetches]}


async def measure(model: Path, work: Path, quick: bool = False) -> dict[str, Any]:
    """Every figure of the report, from one run."""
    tokens, repeats, size_mb, runs = (QUICK_TOKENS, 1, 32, 2) if quick else (TOKENS, 3, 256, 3)
    results: dict[str, Any] = {"tokens": tokens, "ctx": CTX, "failover": {}, "throughput": {}}
    with s3_server() as endpoint:
        for kind in TIERS:
            results["failover"][kind] = await failovers(kind, model, work, tokens, repeats, endpoint)
        for kind in TIERS[1:]:
            results["throughput"][kind] = await throughput(kind, work, endpoint, size_mb, runs)
    return results


def _median(rows: list[dict[str, Any]], *path: str) -> float:
    values = []
    for row in rows:
        value: Any = row
        for step in path:
            value = value[step]
        values.append(value)
    return statistics.median(values)


def report(results: dict[str, Any]) -> list[str]:
    """The tables, as Markdown lines (a section of bench/run.py's README too)."""
    failover = results["failover"]
    runs = len(next(iter(failover.values())))
    lines = [
        f"## Several servers: the turn after a failover ({results['tokens']:,}-token conversation, bench model)",
        "",
        "Two replicas behind HAProxy (docs/several-servers.md's configuration), each with its own engine "
        f"(context {results['ctx']:,}) and slot directory. A conversation is answered and saved by one; that "
        "replica is killed (`kill -9`) and the next turn goes to the other. Without a shared tier, that turn is "
        "read again in full; with one, the other replica fetches the state the lost one uploaded and restores it. "
        f"Medians with (min-max) over {runs} failover(s); times through the balancer, streamed.",
        "",
        "| shared tier | time to first token, s | total, s | tokens read (prompt_n) | tokens reused (cache_n) | "
        "X-Strata-State | state file, MB | uploaded by the lost replica, MB | upload, ms (in the background) | "
        "fetched by the other, MB | fetch, ms | restore, ms |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for kind, rows in failover.items():
        after = [row["after"] for row in rows]
        lines.append(
            f"| {TIER_NAMES[kind]} | {spread([a['ttft_s'] for a in after], 2)} | "
            f"{spread([a['total_s'] for a in after], 2)} | {spread([a['prompt_n'] for a in after], 0)} | "
            f"{spread([a['cache_n'] for a in after], 0)} | {'/'.join(sorted({a['state'] for a in after}))} | "
            f"{_median(rows, 'saved_bytes') / MB:.1f} | {_median(rows, 'uploaded_bytes') / MB:.1f} | "
            + (f"{spread([row['upload_ms'] for row in rows], 0)} | " if kind != "none" else "- | ")
            + f"{_median(rows, 'fetched_bytes') / MB:.1f} | "
            + (f"{spread([row['fetch_ms'] for row in rows], 0)} | {spread([row['restore_ms'] for row in rows], 0)} |"
               if kind != "none" else "- | - |"))
    base = statistics.median(row["after"]["ttft_s"] for row in failover["none"])
    for kind in TIERS[1:]:
        if kind in failover:
            ttft = statistics.median(row["after"]["ttft_s"] for row in failover[kind])
            lines.append("")
            lines.append(f"With {TIER_NAMES[kind]}, the turn after a failover came {base / ttft:.1f}x sooner than "
                         "re-read on a server without the shared tier.")
    first = [row["first"]["ttft_s"] for rows in failover.values() for row in rows]
    lines += ["", f"For scale: the conversation's first turn (read in full, no failover) took {spread(first, 2)} s "
                  "to its first token.", ""]
    lines += [
        "### Fetch throughput from each tier on this machine",
        "",
        "One file put once, then fetched into a slot directory through the tier's own client (the one the "
        "servers use): a directory on this machine's disk, and moto's S3 server on loopback (in a process of "
        "its own; the bucket lives in its memory).",
        "",
        "| tier | file, MB | put, MB/s | fetch, MB/s |",
        "|---|---|---|---|",
    ]
    for kind, found in results["throughput"].items():
        lines.append(f"| {TIER_NAMES[kind]} | {found['mb']:.0f} | {found['put_mbps']:.0f} | "
                     f"{spread(found['fetch_mbps'], 0)} |")
    return lines


def document(results: dict[str, Any], command: str) -> str:
    from bench.run import machine

    return "\n".join([
        "# Several servers: what sharing parked conversations costs", "",
        f"Made by `{command}` on {time.strftime('%Y-%m-%d')}; machine: {machine()}. One run on a machine shared "
        "with other work: read the times as a rough guide, the tokens and bytes as exact.", "",
        *report(results), "", "Raw figures:", "", "```json", json.dumps(results, indent=1), "```", ""])


async def main(out: Path, quick: bool) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="strata-bench-replicas-") as tmp:
        work = Path(tmp)
        model = write_demo_model(work / "bench.gguf", size="bench")
        results = await measure(model, work, quick)
    out.write_text(document(results, "make bench-replicas" if not quick else "python -m bench.replicas --quick"))
    print(out.read_text())
    return results


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a short conversation, one failover per tier")
    parser.add_argument("--out", type=Path, default=RESULTS / "several-servers.md")
    args = parser.parse_args()
    asyncio.run(main(args.out, args.quick))
