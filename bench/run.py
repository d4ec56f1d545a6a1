"""Run the benchmarks and write ``bench/results/README.md``: ``python -m bench.run [--quick]``.

Every figure is measured in the same run as the thing it is compared with, and
reported as a ratio next to it: these machines are too noisy for absolute times
to mean much from one run to the next.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import tempfile
import time
from pathlib import Path
from typing import Any


from bench import agent_sim, engine_alone, prefix, profile, readme, replicas, switchback, workloads
from bench.harness import bare_engine, chat, client_session, conversation, spread, strata
from bench.layer_cost import HEADER as LAYER_HEADER, layer_cost, sizes as layer_sizes, summary as layer_summary
from strata_serve.demo_model import write_demo_model
from strata_serve.engine import LlamaServer
from strata_serve.config import EngineSettings
from strata_serve.models import packaged_model_path

RESULTS = Path(__file__).resolve().parent / "results"


async def engine_start(models: dict[str, Path], runs: int) -> dict[str, list[float]]:
    """Seconds from spawning llama-server to a healthy /health, per model."""
    found: dict[str, list[float]] = {}
    for size, model in models.items():
        for _ in range(runs):
            engine = LlamaServer(EngineSettings(model=model, ctx_size=4096, log_level="DEBUG"))
            await engine.start()
            found.setdefault(size, []).append(engine.start_seconds or 0.0)
            await engine.stop()
    return found


    return found


async def save_restore_speed(model: Path, work: Path, size: int) -> dict[str, Any]:
    """Slot save/restore MB/s through strata-serve's /slots and the engine's own API, and the disk's."""
    from bench.harness import disk_speed

    found: dict[str, Any] = {}
    messages = conversation("Speed", size)
    for name, make in {
        "llama-server slot API": lambda d: bare_engine(model, size + 512, d, 0),
        "through strata-serve /slots": lambda d: strata(model, size + 512, d, 0,
                                                        plugins={"auto_sessions": {"enabled": False}}),
    }.items():
        slot_dir = work / ("speed-" + name.split()[0])
        async with make(slot_dir) as url, client_session() as session:
            await chat(session, url, messages)
            saves, restores, size_mb = [], [], 0.0
            for n in range(3):
                began = time.perf_counter()
                async with session.post(url + "/slots/0?action=save", json={"filename": f"s{n}.bin"}) as r:
                    assert r.status == 200, await r.text()
                saves.append(time.perf_counter() - began)
                size_mb = (slot_dir / f"s{n}.bin").stat().st_size / 1e6
                began = time.perf_counter()
                async with session.post(url + "/slots/0?action=restore", json={"filename": f"s{n}.bin"}) as r:
                    assert r.status == 200, await r.text()
                restores.append(time.perf_counter() - began)
        found[name] = {"mb": size_mb, "save_mbps": [size_mb / s for s in saves],
                       "restore_mbps": [size_mb / s for s in restores]}
    write, read = await disk_speed(work)
    found["disk"] = {"write_mbps": write, "read_mbps": read}
    return found


def machine() -> str:
    cpu = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{platform.system()} {platform.machine()}, {os.cpu_count()} cores, {cpu}"


