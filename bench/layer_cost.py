"""What the layer costs, measured against the very engine strata-serve started.

strata-serve runs as its own process (``strata-serve run``, as a user starts it), so
its CPU time can be read apart from the client's and the engine's. It is told the
engine's port and key, so the benchmark can also talk to that same engine directly.
Each measurement alternates direct and through strata-serve, in one run: on a
machine this noisy, only figures taken side by side compare.

``python -m bench.layer_cost [--quick] [--model PATH]`` prints the figures.
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
from pathlib import Path
from typing import Any
from collections.abc import AsyncIterator, Callable

import aiohttp

from bench.harness import chat, client_session, conversation, paired_ratio, percentile
from strata_serve.engine.llama_server import free_port
from strata_serve.timing import read_server_timing

BENCH_KEY = "strata-bench"
#: A version of strata-serve to run: its source tree (None: this one) and environment.
Version = tuple[Path | None, dict[str, str]]
_TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """CPU time of one process, all its threads (not its children), from /proc.

    The scheduler's own count (``schedstat``, in nanoseconds) where the kernel keeps it:
    ``stat``'s user and system times are sampled at each clock tick, too coarse for a
    few milliseconds.
    """
    try:
        return sum(int((task / "schedstat").read_text().split()[0])
                   for task in Path(f"/proc/{pid}/task").iterdir()) / 1e9
    except (OSError, ValueError, IndexError):
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / _TICK  # utime, stime (fields 14 and 15)


@contextlib.asynccontextmanager
async def strata_process(model: Path, work: Path, ctx: int = 4096, plugins: dict[str, Any] | None = None,
                         source: Path | None = None, extra_env: dict[str, str] | None = None,
                         engine: dict[str, Any] | None = None) -> AsyncIterator[tuple[str, str, int]]:
    """``strata-serve run`` in its own process; yields (its URL, its engine's URL, its pid).

    ``engine``: engine settings over the benchmark's own (e.g. ``side_slot_tokens``, to run
    an earlier version with today's defaults)."""
    port, engine_port = free_port("127.0.0.1"), free_port("127.0.0.1")
    config = work / "layer-cost.json"
    config.write_text(json.dumps({
        "server": {"port": port, "queue_limit": 256},
        "engine": {"model": str(model), "ctx_size": ctx, "port": engine_port, "api_key": BENCH_KEY,
                   "slot_save_path": str(work / "slots"), "log_level": "DEBUG", **(engine or {})},
        "plugins": plugins or {"auto_sessions": {"min_tokens": 100}},
    }))
    log = open(work / "layer-cost.log", "wb")
    env = {**os.environ, **(extra_env or {})}
    if source is not None:  # another version of strata-serve, e.g. to compare with
        # its core and its bundled plugins (installed editable from this checkout otherwise)
        plugins = [str(p.parent) for p in sorted(source.glob("plugins/*/pyproject.toml"))]
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(source), *plugins, env.get("PYTHONPATH")]))
    # Run from the work directory: ``python -m`` puts its directory first on the path, and
    # from a checkout that would be the checkout's strata_serve whatever ``source`` says.
    proc = subprocess.Popen([sys.executable, "-m", "strata_serve.cli", "run", "--config", str(config),
                             "--log-level", "WARNING"], stdout=log, stderr=subprocess.STDOUT, env=env, cwd=work)
    url = f"http://127.0.0.1:{port}"
    try:
        await until_answering(proc, "strata-serve", lambda session: session.get(url + "/health"), 300,
                              work / "layer-cost.log")
        yield url, f"http://127.0.0.1:{engine_port}", proc.pid
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


async def until_answering(proc: subprocess.Popen, name: str,
                          ask: Callable[[aiohttp.ClientSession], Any], timeout_s: float, log: Path) -> None:
    """Poll ``ask`` until it answers 200; fail if ``proc`` exits or ``timeout_s`` passes."""
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as session:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited with {proc.returncode}: {log.read_text()[-2000:]}")
            with contextlib.suppress(aiohttp.ClientError):
                async with ask(session) as resp:
                    if resp.status == 200:
                        return
            if time.monotonic() > deadline:
                raise RuntimeError(f"{name} did not answer in {timeout_s:g} s")
            await asyncio.sleep(0.1)


async def _one(session: aiohttp.ClientSession, url: str, messages: list[dict], stream: bool) -> float:
    if stream:
        return (await chat(session, url, messages)).total_s
    return (await plain_one(session, url, messages))[0]


