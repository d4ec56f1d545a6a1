"""A new conversation that shares a long system prompt, after a restart: with and without prefix restore.

Two conversations open with the same long system prompt and ask different first
questions; the server is idle long enough to park them; the engine process is killed and
strata-serve brings it back; then a third conversation with the same system prompt and a
question of its own arrives. Its time to first token, and how many tokens the engine read
for it, with the ``prefix_restore`` plugin enabled and disabled
(``plugins.prefix_restore.enabled``). When that plugin is not installed, only the second
is measured and the table says so.
"""

from __future__ import annotations

import time
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any


from bench.systems import System, start
from bench.workloads import stream, text

PLUGIN = "prefix_restore"


def installed() -> bool:
    return any(e.name == PLUGIN for e in entry_points(group="strata_serve"))


def wait_parked(running: Any, files: int, deadline_s: float = 120) -> None:
    """Until auto-sessions has ``files`` session files (the idle save included)."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        numbers = ((running.stats() or {}).get("plugins") or {}).get("auto_sessions") or {}
        if numbers.get("files_on_disk", 0) >= files and numbers.get("idle_saves", 0) >= 1:
            return
        time.sleep(0.1)
    raise RuntimeError(f"auto-sessions did not park {files} conversations within {deadline_s:.0f} s")


def one(model: Path, work: Path, prompt_tokens: int, enabled: bool | None, real: bool) -> dict[str, Any]:
    plugins: dict[str, Any] = {"auto_sessions": {"min_tokens": 256, "idle_save_s": 0.5}}
    if enabled is not None:
        plugins[PLUGIN] = {"enabled": enabled}
    system = System("strata", "strata", cache_ram_mib=0, plugins=plugins)
    shared = text("Everyone's long instructions", prompt_tokens, real)
    running = start(system, model, prompt_tokens * 2 + 1024, work)
    try:
        for who in ("Ada", "Ben"):
            stream(running.url, "/v1/chat/completions",
                   {"messages": [{"role": "system", "content": shared},
                                 {"role": "user", "content": f"{who}'s first question?"}], "max_tokens": 4})
        wait_parked(running, 2)
        running.restart_engine()
        began = time.perf_counter()
        first, timings, _ = stream(running.url, "/v1/chat/completions",
                                   {"messages": [{"role": "system", "content": shared},
                                                 {"role": "user", "content": "Cy's first question?"}],
                                    "max_tokens": 4})
        return {"ttft_s": first - began, "prompt_n": int(timings.get("prompt_n", 0)),
                "cache_n": int(timings.get("cache_n", 0))}
    finally:
        running.stop()


def prefix_after_restart(model: Path, work: Path, prompt_tokens: int, repeats: int, real: bool = False,
                         name: str = "bench") -> dict[str, Any]:
    found: dict[str, Any] = {"prompt_tokens": prompt_tokens, "installed": installed(), "with": [], "without": [],
                             "model": name}
    for repeat in range(repeats):
        for label, enabled in (("without", False), ("with", True)):
            if not found["installed"]:
                if label == "with":
                    continue
                enabled = None
            found[label].append(one(model, work / f"prefix-{label}-{repeat}", prompt_tokens, enabled, real))
            print(f"  prefix restore {label}: {found[label][-1]}", flush=True)
    return found


def report(found: dict[str, Any], spread: Any) -> list[str]:
    lines = [
        "",
        f"## A new conversation sharing a {found['prompt_tokens']:,}-token system prompt, after a restart "
        f"({found['model']} model)",
        "",
        "Two conversations with that system prompt are parked (the engine's RAM cache is off), the engine is",
        "killed and brought back, then a third conversation with the same system prompt asks its first",
        "question: its time to first token and what the engine read for it.",
        "",
        "| prefix restore | first token s | tokens read (prompt_n) | tokens reused (cache_n) |",
        "|---|---|---|---|",
    ]
    for label in ("without", "with"):
        runs = found[label]
        if not runs:
            lines.append(f"| {label} | not installed (the `{PLUGIN}` plugin) | | |")
            continue
        lines.append(f"| {label} | {spread([r['ttft_s'] for r in runs])} | {runs[-1]['prompt_n']:,} "
                     f"| {runs[-1]['cache_n']:,} |")
    return lines
