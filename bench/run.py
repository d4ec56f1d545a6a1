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
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any


from bench.agents import concurrent_agents
from bench.harness import bare_engine, chat, client_session, conversation, follow_up, spread, strata
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


SWITCH_SETUPS = {
    # name: (strata-serve?, auto-sessions?, engine RAM cache MiB: 0 off, None the engine's default)
    "llama-server, RAM cache off": (False, False, 0),
    "strata + auto-sessions, RAM cache off": (True, True, 0),
    "llama-server, RAM cache on": (False, False, None),
    "strata + auto-sessions, RAM cache on": (True, True, None),
}


async def switch_back(model: Path, work: Path, sizes: list[int], rounds: int) -> dict[str, Any]:
    """A, B, then back and forth: time to first token on each return, per context size."""
    found: dict[str, Any] = {}
    for size in sizes:
        a, b = conversation("Alice", size), conversation("Bob", size)
        for index, (name, (through_strata, auto, cache)) in enumerate(SWITCH_SETUPS.items()):
            slot_dir = work / f"switch-{size}-{index}"  # each setup starts with no files
            if through_strata:
                plugins = {"auto_sessions": {"enabled": auto, "min_tokens": 256}}
                setup = strata(model, size * 2 + 512, slot_dir, cache, plugins=plugins)
            else:
                setup = bare_engine(model, size * 2 + 512, slot_dir, cache)
            async with setup as url, client_session() as session:
                first_a = await chat(session, url, a)
                first_b = await chat(session, url, b)
                returns, reused = [], []
                for n in range(rounds):
                    for base, first in ((a, first_a), (b, first_b)):
                        reply = await chat(session, url, follow_up(base, first.text, f"Question {n}?"))
                        returns.append(reply.ttft_s)
                        reused.append(reply.timings.get("cache_n", 0))
            files = list(slot_dir.glob("auto-*.bin")) if slot_dir.exists() else []
            found.setdefault(str(size), {})[name] = {
                "first_prefill_s": first_a.ttft_s, "returns_s": returns, "cache_n": reused,
                "file_mb": max((f.stat().st_size for f in files), default=0) / 1e6,
            }
            print(f"  switch-back {size} tokens, {name}: {spread(returns)} s, cache_n {reused}", flush=True)
    return found


AGENT_SETUPS = {
    # name: (strata-serve with auto-sessions?, engine RAM cache limited?)
    "llama-server, RAM cache off": (False, False),
    "llama-server, RAM cache limited": (False, True),
    "strata + auto-sessions, RAM cache off": (True, False),
    "strata + auto-sessions, RAM cache limited": (True, True),
}


