"""What the project README says of the measurements, written from one run's figures.

``bench.run`` puts these paragraphs in ``bench/results/README.md``; the project README
quotes them word for word, and ``tests/test_docs.py`` fails when they differ, so no
figure in the README is copied by hand.
"""

from __future__ import annotations

import statistics
from typing import Any

from bench.switchback import FILE_CURRENT, HELD, readme_sentence

HEARTH = "hearth-llm"
STRATA = "strata + auto-sessions"
BARE = "llama-server"


def _rows(results: dict[str, Any], model: str) -> list[dict[str, dict[str, Any]]]:
    """The agent summaries of one model, one per workload variant."""
    return [summary for found in results.get("agents", []) if found["model"] == model
            for summary in found["summary"].values()]


def _mb(value: float) -> str:
    return f"{value / 1e6:.1f}"


def _span(values: list[float], fmt: Any) -> str:
    low, high = fmt(min(values)), fmt(max(values))
    return low if low == high else f"{low}-{high}"


def _switch_back(results: dict[str, Any]) -> str:
    back = results["switch_back"]
    largest = max(back, key=int)
    held = statistics.median(back[largest][HELD]["returns_s"])
    text = (f"On the bench model, {readme_sentence(back)} Most of those seconds are the engine reading the "
            "return's few new tokens after its long context: the bare engine returning to a conversation it "
            f"still holds, with nothing in between, took {held:.3f} s at that size.")
    current = [size for size in back if FILE_CURRENT in back[size]]
    if current:
        size = "8192" if "8192" in current else max(current, key=int)
        current_s = statistics.median(back[size][FILE_CURRENT]["returns_s"])
        floor_s = statistics.median(back[size][HELD]["returns_s"])
        restore = statistics.median(back[size][FILE_CURRENT]["restore_ms"])
        text += (f" The restore itself took {restore:.0f} ms; at {size} tokens, with the outgoing conversation's "
                 f"file already current, a switch back took {current_s:.3f} s, against {floor_s:.3f} s for the "
                 "bare engine returning with no switch at all.")
    return text


def _agents(results: dict[str, Any]) -> str | None:
    bench = _rows(results, "bench model")
    if not bench:
        return None
    first = bench[0]
    bare = {name: row for name, row in first.items() if name.startswith(BARE + ",")}
    strata = [row["reread_tokens"] for summary in bench for name, row in summary.items() if name.startswith(STRATA)]
    reread = ("re-read no token of any returning conversation in every RAM setting" if not any(strata)
              else f"re-read at most {max(strata):,} tokens of returning conversations")
    bare_reread = sorted(int(row["reread_tokens"]) for row in bare.values())
    written = [row["bytes_per_request"] for summary in bench for name, row in summary.items()
               if name.startswith(STRATA) or name.startswith("strata -np")]
    hearth = [row["bytes_per_request"] for summary in bench for name, row in summary.items()
              if name.startswith(HEARTH)]
    text = (f"Four agents at once, the engine killed halfway: strata-serve {reread}, where the bare engine "
            f"re-read {bare_reread[0]:,} to {bare_reread[-1]:,} tokens on the bench model (from its RAM cache at "
            f"its default to the cache off)")
    if hearth:
        text += (f", and wrote {_span(written, _mb)} MB to disk per request against {_span(hearth, _mb)} MB for "
                 f"`hearth-llm`, a proxy that saves after every answer")
    text += "."
    walls = []
    for model, label in (("bench model", "the bench model"), ("SmolLM2-135M", "SmolLM2")):
        rows = _rows(results, model)
        if not rows:
            continue
        summary = rows[0]
        ours = next((row for name, row in summary.items() if name.startswith("strata -np 4")), None)
        theirs = next((row for name, row in summary.items() if name.startswith(BARE + " -np 4")), None)
        if ours and theirs:
            walls.append(f"{statistics.median(ours['wall_s']):.1f} s where "
                         f"{'it' if walls else 'the bare engine'} took "
                         f"{statistics.median(theirs['wall_s']):.1f} s on {label}")
    if walls:
        text += " With four slots (`-np 4`) on each side, strata-serve took " + ", and ".join(walls) + "."
    return text


def _layer(results: dict[str, Any]) -> str | None:
    overhead = results.get("overhead", {})
    tiny = overhead.get("tiny")
    if not tiny:
        return None
    text = (f"What the layer costs: {tiny['stream_added_p50_ms']:.2f} ms at p50 added to a streamed 1-token "
            f"request and {tiny['json_added_p50_ms']:.2f} ms to a plain one, on the tiny model; it streams at "
            f"{tiny['stream_ratio']:.2f}x the engine's own tokens/s there")
    smollm2 = overhead.get("smollm2")
    if smollm2:
        text += f" and at {smollm2['stream_ratio']:.3f}x on SmolLM2, whose tokens take the engine longer"
    text += "."
    found = results.get("profile")
    if found:
        bare, ours = found["stream_added_p50_ms bare relay"], found["stream_added_p50_ms strata"]
        text += (f" A bare aiohttp relay, measured beside it, adds {bare:.2f} ms to the same streamed request "
                 f"against strata-serve's {ours:.2f} ms: most of the cost is the HTTP stack both stand on.")
    return text


def paragraphs(results: dict[str, Any]) -> list[str]:
    """The README's paragraphs about the measurements, each one line."""
    return [text for text in (_switch_back(results), _agents(results), _layer(results)) if text]


def report(results: dict[str, Any]) -> list[str]:
    lines = ["", "## What the project README says", "",
             "Written from this run's figures; the README quotes each paragraph word for word.", ""]
    for text in paragraphs(results):
        lines += [f"> {text}", ">"]
    return lines[:-1]