def report(results: dict[str, Any], quick: bool, command: str) -> str:
    lines = [
        "# Benchmark results",
        "",
        f"Made by `{command}` on {results['date']}; machine: {results['machine']}.",
        "Models: the project's random-weight demo models (`strata-serve demo-model --size tiny|bench`);",
        "the text they write is meaningless, the work the engine does for them is real; the agent workload",
        "runs on SmolLM2-135M-Instruct Q4_1 (a real model) as well.",
        "Figures are medians with (min-max) over the repetitions in this one run.",
        "",
        "## Engine start (spawn to healthy)",
        "",
        "| model | seconds |",
        "|---|---|",
    ]
    for size, values in results["engine_start"].items():
        lines.append(f"| {size} | {spread(values)} |")
    lines += [
        "",
        "## What the layer costs: strata-serve against the very engine it started",
        "",
        "`strata-serve run` in its own process (installed plugins), told its engine's port and key; each",
        "figure alternates a request straight to that engine with one through strata-serve. A cached",
        "64-token prompt and 1 new token per request; 8 clients share one connection pool; streams of",
        f"{results['overhead_sizes']['stream_tokens']} tokens on the tiny model"
        + (f" and {layer_sizes('smollm2', False)['stream_tokens']} on SmolLM2" if "smollm2" in results["overhead"]
           else "") + " (tokens/s over the whole call). The "
        "layer's CPU is its own process's (user + system), read from /proc. In brackets: the added p50 over "
        "each fifth of the requests (lowest-highest), and the lowest-highest ratio of the interleaved pairs.",
        "",
        *LAYER_HEADER,
    ]
    for name, v in results["overhead"].items():
        lines += layer_summary(name, v)
    if results.get("profile"):
        lines += profile.report(results["profile"])
    lines.append("")

    lines += switchback.report(results["switch_back"])
    if results.get("plot"):
        lines += ["", f"![switch-back time and file size against context length]({results['plot']})"]
    for found in results["agents"]:
        lines += workloads.report(found, found["model"])
    if results.get("alone"):
        lines += engine_alone.report(results["alone"], results["alone"]["model"])
    if results.get("agent_sim"):
        lines += agent_sim.report(results["agent_sim"])
    elif not quick:
        lines += ["", "## A third-party agent benchmark: cache-pressure agent-sim", "",
                  f"Not run: agent-sim is not installed in {agent_sim.VENV} (`make bench` installs it)."]
    lines += prefix.report(results["prefix"], spread)
    speed = results["save_restore"]
    lines += [
        "",
        f"## Slot save and restore throughput ({speed['llama-server slot API']['mb']:.0f} MB state, bench model)",
        "",
        "| path | save MB/s | restore MB/s |",
        "|---|---|---|",
    ]
    for name in ("llama-server slot API", "through strata-serve /slots"):
        v = speed[name]
        lines.append(f"| {name} | {spread(v['save_mbps'], 0)} | {spread(v['restore_mbps'], 0)} |")
    lines.append(f"| the disk, sequential (write with fsync / read) | {speed['disk']['write_mbps']:.0f} | "
                 f"{speed['disk']['read_mbps']:.0f} |")
    if results.get("replicas"):
        lines += ["", *replicas.report(results["replicas"])]
    lines += readme.report(results)
    if results.get("seconds"):
        taken = results["seconds"]
        lines += ["", f"The run took {taken['total'] / 60:.1f} minutes (" + ", ".join(
            f"{name} {s:.0f} s" for name, s in taken["sections"].items()) + "); load average (1, 5, 15 min) at the "
            f"end: {', '.join(f'{x:.1f}' for x in taken['load_average'])}."]
    lines += ["", "Raw figures: `results.json` beside this file (not committed).", ""]
    if quick:
        lines.insert(2, "**Quick mode**: small sizes and few repetitions; run `make bench` for the full table.\n")
    return "\n".join(lines)


#: A full run takes about 25 minutes on 2 cores: 4096 tokens is left out of the switch-back
#: table, and the RAM-cache-on setups stop at 2048 (the agents compare every RAM setting).
FULL_SIZES = [2048, 8192, 12288]

#: The agent workloads: the bench model with and without a shared system prompt, and a
#: smaller one on SmolLM2 (about 5x slower to read a prompt here).
AGENT_PLANS = {
    "quick": [
        {"model": "tiny", "name": "tiny model", "args": {
            "label": "tiny", "repeats": 1, "limited_mib": 1, "min_tokens": 100,
            "only": ["bare-default", "bare-off", "bare-np4", "strata-off", "strata-np4", "hearth"],
            "shape": workloads.Workload(steps=2, opening=192, grow=32, sub=48, side=16, stall_s=10)}},
    ],
    "full": [
        {"model": "bench", "name": "bench model", "args": {
            "label": "bench", "repeats": 3, "limited_mib": 16, "min_tokens": 256,
            "shape": workloads.Workload(steps=4, opening=384, grow=64, sub=128, side=16, stall_s=30),
            "variants": {
                "separate conversations": workloads.Workload(steps=4, opening=384, grow=64, sub=128, side=16,
                                                             stall_s=30),
                "a shared system prompt": workloads.Workload(steps=4, opening=64, grow=64, sub=128, side=16,
                                                             system_prompt=512, stall_s=30),
            }}},
        {"model": "smollm2", "name": "SmolLM2-135M", "args": {
            "label": "smollm2", "repeats": 3, "limited_mib": 8, "min_tokens": 128,
            "only": ["bare-default", "bare-limited", "bare-off", "bare-np4", "strata-default", "strata-limited",
                     "strata-off", "strata-np4", "hearth"],
            "shape": workloads.Workload(steps=2, opening=192, grow=32, sub=64, side=16, real=True)}},
    ],
}


#: Rounds of the agent-sim comparison (four systems, about 2-3 minutes a run).
AGENT_SIM_ROUNDS = 2