async def agent_workload(model: Path, work: Path, conversations: int, size: int, rounds: int,
                         cache_mib: int) -> dict[str, Any]:
    """One client visits M conversations round robin; the server restarts halfway."""
    found: dict[str, Any] = {}
    names = [f"Agent{n}" for n in range(conversations)]
    for index, (name, (through_strata, limited)) in enumerate(AGENT_SETUPS.items()):
        slot_dir = work / f"agent-{index}"
        cache = cache_mib if limited else 0

        def setup():
            if through_strata:
                return strata(model, size + 1024, slot_dir, cache, plugins={"auto_sessions": {"min_tokens": 256}})
            return bare_engine(model, size + 1024, slot_dir, cache)

        history = {n: conversation(n, size) for n in names}
        prefill_s, began = 0.0, time.perf_counter()
        for half in (range(rounds // 2), range(rounds // 2, rounds)):  # a restart in between
            async with setup() as url, client_session() as session:
                for turn in half:
                    for n in names:
                        reply = await chat(session, url, history[n], max_tokens=4)
                        prefill_s += reply.timings.get("prompt_ms", 0) / 1000
                        history[n] = follow_up(history[n], reply.text, f"Step {turn}?")
        found[name] = {"prefill_s": prefill_s, "wall_s": time.perf_counter() - began}
        print(f"  agent workload, {name}: prefill {prefill_s:.1f} s, wall {found[name]['wall_s']:.1f} s",
              flush=True)
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


def plot(switch: dict[str, Any], out: Path) -> str | None:
    """Return time and session-file size against context length, as ``switch-back.png``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = sorted(int(s) for s in switch)
    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for name in SWITCH_SETUPS:
        left.plot(sizes, [statistics.median(switch[str(s)][name]["returns_s"]) for s in sizes], marker="o",
                  label=name)
    left.set(xlabel="conversation length (tokens)", ylabel="time to first token on return (s)",
             title="Switching back")
    left.legend(fontsize=7)
    right.plot(sizes, [switch[str(s)]["strata + auto-sessions, RAM cache off"]["file_mb"] for s in sizes],
               marker="o")
    right.set(xlabel="conversation length (tokens)", ylabel="session file (MB)", title="Session file size")
    figure.tight_layout()
    figure.savefig(out / "switch-back.png", dpi=100)
    plt.close(figure)
    return "switch-back.png"


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
        "the text they write is meaningless, the work the engine does for them is real.",
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
        f"{results['overhead_sizes']['stream_tokens']} tokens (tokens/s over the whole call). The layer's CPU is "
        "its own process's (user + system), read from /proc.",
        "",
        *LAYER_HEADER,
    ]
    for name, v in results["overhead"].items():
        lines += layer_summary(name, v)
    lines.append("")

    lines += [
        "## Switching back: time to first token on returning to a conversation (bench model)",
        "",
        "A, then B, then back and forth; each return adds one short question. Ratio: against",
        "the bare engine with its RAM cache off, which re-reads the whole prompt.",
        "",
        "| tokens | setup | first prefill s | return s | ratio | cache_n on return |",
        "|---|---|---|---|---|---|",
    ]
    for size, setups in results["switch_back"].items():
        full = statistics.median(setups["llama-server, RAM cache off"]["returns_s"])
        for name, v in setups.items():
            ratio = full / statistics.median(v["returns_s"])
            lines.append(f"| {size} | {name} | {v['first_prefill_s']:.2f} | {spread(v['returns_s'])} | "
                         f"{ratio:.1f}x faster | {min(v['cache_n'])}-{max(v['cache_n'])} |")
    agent = results["agent"]
    settings = results["agent_settings"]
    lines += [
        "",
        f"## An agent workload: {settings['conversations']} conversations of {settings['size']} tokens, "
        f"round robin, {settings['rounds']} rounds, restart halfway (bench model)",
        "",
        f"The limited RAM cache is {settings['cache_mib']} MiB: it cannot hold them all.",
        "",
        "| setup | prefill s | wall s | wall against bare, RAM cache off |",
        "|---|---|---|---|",
    ]
    base_wall = agent["llama-server, RAM cache off"]["wall_s"]
    for name, v in agent.items():
        lines.append(f"| {name} | {v['prefill_s']:.1f} | {v['wall_s']:.1f} | {base_wall / v['wall_s']:.1f}x faster |")
    lines += agents_table(results["agents"], results["agents_settings"])
    if results.get("plot"):
        lines += ["", f"![switch-back time and file size against context length]({results['plot']})"]
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
    lines += ["", "Raw figures: `results.json` beside this file (not committed).", ""]
    if quick:
        lines.insert(2, "**Quick mode**: small sizes and few repetitions; run `make bench` for the full table.\n")
    return "\n".join(lines)


def agents_table(agents: dict[str, Any], settings: dict[str, Any]) -> list[str]:
    lines = [
        "",
        f"## Concurrent agents: {settings['sessions']} sessions at once, each a main context growing by about "
        f"{settings['step_tokens']} tokens a step, a sub-agent context between steps, {settings['steps']} steps "
        f"({settings['model']} model)",
        "",
        "The clients stream with `requests` and close each connection as soon as they have read the event",
        "with the timings, before `[DONE]`. A return to a main context re-read it when the engine reused less",
        f"than half of what it held at its previous turn. The limited RAM cache is {settings['limited_mib']} MiB,",
        f"below the working set; auto-sessions runs with `min_tokens = {settings['min_tokens']}`.",
        "",
        "| setup | wall s | returns to main | returns that re-read their context | tokens re-read |",
        "|---|---|---|---|---|",
    ]
    for name, v in agents.items():
        lines.append(f"| {name} | {v['wall_s']:.1f} | {v['returns']} | {v['reread']} | {v['reread_tokens']:,} |")
    return lines


FULL_SIZES = [2048, 4096, 8192, 12288]


def _made(directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    return directory


async def main(quick: bool, out: Path, sizes: list[int] | None = None, command: str | None = None) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="strata-bench-") as tmp:
        work = Path(tmp)
        tiny = write_demo_model(work / "tiny.gguf", size="tiny")
        bench_model = write_demo_model(work / "bench.gguf", size="bench")
        print("engine start...", flush=True)
        results: dict[str, Any] = {
            "date": datetime.date.today().isoformat(),
            "machine": machine(),
            "engine_start": await engine_start({"tiny": tiny, "bench": bench_model}, 2 if quick else 5),
        }
        print("layer cost...", flush=True)
        results["overhead_sizes"] = layer_sizes("tiny", quick)
        results["overhead"] = {
            "tiny": await layer_cost(tiny, _made(work / "layer-tiny"), **layer_sizes("tiny", quick)),
        }
        smollm2 = packaged_model_path("smollm2")
        if not quick and smollm2 is not None:
            results["overhead"]["smollm2"] = await layer_cost(Path(smollm2), _made(work / "layer-smollm2"),
                                                              **layer_sizes("smollm2", quick))
        print("switching back...", flush=True)
        sizes = sizes or ([1024] if quick else FULL_SIZES)
        results["switch_back"] = await switch_back(bench_model, work, sizes, 1 if quick else 2)
        print("agent workload...", flush=True)
        agent = {"conversations": 3, "size": 512, "rounds": 2, "cache_mib": 12} if quick else \
            {"conversations": 6, "size": 4096, "rounds": 4, "cache_mib": 160}
        results["agent_settings"] = agent
        results["agent"] = await agent_workload(bench_model, work, **agent)
        print("concurrent agents...", flush=True)
        agents = {"sessions": 3, "steps": 2, "step_tokens": 300, "limited_mib": 1, "min_tokens": 100} if quick \
            else {"sessions": 3, "steps": 4, "step_tokens": 750, "limited_mib": 64, "min_tokens": 500}
        results["agents_settings"] = {**agents, "model": "tiny" if quick else "bench"}
        results["agents"] = await concurrent_agents(tiny if quick else bench_model, work, **agents)
        results["plot"] = plot(results["switch_back"], out)
        print("save/restore throughput...", flush=True)
        results["save_restore"] = await save_restore_speed(bench_model, work, 1024 if quick else 8192)
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
