"""Where the time goes between the engine's answers: the agent workload, strata-serve beside the bare engine.

The agent workload of :mod:`bench.workloads` (four agents, sub-agents, side requests, the
engine killed halfway), in interleaved rounds, against the bare engine and strata-serve
with the engine's RAM cache at its default (room for every conversation), limited, and
off. For strata-serve, per request:

- ``gap``: from the engine's previous answer ending to this request being sent, for a
  request that was already waiting then: the time the engine stood idle for strata-serve;
- its parts, from strata-serve's own spans (``GET /stats`` ``phases``,
  :mod:`strata_serve.timing`): choosing the slot and asking the engine about its slots,
  the plugins' steps (auto-sessions' save: the engine's write, the commit with its digest
  and fsyncs, pruning; its restore: the checks and the engine's read), ``post_request``;
- the layer's CPU (its process, from /proc), on a machine whose cores the engine shares;
- the engine's own RAM-cache work before each task, as the engine logs it (bare engine
  and strata-serve alike).

``python -m bench.gap [--rounds N] [--model bench|smollm2] [--before REV]`` writes
``bench/results/gap.md``. ``--before REV`` adds strata-serve as it was at the git revision
``REV`` (checked out beside this one and run from there), for a before/after in one run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

from bench import workloads
from bench.systems import System, hearth_installed
from strata_serve.demo_model import write_demo_model
from strata_serve.models import packaged_model_path

RESULTS = Path(__file__).parent / "results"

#: The parts of the gap, in the order of the table: (span, what it is).
PARTS = [
    ("gap", "**the engine idle between two answers, a request waiting** (in all)"),
    ("queue", "waiting for the line (a request already waiting: the hand-over)"),
    ("ready", "the engine up, the slot chosen"),
    ("slots", "the engine's `GET /slots` (within the others)"),
    ("pre_request", "every plugin's step before the engine (in all)"),
    ("auto_sessions.siblings", "auto-sessions: which of a key's conversations it is"),
    ("auto_sessions.tokenize", "auto-sessions, in blocks: the incoming prompt's tokens (the engine's template and tokenizer)"),
    ("auto_sessions.longest_prefix", "auto-sessions, in blocks: the longest stored chain that prefixes them"),
    ("engine_save", "auto-sessions' save: the engine writing the file"),
    ("auto_sessions.commit", "auto-sessions' save: the commit (lock, digest, fsyncs, sidecar, rename)"),
    ("auto_sessions.lock", "  of it: the slot directory's lock"),
    ("auto_sessions.blocks", "  of it, in blocks: the engine's file cut, the new blocks and the manifest written"),
    ("auto_sessions.digest", "  of it: the sampled digest (a whole file)"),
    ("auto_sessions.sidecar", "  of it: the sidecar and the rename (with `at_save`, the fsyncs)"),
    ("auto_sessions.fsync", "  of that: the fsyncs of the file, its sidecar and the directory"),
    ("auto_sessions.prune", "auto-sessions' save: pruning"),
    ("auto_sessions.restore_checks", "auto-sessions' restore: choosing and checking the file"),
    ("auto_sessions.join", "auto-sessions' restore, in blocks: the blocks joined (or the kept file linked)"),
    ("engine_restore", "auto-sessions' restore: the engine reading the file"),
    ("auto_sessions.touch", "auto-sessions: a restored file's last use, written as it goes back unchanged"),
    ("post_request", "every plugin's step after the answer (in all)"),
]


def systems(min_tokens: int, limited_mib: int, before: Path | None) -> list[System]:
    auto = {"auto_sessions": {"min_tokens": min_tokens}}
    at_save = {"auto_sessions": {"min_tokens": min_tokens, "fsync": "at_save"}}
    chosen = [
        System("strata + auto-sessions (fsync at save), RAM cache default", "strata", "strata-default-at-save",
               plugins=at_save),
        System("llama-server, RAM cache default", "bare", "bare-default"),
        System("strata + auto-sessions, RAM cache default", "strata", "strata-default", plugins=auto),
        System(f"llama-server, RAM cache {limited_mib} MiB", "bare", "bare-limited", cache_ram_mib=limited_mib),
        System(f"strata + auto-sessions, RAM cache {limited_mib} MiB", "strata", "strata-limited",
               cache_ram_mib=limited_mib, plugins=auto),
        System("llama-server, RAM cache off", "bare", "bare-off", cache_ram_mib=0),
        System("strata + auto-sessions, RAM cache off", "strata", "strata-off", cache_ram_mib=0, plugins=auto),
        System("llama-server -np 4, RAM cache default", "bare", "bare-np4", parallel=4),
        System("strata -np 4 + auto-sessions, RAM cache default", "strata", "strata-np4", parallel=4, plugins=auto),
    ]
    if hearth_installed():
        chosen.append(System("hearth-llm (its defaults: -np 1, RAM cache default)", "hearth", "hearth"))
    if before is not None:
        chosen += [replace(s, name=s.name.replace("strata", "strata before"), key=s.key + "-before",
                           source=str(before)) for s in chosen if s.kind == "strata" and "at-save" not in s.key]
    return chosen


def checkout(rev: str, into: Path) -> Path:
    """The tree at ``rev`` in ``into`` (a git worktree of this checkout, detached)."""
    subprocess.run(["git", "worktree", "add", "--detach", str(into), rev], check=True, capture_output=True)
    return into


def breakdown(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per request, over every run of one system: each span's mean ms, the layer's CPU,
    the engine's RAM-cache work."""
    requests = sum((r.get("phases") or {}).get("requests", 0) for r in runs)
    spans: dict[str, float] = {}
    counts: dict[str, int] = {}
    for r in runs:
        phases = r.get("phases") or {}
        for name, ms in (phases.get("ms") or {}).items():
            spans[name] = spans.get(name, 0.0) + ms
            counts[name] = counts.get(name, 0) + (phases.get("count") or {}).get(name, 0)
    turns = sum(len(r["turns"]) for r in runs)
    cpu = [r["layer_cpu_s"] for r in runs if r.get("layer_cpu_s") is not None]
    ram = [ms for r in runs for ms in r.get("ram_cache_ms") or []]
    return {
        "requests": requests,
        "per_request_ms": {name: ms / requests for name, ms in spans.items()} if requests else {},
        "counts": counts,
        "layer_cpu_ms_per_request": sum(cpu) * 1000 / turns if cpu and turns else None,
        "ram_cache_ms_per_request": sum(ram) / turns if ram and turns else None,
        "ram_cache_tasks": len(ram),
    }