async def plain_one(session: aiohttp.ClientSession, url: str, messages: list[dict]) -> tuple[float, dict[str, float]]:
    """A plain 1-token request: its time (s), and the spans its ``Server-Timing`` names (ms)."""
    began = time.perf_counter()
    body = {"messages": messages, "max_tokens": 1, "temperature": 0}
    async with session.post(url + "/v1/chat/completions", json=body) as resp:
        await resp.read()
        if resp.status != 200:
            raise RuntimeError(f"{url}: HTTP {resp.status}")
        timing = resp.headers.get("Server-Timing", "")
    took = time.perf_counter() - began
    return took, read_server_timing(timing)


async def layer_cost(model: Path, work: Path, requests: int = 200, blocks: int = 5, streams: int = 6,
                     stream_tokens: int = 256, concurrency: int = 8, source: Path | None = None,
                     extra_env: dict[str, str] | None = None) -> dict[str, Any]:
    """Added latency, 8-client requests/s, streaming speed and CPU per token, interleaved."""
    messages = conversation("latency", 64)
    found: dict[str, Any] = {}
    async with strata_process(model, work, source=source, extra_env=extra_env) as (strata_url, engine_url, pid), \
            client_session() as session:
        urls = {"engine": engine_url, "strata": strata_url}
        for url in urls.values():
            await chat(session, url, messages)  # warm: the prompt is cached from here on
        for stream in (True, False):
            times: dict[str, list[float]] = {"engine": [], "strata": []}
            cpu = 0.0
            for n in range(requests):
                for name in (("engine", "strata") if n % 2 else ("strata", "engine")):
                    before = cpu_seconds(pid)
                    times[name].append(await _one(session, urls[name], messages, stream))
                    if name == "strata":
                        cpu += cpu_seconds(pid) - before
            kind = "stream" if stream else "json"
            found[f"{kind}_cpu_ms_per_request"] = cpu / requests * 1000
            for pct in (50, 95):
                found[f"{kind}_p{pct}_ms"] = {name: percentile(t, pct) * 1000 for name, t in times.items()}
                found[f"{kind}_added_p{pct}_ms"] = (found[f"{kind}_p{pct}_ms"]["strata"]
                                                   - found[f"{kind}_p{pct}_ms"]["engine"])
            # The spread: the same figure over each fifth of the requests.
            step = max(1, requests // 5)
            found[f"{kind}_added_p50_ms_blocks"] = [
                (percentile(times["strata"][i:i + step], 50) - percentile(times["engine"][i:i + step], 50)) * 1000
                for i in range(0, requests - step + 1, step)]

        async def client(url: str) -> None:
            for _ in range(max(1, requests // concurrency)):
                await chat(session, url, messages)

        rps: dict[str, list[float]] = {"engine": [], "strata": []}
        for n in range(blocks):
            for name in (("engine", "strata") if n % 2 else ("strata", "engine")):
                began = time.perf_counter()
                await asyncio.gather(*(client(urls[name]) for _ in range(concurrency)))
                rps[name].append(concurrency * max(1, requests // concurrency) / (time.perf_counter() - began))
        found["rps_8"] = rps
        found["rps_8_ratio"] = paired_ratio(rps["strata"], rps["engine"])  # each pair ran in turn

        tps: dict[str, list[float]] = {"engine": [], "strata": []}
        engine_tps: dict[str, list[float]] = {"engine": [], "strata": []}
        cpu, tokens = 0.0, 0
        for n in range(streams):
            for name in (("engine", "strata") if n % 2 else ("strata", "engine")):
                before = cpu_seconds(pid)
                reply = await chat(session, urls[name], messages, max_tokens=stream_tokens, ignore_eos=True)
                predicted = reply.timings.get("predicted_n", 0)
                # Over the whole call (the prompt is cached): the time of the first token
                # says little once a relay forwards several tokens in one write.
                tps[name].append(predicted / reply.total_s)
                engine_tps[name].append(reply.timings.get("predicted_per_second", 0.0))
                if name == "strata":
                    cpu += cpu_seconds(pid) - before
                    tokens += predicted
        found["stream_tps"] = tps
        found["stream_ratio"] = paired_ratio(tps["strata"], tps["engine"])  # each pair ran in turn
        found["stream_ratios"] = [s / e for s, e in zip(tps["strata"], tps["engine"])]
        found["engine_tps"] = engine_tps  # as the engine timed its own work, either way
        found["cpu_s_per_1000_tokens"] = cpu / tokens * 1000 if tokens else None
    return found


def sizes(model: str, quick: bool) -> dict[str, int]:
    """How much to measure: the tiny model answers in milliseconds, SmolLM2 at about 75 tokens/s."""
    if quick:
        return {"requests": 40, "blocks": 3, "streams": 2, "stream_tokens": 64}
    if model == "tiny":
        return {"requests": 200, "blocks": 5, "streams": 8, "stream_tokens": 512}
    return {"requests": 40, "blocks": 3, "streams": 4, "stream_tokens": 128}


def summary(name: str, v: dict[str, Any]) -> list[str]:
    """Markdown lines for one model's figures."""
    def blocks(kind: str) -> str:
        values = v.get(f"{kind}_added_p50_ms_blocks")
        return f" ({min(values):.2f}-{max(values):.2f})" if values and len(values) > 1 else ""

    def ratios(values: list[float] | None, digits: int) -> str:
        return f", {min(values):.{digits}f}-{max(values):.{digits}f}" if values and len(values) > 1 else ""

    rps = [s / e for s, e in zip(v["rps_8"]["strata"], v["rps_8"]["engine"])]
    lines = [f"| {name} | {v['stream_added_p50_ms']:.2f}{blocks('stream')} | {v['stream_added_p95_ms']:.2f} | "
             f"{v['json_added_p50_ms']:.2f}{blocks('json')} | {v['json_added_p95_ms']:.2f} | "
             f"{v['rps_8_ratio']:.2f} ({statistics.median(v['rps_8']['strata']):.0f} / "
             f"{statistics.median(v['rps_8']['engine']):.0f}{ratios(rps, 2)}) | "
             f"{v['stream_ratio']:.3f} ({statistics.median(v['stream_tps']['strata']):.0f} / "
             f"{statistics.median(v['stream_tps']['engine']):.0f}{ratios(v.get('stream_ratios'), 3)}) | "
             f"{v['cpu_s_per_1000_tokens']:.3f} | {v['stream_cpu_ms_per_request']:.2f} / "
             f"{v['json_cpu_ms_per_request']:.2f} |"]
    return lines


HEADER = [
    "| model | added p50 ms, stream | added p95 ms, stream | added p50 ms, JSON | added p95 ms, JSON "
    "| req/s ratio, 8 clients (strata / engine) | stream tokens/s ratio (strata / engine) "
    "| layer CPU s per 1,000 streamed tokens | layer CPU ms per request (stream / JSON) |",
    "|---|---|---|---|---|---|---|---|---|",
]


async def main(quick: bool, models: dict[str, Path], versions: dict[str, Version],
               rounds: int = 1) -> dict[str, Any]:
    """Each model, each version of strata-serve in turn, ``rounds`` times over."""
    results: dict[str, Any] = {}
    print("\n".join(HEADER), flush=True)
    for name, model in models.items():
        for round_ in range(rounds):
            for version, (source, extra_env) in versions.items():
                with tempfile.TemporaryDirectory(prefix="strata-layer-") as tmp:
                    found = await layer_cost(model, Path(tmp), **sizes(name, quick), source=source,
                                             extra_env=extra_env)
                results.setdefault(name, {}).setdefault(version, []).append(found)
                label = f"{name}, {version}" + (f", round {round_ + 1}" if rounds > 1 else "")
                print("\n".join(summary(label, found)), flush=True)
    return results


def cli() -> None:
    from strata_serve.demo_model import write_demo_model
    from strata_serve.models import packaged_model_path

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--smollm2", action="store_true", help="also the packaged SmolLM2 model")
    parser.add_argument("--compare", action="append", default=[], metavar="NAME=[DIR][:VAR=VALUE...]",
                        help="also run the strata_serve package found in DIR (e.g. an older version; "
                             "none: this one), with these environment variables")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--json", type=Path, help="write the raw figures here")
    args = parser.parse_args()
    versions: dict[str, Version] = {"this": (None, {})}
    for item in args.compare:
        name, spec = item.split("=", 1)
        source, *assignments = spec.split(":")
        versions[name] = (Path(source) if source else None, dict(a.split("=", 1) for a in assignments))
    with tempfile.TemporaryDirectory(prefix="strata-layer-model-") as tmp:
        models = {"tiny": write_demo_model(Path(tmp) / "tiny.gguf", size="tiny")}
        smollm2 = packaged_model_path("smollm2")
        if args.smollm2 and smollm2 is not None:
            models["smollm2"] = Path(smollm2)
        results = asyncio.run(main(args.quick, models, versions, args.rounds))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    cli()
