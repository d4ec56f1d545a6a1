"""The agent workload, run against every system side by side: ``bench.run`` calls :func:`agent_comparison`.

Four agents at once, as coding agents work: each grows a main context in steps (two turns
a step: a question, then a tool result), runs a short sub-agent context between steps, and
returns to its main context; each step also sends one short side request without a
conversation (``/v1/completions``: a title, a classification). Clients stream with
``requests`` and close the connection as soon as they have read the last event (the one
with the engine's timings), before ``[DONE]``. Halfway (every agent has finished half its
steps) the engine process is killed and the system brought back, the same moment for every
system. A variant opens every main context with the same long system prompt.

Measured per run, from the client and the engine's own timings:

- wall time, from the first request to the last answer (the restart included);
- returning turns: every main-context turn after its first; a switch-back is the first
  main turn after the agent's sub-agent ran (another context used the engine in between);
  time to first token of each;
- tokens re-read: for each returning turn, the part of the context the engine held at the
  previous turn that it did not reuse this time (``held - cache_n``); and the plain sum of
  ``prompt_n`` of returning turns (new tokens included, the same for every system);
- bytes written to the slot (or snapshot) directory: every version of every file written,
  followed by inode, polled every 50 ms; per request;
- requests in flight per second (client side), and the engine's busy slots (``GET /slots``,
  polled every 0.5 s);
- for strata-serve: from ``/stats``, the share of switches whose outgoing conversation's file
  was already current (saved while idle), so the switch was a restore alone.
"""

from __future__ import annotations

import json
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any
from collections.abc import Callable

import requests

from bench.harness import BENCH_ENGINE_KEY, percentile, spread
from bench.systems import System, hearth_installed, start

HEADERS = {"Authorization": f"Bearer {BENCH_ENGINE_KEY}"}
SPARK = "▁▂▃▄▅▆▇█"


# -- what the clients send ---------------------------------------------------------------------

ANIMALS = ["fox", "owl", "heron", "badger", "otter", "lynx", "crane", "beaver", "hare", "wren", "stoat"]
PLACES = ["river", "forest", "valley", "harbour", "meadow", "ridge", "marsh", "village", "orchard", "quarry"]