def report(found: dict[str, Any], per_system: dict[str, dict[str, Any]], model_name: str, command: str) -> str:
    lines = ["# Where the time goes between the engine's answers", "",
             f"Made by `{command}`; {model_name}. Every figure per request (mean over every request of "
             f"every round), milliseconds. A part within another is indented or said so.", ""]
    # Only the systems with something to show: strata-serve's (the others have no spans).
    names = [n for n, v in per_system.items() if v["per_request_ms"] or v["layer_cpu_ms_per_request"] is not None]
    lines += ["| part | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for span, label in PARTS:
        cells = []
        for name in names:
            value = per_system[name]["per_request_ms"].get(span)
            cells.append("-" if value is None else f"{value:.2f}")
        if any(c != "-" for c in cells):
            lines.append(f"| {label} (`{span}`) | " + " | ".join(cells) + " |")
    lines.append("| the layer's CPU (its process) | " + " | ".join(
        "-" if per_system[n]["layer_cpu_ms_per_request"] is None else f"{per_system[n]['layer_cpu_ms_per_request']:.2f}"
        for n in names) + " |")
    lines.append("| the engine's RAM-cache work before a task (its log) | " + " | ".join(
        "-" if per_system[n]["ram_cache_ms_per_request"] is None else f"{per_system[n]['ram_cache_ms_per_request']:.2f}"
        for n in names) + " |")
    lines += ["", "The runs themselves (as in `make bench`):"]
    lines += workloads.report(found, model_name)
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--model", choices=["bench", "smollm2"], default="bench")
    parser.add_argument("--before", help="a git revision: strata-serve as it was there, side by side")
    parser.add_argument("--only", help="system keys, comma-separated")
    parser.add_argument("--out", type=Path, default=RESULTS / "gap.md")
    parser.add_argument("--engine-verbosity", type=int,
                        help="the engine's -lv (4 logs its RAM-cache work before each task; it costs time itself)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="strata-gap-") as tmp:
        work = Path(tmp)
        before = checkout(args.before, work / "before") if args.before else None
        try:
            if args.model == "bench":
                model = write_demo_model(work / "bench.gguf", size="bench")
                shape = workloads.Workload(steps=4, opening=384, grow=64, sub=128, side=16, stall_s=30)
                min_tokens, limited = 256, 16
            else:
                found_model = packaged_model_path("smollm2")
                if found_model is None:
                    raise SystemExit("SmolLM2 is not installed: run make setup")
                model = Path(found_model)
                shape = workloads.Workload(steps=2, opening=192, grow=32, sub=64, side=16, real=True)
                min_tokens, limited = 128, 8
            chosen = systems(min_tokens, limited, before)
            if args.engine_verbosity is not None:
                chosen = [replace(s, extra_args=["-lv", str(args.engine_verbosity)]) for s in chosen]
            only = args.only.split(",") if args.only else None
            found = workloads.agent_comparison(
                model, work, shape=shape, repeats=args.rounds, limited_mib=limited, min_tokens=min_tokens,
                label=args.model, only=only, chosen=[s for s in chosen if only is None or s.key in only])
        finally:
            if before is not None:
                subprocess.run(["git", "worktree", "remove", "--force", str(before)], check=False)
    per_system = {name: breakdown(runs) for name, runs in found["runs"]["agents"].items()}
    command = "python -m bench.gap " + " ".join(
        f"--{k} {v}" for k, v in (("rounds", args.rounds), ("model", args.model), ("before", args.before),
                                  ("only", args.only), ("engine-verbosity", args.engine_verbosity)) if v)
    model_name = "bench model" if args.model == "bench" else "SmolLM2-135M"
    text = report(found, per_system, model_name, command)
    args.out.write_text(text)
    args.out.with_suffix(".json").write_text(json.dumps({"breakdown": per_system, "summary": found["summary"]},
                                                        indent=1))
    print(text)
    walls = {name: statistics.median(v["wall_s"]) for name, v in found["summary"]["agents"].items()}
    print(json.dumps(walls, indent=1))


if __name__ == "__main__":
    main()
