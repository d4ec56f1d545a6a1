"""A benchmark nobody here wrote: PyPI ``cache-pressure``'s ``agent-sim``, against the bare engine.

``agent-sim`` runs three coding-agent sessions at once against an OpenAI-compatible
endpoint: each grows a main context turn by turn, runs two cold sub-agent contexts, then
returns to its main context for a last turn, and says whether that context was kept
(its cached tokens) and how long the whole run took. It is installed pinned, in a
virtual environment of its own (``make bench`` makes ``.cache-pressure``; it needs Python
3.12 or later), and run here as its user runs it, against:

- the bare engine, ``llama-server -np 1 -c 8192``, its RAM cache at its default, and off;
- strata-serve with its defaults (auto-sessions, the side slot), RAM cache default and off;
- optionally strata-serve from another checkout (``--before DIR``), to compare a change.

Every system is started fresh for each run, with its files in a directory of its own; the
runs of one round go in turn (the order turns each round), every run of a round with the
same salt (the same texts), so the machine's noise spreads over all of them and the wall
time ratios compare runs made minutes apart. ``--miss-threshold 0``: a lost context does
not stop the run (agent-sim's default stops every session at the first miss, which would
make the wall time of a system that loses contexts short and meaningless); the contexts
kept are counted from its records with its default threshold instead.

``python -m bench.agent_sim [--rounds N] [--only KEY ...] [--before DIR]`` writes
``bench/results/agent-sim.md``; ``bench.run`` runs it in ``make bench``.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import datetime
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.harness import BENCH_ENGINE_KEY
from bench.layer_cost import cpu_seconds
from bench.systems import Running, System, start

RESULTS = Path(__file__).resolve().parent / "results"
#: The pinned version (the Makefile's CACHE_PRESSURE_VERSION) and where ``make bench`` installs it.
VERSION = "0.6.3"
VENV = Path(__file__).resolve().parent.parent / ".cache-pressure"
#: The shape of the run: three sessions of three 1,000-token steps (~3,000 tokens), two
#: 1,200-token sub-agents each, a 200-token return, 16 tokens out per turn.
ARGS = ["--max-context", "8192", "--max-tokens", "16", "--finalize-tokens", "200", "--main-tokens", "3000",
        "--step-tokens", "1000", "--sub-tokens", "1200", "--sub-windows", "2", "--sessions", "3"]
#: Half the tokens (``--half``), for a machine too busy for the whole run.
HALF_ARGS = ["--max-context", "8192", "--max-tokens", "16", "--finalize-tokens", "100", "--main-tokens", "1500",
             "--step-tokens", "500", "--sub-tokens", "600", "--sub-windows", "2", "--sessions", "3"]
#: A short shape (``--quick``): the same turns, a tenth of the tokens.
QUICK_ARGS = ["--max-context", "8192", "--max-tokens", "8", "--finalize-tokens", "20", "--main-tokens", "300",
              "--step-tokens", "100", "--sub-tokens", "120", "--sub-windows", "2", "--sessions", "3"]
#: agent-sim's own threshold: a return that reuses less than this share of its context lost it.
MISS_THRESHOLD = 0.66
CTX_SIZE = 8192
#: A run that takes longer than this has hung.
RUN_TIMEOUT_S = 7200


#: ``-np`` among the engine's arguments: strata-serve then starts it without the side slot.
NO_SIDE_SLOT = ("-np", "1")


def systems(before: Path | None = None, every: bool = False) -> list[System]:
    """The set-ups, in the order of the table: pairs with the same RAM cache side by side.
    ``before``: strata-serve from that tree too; ``every``: also strata-serve without its
    side slot (to tell the side slot's share), for ``--only`` to choose from."""
    found = [
        System("llama-server -np 1 -c 8192, RAM cache default", "bare", "bare-default"),
        System("strata-serve, its defaults", "strata", "strata-default"),
    ]
    if every:
        found.append(System("strata-serve without the side slot", "strata", "noside-default",
                            extra_args=NO_SIDE_SLOT))
    if before is not None:
        found.append(System("strata-serve before, its defaults", "strata", "before-default", source=str(before)))
        if every:
            found.append(System("strata-serve before, without the side slot", "strata", "beforenoside-default",
                                extra_args=NO_SIDE_SLOT, source=str(before)))
    found += [
        System("llama-server -np 1 -c 8192, RAM cache off", "bare", "bare-off", cache_ram_mib=0),
        System("strata-serve, RAM cache off", "strata", "strata-off", cache_ram_mib=0),
    ]
    if before is not None:
        found.append(System("strata-serve before, RAM cache off", "strata", "before-off", cache_ram_mib=0,
                            source=str(before)))
    return found


#: Which bare set-up each strata-serve set-up is compared with.
def baseline(key: str) -> str:
    return "bare-off" if key.endswith("-off") else "bare-default"


def executable(venv: Path = VENV) -> Path | None:
    """``agent-sim`` from its own virtual environment, if installed."""
    path = venv / "bin" / "agent-sim"
    return path if path.exists() else None


def kept(records: list[dict[str, Any]], threshold: float = MISS_THRESHOLD) -> tuple[int, int]:
    """Sessions whose return found their main context (reuse at least ``threshold``), of those that returned."""
    finals = [r for r in records if r["phase"] == "finalize" and not r.get("aborted") and not r.get("error")]
    return sum(1 for r in finals if (r.get("reuse") or 0.0) >= threshold), len(finals)


def continued(records: list[dict[str, Any]], threshold: float = MISS_THRESHOLD) -> tuple[int, int]:
    """Main turns after the first that found their context, of all of them."""
    mains = [r for r in records if r["phase"] == "main" and r["step"] > 0 and not r.get("aborted")
             and not r.get("error")]
    return sum(1 for r in mains if (r.get("reuse") or 0.0) >= threshold), len(mains)


#: The engine's timing lines: what each task read and generated, and how long it took.
PROMPT_LINE = re.compile(r"prompt eval time =\s*([0-9.]+) ms /\s*(\d+) tokens")
EVAL_LINE = re.compile(r"\beval time =\s*([0-9.]+) ms /\s*(\d+) tokens")


def engine_work(log: Path) -> dict[str, float]:
    """What the engine did, from its log: tokens read (prefill) and the milliseconds it took, and
    the same for the tokens generated. On a busy machine the wall time says little; these say
    whether the work itself differs (tokens read again) or its speed (milliseconds per token)."""
    try:
        text = log.read_text(errors="replace")
    except OSError:
        return {}
    prompt = [(float(ms), int(n)) for ms, n in PROMPT_LINE.findall(text)]
    generated = [(float(ms), int(n)) for line in text.splitlines() if "prompt eval time" not in line
                 for ms, n in EVAL_LINE.findall(line)]
    return {"prefill_tokens": sum(n for _, n in prompt), "prefill_s": sum(ms for ms, _ in prompt) / 1000,
            "generated_tokens": sum(n for _, n in generated), "generate_s": sum(ms for ms, _ in generated) / 1000}


def run_once(system: System, model: Path, work: Path, salt: int, args: list[str],
             agent_sim: Path) -> dict[str, Any]:
    """Start ``system``, run agent-sim once against it, stop it: the figures of that run."""
    running: Running = start(system, model, CTX_SIZE, work)
    output = work / "agent-sim.json"
    load_before = os.getloadavg()
    try:
        # The CPU of each process during the run alone: what each took from the other while
        # agent-sim's clock ran (their start, the model's load among it, is before it).
        layer_before = running.layer_cpu_s()
        engine = running.engine_pid()
        engine_before = cpu_seconds(engine) if engine is not None else None
        began = time.perf_counter()
        done = subprocess.run([str(agent_sim), "--base-url", running.url + "/v1", "--api-key", BENCH_ENGINE_KEY,
                               *args, "--miss-threshold", "0", "--no-viz", "--salt", str(salt),
                               "--output", str(output)],
                              capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
        wall = time.perf_counter() - began
        stats = running.stats()
        ram_ms = running.ram_cache_ms()
        layer_cpu = _since(running.layer_cpu_s(), layer_before)
        engine_cpu = _since(cpu_seconds(engine) if engine is not None else None, engine_before)
    finally:
        running.stop()
    prefill = engine_work(running.log)
    (work / "agent-sim.out").write_text(done.stdout + done.stderr)
    if not output.exists():
        raise RuntimeError(f"agent-sim against {system.name} wrote no results (exit {done.returncode}):\n"
                           f"{(done.stdout + done.stderr)[-3000:]}")
    found = json.loads(output.read_text())
    records = found["records"]
    errors = [r["error"] for r in records if r.get("error")]
    return {
        "wall_s": wall,
        "elapsed_s": found["summary"]["elapsed"],
        "kept": kept(records),
        "continued": continued(records),
        "errors": errors,
        "exit": done.returncode,
        "records": records,
        "load_before": load_before,
        "load_after": os.getloadavg(),
        "phases": (stats or {}).get("phases"),
        "auto_sessions": ((stats or {}).get("plugins") or {}).get("auto_sessions"),
        "layer_cpu_s": layer_cpu,
        "engine_cpu_s": engine_cpu,
        **prefill,
        "ram_cache_ms": sum(ram_ms),
    }


def _since(now: float | None, before: float | None) -> float | None:
    return None if now is None or before is None else now - before


def compare(model: Path, work: Path, rounds: int, chosen: list[System], args: list[str],
            agent_sim: Path, at_once: bool = False) -> dict[str, Any]:
    """Every system in ``chosen``, ``rounds`` times, in turn (the order turns each round).

    ``at_once``: the systems of a round run at the same time instead, for a machine too
    busy for wall times to compare: each then meets the same load, and what compares is
    the CPU time of each engine (of one thread: ``--engine-threads 1``) and layer."""
    runs: dict[str, list[dict[str, Any]]] = {s.key: [] for s in chosen}
    for round_ in range(rounds):
        order = chosen[round_ % len(chosen):] + chosen[:round_ % len(chosen)]
        salt = int(time.time())
        if at_once:
            with concurrent.futures.ThreadPoolExecutor(len(order)) as pool:
                started = [pool.submit(run_once, system, model, work / f"{system.key}-{round_}", salt, args,
                                       agent_sim) for system in order]
                results = [future.result() for future in started]
        else:
            results = []
        for n, system in enumerate(order):
            found = results[n] if at_once else run_once(system, model, work / f"{system.key}-{round_}", salt,
                                                         args, agent_sim)
            found["round"] = round_
            runs[system.key].append(found)
            print(f"  agent-sim, round {round_ + 1}, {system.name}: {found['wall_s']:.1f} s, contexts kept "
                  f"{found['kept'][0]}/{found['kept'][1]}, main turns continued {found['continued'][0]}/"
                  f"{found['continued'][1]}, load {found['load_before'][0]:.1f}; engine CPU "
                  f"{found.get('engine_cpu_s') or 0:.1f} s, read {found.get('prefill_tokens', 0):,} tokens in "
                  f"{found.get('prefill_s', 0):.1f} s", flush=True)
    return {"version": VERSION, "args": args, "rounds": rounds, "systems": {s.key: s.name for s in chosen},
            "runs": runs, "ratios": ratios(runs), "at_once": at_once}


def cpu_s(run: dict[str, Any]) -> float:
    """The CPU time of a run: its engine's and its layer's (none for the bare engine)."""
    return (run.get("engine_cpu_s") or 0.0) + (run.get("layer_cpu_s") or 0.0)


def ratios(runs: dict[str, list[dict[str, Any]]], measure: Any = None) -> dict[str, list[float]]:
    """Each strata-serve set-up's wall time (or ``measure`` of a run) over its bare
    baseline's, round by round."""
    measure = measure or (lambda run: run["wall_s"])
    found: dict[str, list[float]] = {}
    for key, theirs in runs.items():
        base = runs.get(baseline(key))
        if key.startswith("bare") or not base:
            continue
        by_round = {r["round"]: measure(r) for r in base}
        found[key] = [measure(r) / by_round[r["round"]] for r in theirs if r["round"] in by_round]
    return found


def _span(values: list[float], digits: int) -> str:
    if len(values) == 1:
        return f"{values[0]:.{digits}f}"
    return f"{statistics.median(values):.{digits}f} ({min(values):.{digits}f}-{max(values):.{digits}f})"


def report(found: dict[str, Any]) -> list[str]:
    """The table: wall time, its ratio to the bare engine with the same RAM cache, contexts kept."""
    lines = [
        "",
        f"## A third-party agent benchmark: cache-pressure {found['version']} agent-sim, SmolLM2-135M",
        "",
        "PyPI `cache-pressure`'s `agent-sim`, pinned, from its own virtual environment, as its user runs it: "
        f"`agent-sim {' '.join(found['args'])} --miss-threshold 0`. Three sessions at once; each grows its main "
        "context in three steps, runs two cold sub-agent contexts, then returns to its main context. Every system "
        f"started fresh for each run; {found['rounds']} round(s), the runs of a round in turn with the same texts. "
        "Ratio: wall time over the bare engine's with the same RAM cache, in the same round (median, lowest-"
        "highest). Kept: the returns that found their main context (at least 66% of it cached, agent-sim's own "
        "threshold), over all runs. CPU: each process's during the run alone, from agent-sim's start to its end.",
        "",
        "| system | wall s | ratio to llama-server -np 1 | contexts kept | main turns continued | layer CPU s "
        "| engine CPU s | tokens read (prefill) | ms per token read |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    ratio = ratios(found["runs"], cpu_s) if found.get("at_once") else found["ratios"]
    if found.get("at_once"):
        lines[-2] = lines[-2].replace("ratio to llama-server -np 1", "CPU ratio to llama-server -np 1")
        lines[-2:-2] = ["The systems of each round ran at the same time (`--at-once`, a machine busy with other "
                        "work), each engine on one thread: the ratio is of CPU time (engine and layer), the work "
                        "done, since wall times there say how the scheduler shared the machine out.", ""]
    for key, name in found["systems"].items():
        runs = found["runs"][key]
        if not runs:
            continue
        kept_n = sum(r["kept"][0] for r in runs)
        kept_of = sum(r["kept"][1] for r in runs)
        cont_n = sum(r["continued"][0] for r in runs)
        cont_of = sum(r["continued"][1] for r in runs)
        cpu = [r["layer_cpu_s"] for r in runs if r.get("layer_cpu_s") is not None]
        engine_cpu = [r["engine_cpu_s"] for r in runs if r.get("engine_cpu_s") is not None]
        read = [r["prefill_tokens"] for r in runs if r.get("prefill_tokens")]
        per_token = [r["prefill_s"] * 1000 / r["prefill_tokens"] for r in runs if r.get("prefill_tokens")]
        lines.append(f"| {name} | {_span([r['wall_s'] for r in runs], 1)} | "
                     f"{_span(ratio[key], 3) if ratio.get(key) else '1 (the baseline)'} | {kept_n}/{kept_of} | "
                     f"{cont_n}/{cont_of} | {_span(cpu, 1) if cpu else '-'} | "
                     f"{_span(engine_cpu, 1) if engine_cpu else '-'} | {_span(read, 0) if read else '-'} | "
                     f"{_span(per_token, 2) if per_token else '-'} |")
    loads = [r["load_before"][0] for runs in found["runs"].values() for r in runs]
    if loads:
        lines += ["", f"Load average (1 min) at the start of each run: {min(loads):.1f} to {max(loads):.1f} "
                      f"(2 cores)."]
    phases = _phases(found)
    if phases:
        lines += ["", "Where strata-serve's own time went (`GET /stats` phases, summed over its runs, seconds):", "",
                  "| system | " + " | ".join(phases["names"]) + " |",
                  "|---|" + "---|" * len(phases["names"])]
        for name, row in phases["rows"].items():
            lines.append(f"| {name} | " + " | ".join(f"{row.get(n, 0.0):.1f}" for n in phases["names"]) + " |")
    return lines


#: The spans of the phases table, those of strata-serve's own work on the line.
PHASE_NAMES = ("queue", "gap", "pre_request", "engine_save", "engine_restore", "slots", "post_request")


def _phases(found: dict[str, Any]) -> dict[str, Any] | None:
    rows: dict[str, dict[str, float]] = {}
    for key, name in found["systems"].items():
        total: dict[str, float] = {}
        for run in found["runs"][key]:
            for phase, ms in ((run.get("phases") or {}).get("ms") or {}).items():
                total[phase] = total.get(phase, 0.0) + ms / 1000
        if total:
            rows[name] = total
    if not rows:
        return None
    return {"names": [n for n in PHASE_NAMES if any(n in row for row in rows.values())], "rows": rows}


def main() -> None:
    from strata_serve.models import packaged_model_path

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--only", nargs="*", help="system keys (bare-default, strata-default, noside-default, "
                                                  "before-default, beforenoside-default, bare-off, strata-off, "
                                                  "before-off)")
    parser.add_argument("--before", type=Path, help="a checkout of strata-serve to compare (its tree)")
    parser.add_argument("--quick", action="store_true", help="a tenth of the tokens")
    parser.add_argument("--half", action="store_true", help="half the tokens")
    parser.add_argument("--engine-threads", type=int, help="every engine's threads (-t)")
    parser.add_argument("--at-once", action="store_true",
                        help="the systems of a round at the same time (a busy machine: compare CPU times)")
    parser.add_argument("--work", type=Path, help="keep each run's files (logs) here")
    parser.add_argument("--out", type=Path, default=RESULTS / "agent-sim.md")
    parser.add_argument("--json", type=Path, help="write the raw figures here too")
    options = parser.parse_args()
    agent_sim = executable()
    if agent_sim is None:
        sys.exit(f"agent-sim is not installed in {VENV}: run `make bench-agent-sim` (or `make bench`)")
    model = packaged_model_path("smollm2")
    if model is None:
        sys.exit("SmolLM2 is not installed: run `make setup`")
    chosen = [s for s in systems(options.before, every=bool(options.only))
              if not options.only or s.key in options.only]
    if options.engine_threads:
        # On a machine shared with other work, an engine of one thread does not spin waiting
        # for a second one that is not running: its CPU time is then its work.
        chosen = [dataclasses.replace(s, extra_args=(*s.extra_args, "-t", str(options.engine_threads)))
                  for s in chosen]
    import tempfile

    with tempfile.TemporaryDirectory(prefix="strata-agent-sim-") as tmp:
        work = options.work or Path(tmp)
        found = compare(Path(model), work, options.rounds, chosen, QUICK_ARGS if options.quick else HALF_ARGS if options.half else ARGS, agent_sim,
                        options.at_once)
    from bench.run import machine

    text = ["# cache-pressure agent-sim through strata-serve", "",
            f"Made by `python -m bench.agent_sim` on {datetime.date.today().isoformat()}; machine: {machine()}.",
            *report(found), ""]
    options.out.write_text("\n".join(text))
    print("\n".join(text))
    if options.json:
        options.json.write_text(json.dumps(found, indent=1))


if __name__ == "__main__":
    main()