def _made(directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    return directory


async def main(quick: bool, out: Path, sizes: list[int] | None = None, command: str | None = None) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="strata-bench-") as tmp:
        work = Path(tmp)
        tiny = write_demo_model(work / "tiny.gguf", size="tiny")
        bench_model = write_demo_model(work / "bench.gguf", size="bench")
        began = last = time.perf_counter()
        seconds: dict[str, float] = {}
        current = "engine start"

        def lap(section: str) -> None:
            """The section that ends took this long; ``section`` begins."""
            nonlocal last, current
            seconds[current] = round(time.perf_counter() - last, 1)
            last, current = time.perf_counter(), section.rstrip(".")
            print(f"{section} ({time.perf_counter() - began:.0f} s so far)", flush=True)

        print("engine start...", flush=True)
        results: dict[str, Any] = {
            "date": datetime.date.today().isoformat(),
            "machine": machine(),
            "engine_start": await engine_start({"tiny": tiny, "bench": bench_model}, 2 if quick else 5),
        }
        lap("layer cost...")
        results["overhead_sizes"] = layer_sizes("tiny", quick)
        results["overhead"] = {
            "tiny": await layer_cost(tiny, _made(work / "layer-tiny"), **layer_sizes("tiny", quick)),
        }
        # The quick run samples 100 pairs of requests: with 10, 17 samples could miss the
        # core altogether (its share is about a tenth).
        results["profile"] = await profile.measure(tiny, _made(work / "profile"), *((10, 100) if quick else (200, 300)))
        smollm2 = packaged_model_path("smollm2")
        if not quick and smollm2 is not None:
            results["overhead"]["smollm2"] = await layer_cost(Path(smollm2), _made(work / "layer-smollm2"),
                                                              **layer_sizes("smollm2", quick))
        lap("switching back...")
        sizes = sizes or ([512] if quick else FULL_SIZES)
        results["switch_back"] = await switchback.switch_back(bench_model, work, sizes, 1 if quick else 2,
                                                              ram_on_up_to=None if quick else switchback.RAM_ON_UP_TO)
        results["plot"] = switchback.plot(results["switch_back"], out)
        lap("agents at work...")
        models = {"tiny": tiny, "bench": bench_model, "smollm2": packaged_model_path("smollm2")}
        results["agents"] = []
        for plan in AGENT_PLANS["quick" if quick else "full"]:
            if models[plan["model"]] is None:
                print(f"  {plan['name']}: not installed, skipped", flush=True)
                continue
            found = await asyncio.to_thread(workloads.agent_comparison, models[plan["model"]], work, **plan["args"])
            results["agents"].append({**found, "model": plan["name"]})
        lap("against the engine alone...")
        alone = models["smollm2"] if not quick and models["smollm2"] is not None else tiny
        results["alone"] = {"model": "tiny model" if alone == tiny else "SmolLM2-135M",
                            **await engine_alone.measure(Path(alone), _made(work / "alone"),
                                                         **engine_alone.sizes(quick))}
        if not quick:
            lap("agent-sim (cache-pressure)...")
            exe = agent_sim.executable()
            if exe is not None and models["smollm2"] is not None:
                results["agent_sim"] = await asyncio.to_thread(
                    agent_sim.compare, Path(models["smollm2"]), _made(work / "agent-sim"), AGENT_SIM_ROUNDS,
                    agent_sim.systems(), agent_sim.ARGS, exe)
        lap("prefix restore after a restart...")
        results["prefix"] = await asyncio.to_thread(prefix.prefix_after_restart, tiny if quick else bench_model,
                                                    work, 512 if quick else 3072, 1 if quick else 2,
                                                    name="tiny" if quick else "bench")
        lap("save/restore throughput...")
        results["save_restore"] = await save_restore_speed(bench_model, work, 512 if quick else 4096)
        lap("several servers, a failover...")
        results["replicas"] = await replicas.measure(bench_model, _made(work / "replicas"), quick)
        lap("done.")
        results["seconds"] = {"sections": seconds, "total": round(time.perf_counter() - began, 1),
                              "load_average": os.getloadavg()}
    command = command or ("make bench-quick" if quick else "make bench")
    (out / "results.json").write_text(json.dumps(results, indent=1))
    (out / "README.md").write_text(report(results, quick, command))
    print((out / "README.md").read_text())


def cli() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="small sizes, few repetitions (CI)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--sizes", help="conversation lengths for the switch-back table, e.g. 2048,4096")
    args = parser.parse_args()
    sizes = [int(size) for size in args.sizes.split(",")] if args.sizes else None
    command = f"python -m bench.run --sizes {args.sizes}" if args.sizes else None
    asyncio.run(main(args.quick, args.out, sizes, command))


if __name__ == "__main__":
    cli()