def text(name: str, tokens: int, real: bool) -> str:
    """About ``tokens`` tokens of text about ``name``.

    The demo models' vocabulary reads one token per character; a real model's tokenizer
    about 18 tokens per sentence of this journal (measured on SmolLM2).
    """
    if not real:
        unit = f" {name} sails the northern sea;"
        return (unit * (tokens // len(unit) + 1))[:tokens]
    sentences = [f"{name}: on day {n + 1} the {ANIMALS[(n + len(name)) % 11]} went to the "
                 f"{PLACES[(n * 3 + len(name)) % 10]} and counted {(n * 7 + len(name)) % 13 + 2} stones."
                 for n in range(max(1, tokens // 18))]
    return " ".join(sentences)


@dataclass(frozen=True)
class Workload:
    """The shape of one agent workload run.

    :param opening: tokens of each main context's first user message.
    :param grow: tokens each main turn adds (a question, or a tool result).
    :param sub: tokens of a sub-agent context.
    :param system_prompt: tokens of a system prompt every main context opens with (0: none).
    """

    agents: int = 4
    steps: int = 4
    opening: int = 1024
    grow: int = 128
    sub: int = 256
    side: int = 32
    max_tokens: int = 4
    system_prompt: int = 0
    real: bool = False
    #: Longest silence a client waits for (a queue behind the other agents' prefills
    #: included); a request still unanswered then is counted as stalled and sent once
    #: more, as a client would. (Through hearth-llm a side request sometimes waits in the
    #: engine until another request arrives.)
    stall_s: float = 60


@dataclass
class Turn:
    agent: int
    kind: str  # main | sub | side
    began: float
    first: float
    ended: float
    prompt_n: int = 0
    cache_n: int = 0
    returning: bool = False
    switch_back: bool = False
    after_restart: bool = False
    #: Tokens of this context the engine held at its previous turn (main turns).
    held_before: int = 0


def stream(url: str, path: str, body: dict[str, Any], stall_s: float = 600) -> tuple[float, dict[str, Any], str]:
    """Stream one answer; return (time of the first token, timings, text), closing at the timings."""
    pieces: list[str] = []
    first = None
    with requests.post(url + path, json={**body, "stream": True, "temperature": 0}, headers=HEADERS, stream=True,
                       timeout=(10, stall_s)) as reply:
        if reply.status_code != 200:
            raise RuntimeError(f"{url}{path}: HTTP {reply.status_code}: {reply.text[:500]}")
        for line in reply.iter_lines():
            if not line.startswith(b"data:") or line[5:].strip() == b"[DONE]":
                continue
            event = json.loads(line[5:])
            for choice in event.get("choices") or []:
                piece = (choice.get("delta") or {}).get("content") or choice.get("text") or ""
                if piece:
                    pieces.append(piece)
                    if first is None:
                        first = time.perf_counter()
            if "timings" in event:
                return first or time.perf_counter(), event["timings"], "".join(pieces)
    raise RuntimeError(f"{url}{path}: the stream ended without timings")


class Agent:
    def __init__(self, n: int, url: Callable[[], str], shape: Workload, system_text: str | None,
                 halfway: threading.Barrier, turns: list[Turn], restarted: threading.Event,
                 errors: list[str]) -> None:
        self.n, self.url, self.shape, self.errors = n, url, shape, errors
        self.halfway, self.turns, self.restarted = halfway, turns, restarted
        opening = text(f"Agent{n} main", shape.opening, shape.real)
        self.main = ([{"role": "system", "content": system_text}] if system_text else []) + \
            [{"role": "user", "content": opening}]
        self.held = 0
        self.main_turns = 0

    def request(self, kind: str, path: str, body: dict[str, Any], **marks: Any) -> tuple[Turn, str]:
        began = time.perf_counter()
        body = {**body, "max_tokens": self.shape.max_tokens}
        try:
            first, timings, answer = stream(self.url(), path, body, self.shape.stall_s)
        except (requests.RequestException, RuntimeError) as exc:
            self.errors.append(f"{kind}: {exc}"[:300])
            first, timings, answer = stream(self.url(), path, body, self.shape.stall_s)
        turn = Turn(self.n, kind, began, first, time.perf_counter(), int(timings.get("prompt_n", 0)),
                    int(timings.get("cache_n", 0)), after_restart=self.restarted.is_set(), **marks)
        self.turns.append(turn)
        return turn, answer

    def main_turn(self, switch_back: bool, question: str) -> None:
        turn, answer = self.request("main", "/v1/chat/completions", {"messages": self.main},
                                    returning=self.main_turns > 0, switch_back=switch_back,
                                    held_before=self.held)
        self.held = turn.cache_n + turn.prompt_n
        self.main_turns += 1
        self.main = self.main + [{"role": "assistant", "content": answer}, {"role": "user", "content": question}]

    def run(self) -> None:
        shape, name = self.shape, f"Agent{self.n}"
        for step in range(shape.steps):
            if step == shape.steps // 2:
                self.halfway.wait()
            self.main_turn(step > 0, text(f"{name} asks {step}", shape.grow, shape.real))
            self.main_turn(False, text(f"{name} tool result {step}", shape.grow, shape.real))
            self.request("sub", "/v1/chat/completions",
                         {"messages": [{"role": "user", "content": text(f"{name} sub-agent {step}", shape.sub,
                                                                        shape.real)}]})
            self.request("side", "/v1/completions",
                         {"prompt": text(f"{name} side {step}", shape.side, shape.real)})


class DiskWrites:
    """Bytes written to a directory: every version of every matching file, followed by inode."""

    def __init__(self, directory: Path, patterns: tuple[str, ...], every_s: float = 0.05) -> None:
        self.directory, self.patterns, self.every_s = directory, patterns, every_s
        self.seen: dict[int, tuple[int, int]] = {}
        self.written = 0
        self._stop = threading.Event()
        self.poll()  # what is there before the run is not counted
        self.written = 0
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def poll(self) -> None:
        names = {p for pattern in self.patterns for p in self.directory.glob(pattern)} \
            if self.directory.exists() else set()
        for path in names:
            try:
                stat = path.stat()
            except OSError:
                continue
            before = self.seen.get(stat.st_ino)
            if before is None:
                self.written += stat.st_size
            elif stat.st_mtime_ns != before[0]:
                # The same file grew (seen mid-write), or was written again from the start.
                self.written += stat.st_size - before[1] if stat.st_size > before[1] else stat.st_size
            self.seen[stat.st_ino] = (stat.st_mtime_ns, stat.st_size)

    def _loop(self) -> None:
        while not self._stop.wait(self.every_s):
            self.poll()

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        self.poll()
        return self.written

    def on_disk(self) -> int:
        return sum(p.stat().st_size for pattern in self.patterns for p in self.directory.glob(pattern)
                   if p.is_file()) if self.directory.exists() else 0


class BusySlots:
    """The engine's slots that are processing, from ``GET /slots`` every ``every_s``."""

    def __init__(self, url: Callable[[], str], every_s: float = 0.5) -> None:
        self.url, self.every_s = url, every_s
        self.samples: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                reply = requests.get(self.url() + "/slots", headers=HEADERS, timeout=5)
                if reply.status_code == 200:
                    busy = sum(1 for slot in reply.json() if slot.get("is_processing"))
                    self.samples.append((time.perf_counter(), busy))
            except (requests.RequestException, ValueError, AttributeError):
                continue

    def stop(self) -> list[tuple[float, int]]:
        self._stop.set()
        self._thread.join()
        return self.samples


def per_second(turns: list[Turn], busy: list[tuple[float, int]], began: float, ended: float) -> dict[str, list]:
    """Requests in flight (client side, most at once in each second) and busy slots (most seen)."""
    seconds = max(1, int(ended - began) + 1)
    in_flight = [0] * seconds
    for second in range(seconds):
        lo, hi = began + second, began + second + 1
        points = [lo] + [t.began for t in turns if lo <= t.began < hi]
        in_flight[second] = max(sum(1 for t in turns if t.began <= p < t.ended) for p in points)
    slots = [0] * seconds
    for at, count in busy:
        second = int(at - began)
        if 0 <= second < seconds:
            slots[second] = max(slots[second], count)
    return {"in_flight": in_flight, "busy_slots": slots}


def run_once(system: System, model: Path, shape: Workload, work: Path) -> dict[str, Any]:
    """One run of the workload against ``system``: started fresh, restarted halfway, stopped."""
    ctx = shape.system_prompt + shape.opening + shape.steps * 2 * (shape.grow + shape.max_tokens + 16) + 512
    if shape.real:
        ctx = int(ctx * 1.3)
    running = start(system, model, ctx, work)
    turns: list[Turn] = []
    errors: list[str] = []
    restarted = threading.Event()
    restart_s: list[float] = []

    def restart() -> None:
        began = time.perf_counter()
        running.restart_engine()
        restart_s.append(time.perf_counter() - began)
        restarted.set()

    try:
        halfway = threading.Barrier(shape.agents, action=restart)
        system_text = text("Everyone's shared instructions", shape.system_prompt, shape.real) \
            if shape.system_prompt else None
        disk = DiskWrites(running.slot_dir, running.file_patterns)
        busy = BusySlots(lambda: running.url)
        cpu_before = running.layer_cpu_s()
        began = time.perf_counter()
        agents = [Agent(n, lambda: running.url, shape, system_text, halfway, turns, restarted, errors)
                  for n in range(shape.agents)]
        with ThreadPoolExecutor(shape.agents) as pool:
            for done in [pool.submit(agent.run) for agent in agents]:
                done.result()
        ended = time.perf_counter()
        written = disk.stop()
        samples = busy.stop()
        stats = running.stats()
        on_disk = disk.on_disk()
        cpu_after = running.layer_cpu_s()
        layer_cpu_s = cpu_after - cpu_before if cpu_before is not None and cpu_after is not None else None
    finally:
        running.stop()
    return {
        "wall_s": ended - began,
        "restart_s": restart_s[0] if restart_s else None,
        "turns": [asdict(t) | {"began": t.began - began, "first": t.first - began, "ended": t.ended - began}
                  for t in turns],
        "errors": errors,
        "bytes_written": written,
        "bytes_on_disk": on_disk,
        "timeline": per_second(turns, samples, began, ended),
        "auto_sessions": ((stats or {}).get("plugins") or {}).get("auto_sessions"),
        # strata-serve's own spans (strata_serve.timing) and CPU, and the engine's RAM-cache work
        "phases": (stats or {}).get("phases"),
        "layer_cpu_s": layer_cpu_s,
        "ram_cache_ms": running.ram_cache_ms(),
    }


# -- the comparison ---------------------------------------------------------------------------

def systems(limited_mib: int, min_tokens: int, with_hearth: bool = True) -> list[System]:
    """Every setup of the comparison, in the order of the table."""
    auto = {"auto_sessions": {"min_tokens": min_tokens}}
    found = [
        System("llama-server, RAM cache default", "bare", "bare-default"),
        System(f"llama-server, RAM cache {limited_mib} MiB", "bare", "bare-limited", cache_ram_mib=limited_mib),
        System("llama-server, RAM cache off", "bare", "bare-off", cache_ram_mib=0),
        System("llama-server -np 4, RAM cache default", "bare", "bare-np4", parallel=4),
        System("strata + auto-sessions, RAM cache default", "strata", "strata-default", plugins=auto),
        System(f"strata + auto-sessions, RAM cache {limited_mib} MiB", "strata", "strata-limited",
               cache_ram_mib=limited_mib, plugins=auto),
        System("strata + auto-sessions, RAM cache off", "strata", "strata-off", cache_ram_mib=0, plugins=auto),
        System("strata -np 4 + auto-sessions, RAM cache default", "strata", "strata-np4", parallel=4,
               plugins=auto),
    ]
    if with_hearth:
        found.append(System("hearth-llm (its defaults: -np 1, RAM cache default)", "hearth", "hearth"))
    return found


def agent_comparison(model: Path, work: Path, *, shape: Workload, variants: dict[str, Workload] | None = None,
                     repeats: int, limited_mib: int, min_tokens: int, label: str,
                     only: list[str] | None = None, chosen: list[System] | None = None) -> dict[str, Any]:
    """Every system (or those whose key is in ``only``; or the systems ``chosen``), every
    variant, ``repeats`` rounds; the order of the systems turns each round, so the machine's
    noise spreads over all of them."""
    variants = variants or {"agents": shape}
    if chosen is None:
        chosen = [s for s in systems(limited_mib, min_tokens, with_hearth=hearth_installed())
                  if only is None or s.key in only]
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {v: {s.name: [] for s in chosen} for v in variants}
    for repeat in range(repeats):
        order = chosen[repeat % len(chosen):] + chosen[:repeat % len(chosen)]
        for variant, variant_shape in variants.items():
            for system in order:
                slug = f"{label}-{variant}-{chosen.index(system)}-{repeat}"
                found = run_once(system, model, variant_shape, work / slug)
                runs[variant][system.name].append(found)
                summary = summarize([found])
                print(f"  {label}, {variant}, {system.name}: wall {found['wall_s']:.1f} s, re-read "
                      f"{summary['reread_tokens']:,.0f} tokens, written {found['bytes_written'] / 1e6:.0f} MB",
                      flush=True)
    return {
        "label": label,
        "settings": {"repeats": repeats, "limited_mib": limited_mib, "min_tokens": min_tokens,
                     "variants": {v: asdict(s) for v, s in variants.items()}},
        "systems": {s.name: asdict(s) for s in chosen},
        "hearth": hearth_installed(),
        "summary": {v: {name: summarize(found) for name, found in by_system.items()}
                    for v, by_system in runs.items()},
        "timelines": {v: {name: found[-1]["timeline"] for name, found in by_system.items() if found}
                      for v, by_system in runs.items()},
        "runs": runs,
    }


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One system's figures over its repeats: wall times each, the rest pooled or per run."""
    returning = [t for r in runs for t in r["turns"] if t["returning"]]
    switch_back = [t for t in returning if t["switch_back"]]
    requests_n = sum(len(r["turns"]) for r in runs)
    reread = [sum(max(0, t["held_before"] - t["cache_n"]) for t in r["turns"] if t["returning"]) for r in runs]
    prompt = [sum(t["prompt_n"] for t in r["turns"] if t["returning"]) for r in runs]
    after_restart = [t for t in returning if t["after_restart"]]
    auto = [r["auto_sessions"] for r in runs if r.get("auto_sessions")]
    current = None
    if auto:
        skipped = sum(a.get("save_skips_unchanged", 0) for a in auto)
        at_switch = sum(a.get("saves", 0) - a.get("idle_saves", 0) for a in auto)
        current = {"current": skipped, "switches": skipped + at_switch, "idle_saves": sum(a.get("idle_saves", 0)
                                                                                          for a in auto),
                   "restores": sum(a.get("restores", 0) for a in auto)}
    ttft = [t["first"] - t["began"] for t in returning]
    back = [t["first"] - t["began"] for t in switch_back]
    return {
        "wall_s": [r["wall_s"] for r in runs],
        "restart_s": [r["restart_s"] for r in runs if r["restart_s"] is not None],
        "reread_tokens": statistics.median(reread) if reread else 0,
        "reread_runs": reread,
        "prompt_n_returning": statistics.median(prompt) if prompt else 0,
        "reread_after_restart": statistics.median(
            [sum(max(0, t["held_before"] - t["cache_n"]) for t in r["turns"] if t["returning"] and t["after_restart"])
             for r in runs]) if runs else 0,
        "returning": len(returning) // max(1, len(runs)),
        "after_restart": len(after_restart) // max(1, len(runs)),
        "bytes_per_request": sum(r["bytes_written"] for r in runs) / max(1, requests_n),
        "bytes_on_disk": statistics.median([r["bytes_on_disk"] for r in runs]) if runs else 0,
        "ttft_p50": percentile(ttft, 50) if ttft else None, "ttft_p95": percentile(ttft, 95) if ttft else None,
        "back_p50": percentile(back, 50) if back else None, "back_p95": percentile(back, 95) if back else None,
        "file_current": current,
        "errors": sum(len(r.get("errors") or []) for r in runs),
    }


# -- the report -------------------------------------------------------------------------------

#: A sparkline longer than this many seconds shows the most of each group of seconds.
SPARK_WIDTH = 60


def sparkline(values: list[int], top: int) -> str:
    step = max(1, -(-len(values) // SPARK_WIDTH))
    values = [max(values[i:i + step]) for i in range(0, len(values), step)]
    return "".join(SPARK[min(len(SPARK) - 1, round(v / max(1, top) * (len(SPARK) - 1)))] for v in values)


def _bytes(value: float) -> str:
    return f"{value / 1e6:,.1f} MB" if value >= 1e6 else f"{value / 1e3:,.0f} KB"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:,.0f}"


def report(found: dict[str, Any], model_name: str) -> list[str]:
    settings = found["settings"]
    lines: list[str] = []
    for variant, shape in settings["variants"].items():
        summary = found["summary"][variant]
        prompt = f", every main context opening with the same {shape['system_prompt']:,}-token system prompt" \
            if shape["system_prompt"] else ""
        lines += [
            "",
            f"## Agents at work, {model_name}: {variant}",
            "",
            f"{shape['agents']} agents at once, {shape['steps']} steps each: two main-context turns a step (a main "
            f"context opening at {shape['opening']:,} tokens and growing {shape['grow']:,} tokens a turn{prompt}), a "
            f"{shape['sub']:,}-token sub-agent context and a {shape['side']}-token side request without a "
            f"conversation (`/v1/completions`); the engine process is killed halfway and brought back. "
            f"{settings['repeats']} rounds, the systems in turn; wall time is the median (min-max) of the rounds, "
            "the rest pooled over them. Auto-sessions runs with "
            f"`min_tokens = {settings['min_tokens']}`; the limited RAM cache is {settings['limited_mib']} MiB. "
            "Every system runs one slot unless its name says `-np 4`, which runs four slots and four times the "
            "context: the bare engine over one KV buffer (`--kv-unified`, as its own default does), strata-serve "
            "as it starts the engine (`-np 4` alone: a buffer per slot, which the engine never empties itself).",
            "",
            "Tokens re-read: of the context each main turn held at its previous turn, what the engine read "
            "again (the engine's `cache_n`). Written: every version of every slot or snapshot file, per request "
            "(and what is on disk at the end). Restart: from the kill to the system answering again.",
            "",
            "| system | wall s | restart s | tokens re-read (after the restart) | prompt_n of returning turns "
            "| written per request (on disk) | first token of a return p50 / p95 ms | switch-back p50 / p95 ms "
            "| switches with the file current |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for name, v in summary.items():
            current = v["file_current"]
            share = "-" if not current else (f"{current['current']} of {current['switches']}"
                                             if current["switches"] else "no switch parked")
            errors = f" ({v['errors']} requests stalled past {shape['stall_s']:g} s and were sent again)" \
                if v["errors"] else ""
            restart = spread(v["restart_s"], 2) if v["restart_s"] else "-"
            lines.append(
                f"| {name}{errors} | {spread(v['wall_s'], 1)} | {restart} "
                f"| {v['reread_tokens']:,.0f} ({v['reread_after_restart']:,.0f}) "
                f"| {v['prompt_n_returning']:,.0f} | {_bytes(v['bytes_per_request'])} ({_bytes(v['bytes_on_disk'])}) "
                f"| {_ms(v['ttft_p50'])} / {_ms(v['ttft_p95'])} | {_ms(v['back_p50'])} / {_ms(v['back_p95'])} "
                f"| {share} |")
        lines += ["", f"Requests in flight over the last round, most at once (client side, {SPARK[0]} 0 to "
                  f"{SPARK[-1]} {shape['agents']}), and the engine's busy slots (`GET /slots` every 0.5 s, {SPARK[0]} 0 "
                  f"to {SPARK[-1]} 4); one mark a second, or a group of seconds in a run longer than {SPARK_WIDTH} s:",
                  "", "| system | seconds | in flight | busy slots |", "|---|---|---|---|"]
        for name, timeline in found["timelines"][variant].items():
            lines.append(f"| {name} | {len(timeline['in_flight'])} | `{sparkline(timeline['in_flight'], shape['agents'])}` "
                         f"| `{sparkline(timeline['busy_slots'], 4)}` |")
    if not found["hearth"]:
        lines += ["", "hearth-llm is not installed here (`pip install -e '.[bench]'`): its row is missing."]
    return lines
