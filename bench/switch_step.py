"""Where a switch's own step goes, part by part: the bench model, blocks, the RAM cache off.

Two workloads of ~10,000-token conversations on the bench model (16 KB of state a token),
each request one token out, read from each answer's ``Server-Timing`` (the spans of
:mod:`strata_serve.timing`; medians over the switches, the first round left out):

- ``turns``: two conversations taking turns, each growing ~400 tokens a turn (every
  request a switch back to a conversation parked a turn before);
- ``new``: a new agent session each round, sharing a ~10,000-token opening (system prompt,
  tools) with the ones before, after an unrelated chat took the slot: each one restored by
  its tokens from the blocks another session parked.

``python -m bench.switch_step [--rounds N] [--before REV]`` appends a table to
``bench/results/switch-step.md``. ``--before REV`` runs strata-serve as it was at the git
revision ``REV`` beside this tree, in turn, in the same run.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import requests

from bench.gap import checkout
from bench.systems import System, start
from bench.workloads import HEADERS
from strata_serve.demo_model import write_demo_model
from strata_serve.timing import read_server_timing

RESULTS = Path(__file__).parent / "results" / "switch-step.md"
#: The spans shown, in the table's order.
SPANS = ["pre_request", "engine_save", "auto_sessions.commit", "auto_sessions.prune", "auto_sessions.tokenize",
         "auto_sessions.longest_prefix", "auto_sessions.join", "engine_restore"]
OPENING = "You are an agent. " + "tool schema and rules " * 440


def run(source: str | None, workload: str, rounds: int, model: Path, work: Path) -> dict[str, float]:
    """Median ms of each span over the switches of ``workload``."""
    system = System("strata", "strata", plugins={"auto_sessions": {"min_tokens": 256, "idle_save_s": 0}},
                    cache_ram_mib=0, source=source)
    running = start(system, model, 32768, work)
    spans: dict[str, list[float]] = {}
    try:
        history = {n: [{"role": "user", "content": f"conv {n} " + "lorem ipsum dolor sit amet " * 370}] for n in "ab"}
        for r in range(rounds):
            if workload == "new":
                history["b"] = [{"role": "system", "content": OPENING},
                                {"role": "user", "content": f"session {r}: fix the bug"}]
            for name in "ab":
                answer = requests.post(running.url + "/v1/chat/completions", headers=HEADERS, timeout=600,
                                       json={"messages": history[name], "max_tokens": 1, "temperature": 0})
                answer.raise_for_status()
                history[name] = history[name] + [
                    {"role": "assistant", "content": answer.json()["choices"][0]["message"]["content"]},
                    {"role": "user", "content": f"turn {r} " + "more words here " * 25}]
                if r == 0 or (workload == "new" and name == "a"):
                    continue  # the first round fills the store; in "new", the unrelated chat
                for span, ms in read_server_timing(answer.headers.get("Server-Timing", "")).items():
                    spans.setdefault(span, []).append(ms)
    finally:
        running.stop()
    return {span: statistics.median(values) for span, values in spans.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--before", help="a git revision: strata-serve as it was there, side by side")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="strata-switch-") as tmp:
        work = Path(tmp)
        model = write_demo_model(work / "bench.gguf", size="bench")
        before = checkout(args.before, work / "before") if args.before else None
        try:
            for workload in ("new", "turns"):
                for label, source in ([("before", str(before))] if before else []) + [("this tree", None)]:
                    spans = run(source, workload, args.rounds, model, work / f"{workload}-{label.replace(' ', '-')}")
                    rows.append(f"| {workload} | {label} | " + " | ".join(f"{spans.get(s, 0):.1f}" for s in SPANS) + " |")
        finally:
            if before is not None:
                subprocess.run(["git", "worktree", "remove", "--force", str(before)], check=False)
    table = [f"## {time.strftime('%Y-%m-%d')}: `python -m bench.switch_step --rounds {args.rounds}"
             + (f" --before {args.before}`" if args.before else "`"), "",
             "| workload | strata-serve | " + " | ".join(f"`{s}` ms" for s in SPANS) + " |",
             "|---|---|" + "---|" * len(SPANS), *rows, ""]
    RESULTS.parent.mkdir(exist_ok=True)
    with open(RESULTS, "a") as f:
        f.write("\n".join(table) + "\n")
    print("\n".join(table))


if __name__ == "__main__":
    main()
