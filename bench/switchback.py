"""Switching back to a long conversation: A, then B, then back to A, per conversation size.

Time to first token on each return, against the bare engine with its RAM cache off (a full
re-read). strata-serve with auto-sessions and the RAM cache off is measured twice in the
same run: returning at once (the outgoing conversation is saved on the way: save, then
restore) and returning after the server was idle long enough to save the outgoing
conversation (its file is current: the switch is a restore alone). A control row gives
the floor any layer can reach: the bare engine returning to the conversation it still holds
in its slot (no switch at all), which reads only the returning turn's new tokens.

That floor runs minutes before or after the setups it is set against, and the machine's
speed moves by more than the goal's margin in that time. So the default setup (in blocks)
also takes its own floor in every round: right after A's return made at once, A's next
turn with nothing in between (no switch), the two a pair; their ratio comes with a 90%
interval (the rounds resampled, each keeping its pair).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

from bench.harness import (bare_engine, chat, client_session, conversation, follow_up, paired_ratio, ratio_interval,
                           spread, strata)

#: name: (strata-serve?, engine RAM cache MiB: 0 off, None the engine's default)
SETUPS = {
    "llama-server, RAM cache off": (False, 0),
    "llama-server, no switch (A still in the slot)": (False, 0),
    "strata + auto-sessions, RAM cache off": (True, 0),
    "strata + auto-sessions in blocks, RAM cache off": (True, 0),
    "llama-server, RAM cache on": (False, None),
    "strata + auto-sessions, RAM cache on": (True, None),
}
BARE_OFF = "llama-server, RAM cache off"
#: The control: A's next turn right after its previous one, nothing in between. The engine
#: reads the new tokens over the KV it holds; no layer can return faster than this.
HELD = "llama-server, no switch (A still in the slot)"
#: Parking whole files (``blocks = false``, set here so that it stays the whole files'
#: measure whatever the default), beside BLOCKS_OFF.
PARKED_OFF = "strata + auto-sessions, RAM cache off"
#: The returns of PARKED_OFF made after an idle save: the outgoing file was current.
FILE_CURRENT = "strata + auto-sessions, RAM cache off, file current"
#: Parking in blocks (the engine's saves staged in memory, the newest states kept whole
#: there): returning at once, the outgoing save writes only its new blocks.
BLOCKS_OFF = "strata + auto-sessions in blocks, RAM cache off"
#: The returns of BLOCKS_OFF made after an idle save: the outgoing state was current (in
#: blocks, and kept whole in memory), so the switch is a restore alone, as FILE_CURRENT's.
BLOCKS_CURRENT = "strata + auto-sessions in blocks, RAM cache off, file current"
#: Each setup whose returns are made again after an idle save, and that row's name.
CURRENT_OF = {PARKED_OFF: FILE_CURRENT, BLOCKS_OFF: BLOCKS_CURRENT}
#: auto-sessions' settings per setup, beyond those every strata setup has.
PLUGIN_SETTINGS = {PARKED_OFF: {"blocks": False}, BLOCKS_OFF: {"blocks": True}}
#: How long strata-serve waits idle before saving the held conversation, here.
IDLE_SAVE_S = 0.5
#: The RAM-cache-on setups run up to this size only (a full run's sizes go far beyond it).
RAM_ON_UP_TO = 2048
#: The second conversation of the bare engine with its RAM cache off: its size changes
#: nothing there (any other prompt evicts A, whose return is a full re-read), so it is short.
SHORT_B = 256


async def auto_sessions_stats(session: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    """Auto-sessions' counters, from strata-serve's ``/stats``."""
    async with session.get(url + "/stats") as reply:
        found = await reply.json()
    return (found.get("plugins") or {}).get("auto_sessions") or {}


async def idle_saves(session: aiohttp.ClientSession, url: str) -> int:
    return int((await auto_sessions_stats(session, url)).get("idle_saves", 0))


async def wait_idle_save(session: aiohttp.ClientSession, url: str, before: int, deadline_s: float = 120) -> None:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if await idle_saves(session, url) > before:
            return
        await asyncio.sleep(0.05)
    raise RuntimeError(f"strata-serve made no idle save within {deadline_s:.0f} s")


async def one_setup(name: str, model: Path, work: Path, size: int, rounds: int) -> dict[str, Any]:
    through_strata, cache = SETUPS[name]
    a = conversation("Alice", size)
    b = conversation("Bob", SHORT_B if name == BARE_OFF else size)
    slot_dir = work / f"switch-{size}-{list(SETUPS).index(name)}"  # each setup starts with no files
    if through_strata:
        plugins = {"auto_sessions": {"min_tokens": 256, "idle_save_s": IDLE_SAVE_S, **PLUGIN_SETTINGS.get(name, {})}}
        # One slot, as the bare engine here: B takes A's slot, and the switch is what is measured
        # (with a side slot, a B that fits beside A would leave A in its slot: no switch).
        setup = strata(model, size * 2 + 512, slot_dir, cache, plugins=plugins, engine={"side_slot_tokens": 0})
    else:
        setup = bare_engine(model, size * 2 + 512, slot_dir, cache)
    found: dict[str, Any] = {}
    async with setup as url, client_session() as session:
        first_a = await chat(session, url, a)
        history = {"a": follow_up(a, first_a.text, "Question 0?")}
        if name != HELD:
            first_b = await chat(session, url, b)
            history["b"] = follow_up(b, first_b.text, "Question 0?")
        returns: dict[str, list[Any]] = {"now": [], "current": [], "held": []}
        #: The engine's restore alone, per return (auto-sessions' ``restore_ms``, from /stats).
        restores_ms: dict[str, list[float]] = {"now": [], "current": [], "held": []}

        async def back(which: str, n: int, kind: str) -> None:
            before = await auto_sessions_stats(session, url) if through_strata else {}
            reply = await chat(session, url, history[which])
            returns[kind].append(reply)
            history[which] = follow_up(history[which], reply.text, f"Question {n + 1}?")
            if through_strata:
                after = await auto_sessions_stats(session, url)
                if after.get("restores", 0) - before.get("restores", 0) == 1:
                    restores_ms[kind].append(after["restore_ms"] - before["restore_ms"])

        for n in range(rounds):
            if name == HELD:
                await back("a", n, "now")  # A again, B never came
                continue
            if name == BARE_OFF:
                # Only A is long: return to it, with B's short turn in between.
                await back("a", n, "now")
                await chat(session, url, history["b"])
                continue
            await back("a", n, "now")
            if name == BLOCKS_OFF:
                await back("a", n, "held")  # this round's own floor: A again, no switch
            await back("b", n, "now")
            if name in CURRENT_OF:
                for which in ("a", "b"):
                    saved = await idle_saves(session, url)
                    await wait_idle_save(session, url, saved)
                    await back(which, n, "current")
    files = list(slot_dir.glob("auto-*.bin")) if slot_dir.exists() else []
    found[name] = {
        "first_prefill_s": first_a.ttft_s, "returns_s": [r.ttft_s for r in returns["now"]],
        "cache_n": [r.timings.get("cache_n", 0) for r in returns["now"]],
        "file_mb": max((f.stat().st_size for f in files), default=0) / 1e6,
        "restore_ms": restores_ms["now"],
    }
    if returns["held"]:
        # Each round's at-once return of A (the first of the round's two) and A's next turn.
        found[name]["a_returns_s"] = [r.ttft_s for r in returns["now"][0::2]]
        found[name]["held_s"] = [r.ttft_s for r in returns["held"]]
        found[name]["held_restores"] = len(restores_ms["held"])  # none: A was still in the slot
    if returns["current"]:
        found[CURRENT_OF[name]] = {
            "first_prefill_s": first_a.ttft_s, "returns_s": [r.ttft_s for r in returns["current"]],
            "cache_n": [r.timings.get("cache_n", 0) for r in returns["current"]],
            "file_mb": found[name]["file_mb"], "restore_ms": restores_ms["current"],
        }
    return found


async def switch_back(model: Path, work: Path, sizes: list[int], rounds: int,
                      ram_on_up_to: int | None = None) -> dict[str, Any]:
    """Every setup at each size (the RAM-cache-on setups up to ``ram_on_up_to`` tokens only)."""
    found: dict[str, Any] = {}
    for size in sizes:
        for name in SETUPS:
            if SETUPS[name][1] is None and ram_on_up_to is not None and size > ram_on_up_to:
                continue
            # The bare engine's returns are full re-reads, and the control's cost little: two
            # of them give the spread.
            repeats = max(2, rounds) if name in (BARE_OFF, HELD) else rounds
            for setup, figures in (await one_setup(name, model, work, size, repeats)).items():
                found.setdefault(str(size), {})[setup] = figures
                print(f"  switch-back {size} tokens, {setup}: {spread(figures['returns_s'])} s, "
                      f"cache_n {figures['cache_n']}", flush=True)
    return found


def report(results: dict[str, Any]) -> list[str]:
    lines = [
        "## Switching back: time to first token on returning to a conversation (bench model)",
        "",
        "A, then B, then back and forth; each return adds one short question. Ratio: against",
        "the bare engine with its RAM cache off, which re-reads the whole prompt (its B is short:",
        "any other prompt evicts A). The file-current row: the same server, each return made after",
        f"it was idle for {IDLE_SAVE_S:g} s and saved the outgoing conversation then, so the switch is a restore alone.",
        "The no-switch row is the floor: A's next turn right after its previous one, on the bare engine,",
        "which reads only the turn's new tokens over the KV it still holds.",
        "",
        "| tokens | setup | first prefill s | return s | ratio | cache_n on return |",
        "|---|---|---|---|---|---|",
    ]
    for size, setups in results.items():
        full = statistics.median(setups[BARE_OFF]["returns_s"])
        for name, v in setups.items():
            ratio = full / statistics.median(v["returns_s"])
            lines.append(f"| {size} | {name} | {v['first_prefill_s']:.2f} | {spread(v['returns_s'])} | "
                         f"{ratio:.1f}x faster | {min(v['cache_n'])}-{max(v['cache_n'])} |")
    sizes = [int(s) for s in results if FILE_CURRENT in results[s]]
    if sizes:
        size = str(8192 if 8192 in sizes else max(sizes))
        full = statistics.median(results[size][BARE_OFF]["returns_s"])
        current = statistics.median(results[size][FILE_CURRENT]["returns_s"])
        now = statistics.median(results[size][PARKED_OFF]["returns_s"])
        sentence = (f"At {size} tokens, a switch back with the outgoing conversation's file current took "
                    f"{current:.3f} s against a re-read of {full:.3f} s ({full / current:.0f}x; the goal is 100x on "
                    f"the bench model); returning at once, with its save on the way, {now:.3f} s ({full / now:.0f}x).")
        restore_ms = results[size][FILE_CURRENT].get("restore_ms") or []
        if restore_ms:
            sentence += (f" The restore itself took {statistics.median(restore_ms):.0f} ms "
                         f"(auto-sessions' restore_ms).")
        if HELD in results[size]:
            floor = statistics.median(results[size][HELD]["returns_s"])
            sentence += (f" The bare engine returning to A with nothing in between (no switch: the floor) took "
                         f"{floor:.3f} s ({full / floor:.0f}x faster than the re-read); the file-current return "
                         f"is {current - floor:+.3f} s from that floor ({current / floor:.2f}x its time).")
        if BLOCKS_CURRENT in results[size]:
            in_blocks = statistics.median(results[size][BLOCKS_CURRENT]["returns_s"])
            sentence += (f" Parked in blocks, the file-current return took {in_blocks:.3f} s "
                         f"({in_blocks / current:.2f}x the whole file's).")
        if BLOCKS_OFF in results[size] and HELD in results[size]:
            at_once = statistics.median(results[size][BLOCKS_OFF]["returns_s"])
            floor = statistics.median(results[size][HELD]["returns_s"])
            sentence += (f" In blocks (the default), returning at once, the outgoing save on the way: "
                         f"{at_once:.3f} s, {at_once / floor:.2f}x the no-switch floor.")
            sentence += _own_floor(results[size][BLOCKS_OFF])
        lines += ["", sentence]
    return lines


def _own_floor(figures: dict[str, Any]) -> str:
    """The at-once returns of A against its no-switch turns made in the same rounds (runs
    before they were measured lack them)."""
    at_once, held = figures.get("a_returns_s"), figures.get("held_s")
    if not at_once or not held:
        return ""
    low, high = ratio_interval(at_once, held)
    return (f" Against that server's own no-switch turn of A in each round, right after its return: "
            f"{statistics.median(at_once):.3f} s against {statistics.median(held):.3f} s, "
            f"{paired_ratio(at_once, held):.2f}x (the median of the rounds' ratios; 90% interval "
            f"{low:.2f}-{high:.2f}, {len(held)} rounds).")


def readme_sentence(results: dict[str, Any]) -> str:
    """What the project README says of the largest size (a test checks it against the table)."""
    largest = max(results, key=int)
    rows = results[largest]
    bare = statistics.median(rows[BARE_OFF]["returns_s"])
    parked = statistics.median(rows[PARKED_OFF]["returns_s"])
    return (f"returning to a conversation of {largest} tokens after another one took the bare engine with its "
            f"RAM cache off {bare:.3f} s (a full re-read); with auto-sessions, {parked:.3f} s "
            f"({bare / parked:.1f}x faster).")


def plot(results: dict[str, Any], out: Path) -> str:
    """Return time and session-file size against context length, as ``switch-back.png``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = sorted(int(s) for s in results)
    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for name in [*SETUPS, *CURRENT_OF.values()]:
        points = [(s, statistics.median(results[str(s)][name]["returns_s"])) for s in sizes
                  if name in results[str(s)]]
        if points:
            left.plot(*zip(*points), marker="o", label=name)
    left.set(xlabel="conversation length (tokens)", ylabel="time to first token on return (s)",
             title="Switching back", yscale="log")
    left.legend(fontsize=7)
    right.plot(sizes, [results[str(s)][PARKED_OFF]["file_mb"] for s in sizes], marker="o")
    right.set(xlabel="conversation length (tokens)", ylabel="session file (MB)", title="Session file size")
    figure.tight_layout()
    figure.savefig(out / "switch-back.png", dpi=100)
    plt.close(figure)
    return "switch-back.png"


async def _main(sizes: list[int], rounds: int) -> None:
    from strata_serve.demo_model import write_demo_model

    with tempfile.TemporaryDirectory(prefix="strata-switch-back-") as tmp:
        work = Path(tmp)
        model = write_demo_model(work / "bench.gguf", size="bench")
        results = await switch_back(model, work, sizes, rounds, ram_on_up_to=RAM_ON_UP_TO)
    print("\n".join(report(results)))


def main() -> None:
    """``python -m bench.switchback [--sizes 8192] [--rounds 2]``: the switch-back table alone
    (``make bench`` runs it among the others), on the bench model."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sizes", default="8192", help="conversation lengths, e.g. 2048,8192")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of returns for each setup")
    args = parser.parse_args()
    asyncio.run(_main([int(size) for size in args.sizes.split(",")], args.rounds))


if __name__ == "__main__":
    main()
