"""Whole slot files against blocks: bytes on disk and bytes written per turn (issue #41's figures).

``python -m bench.blocks [--quick] [--out bench/results/blocks.md]``

Against a bare llama-server (one slot, RAM cache off), on the random-weight demo models:

- **Disk**: six sessions sharing a 2,289-token opening, each with ~380 tokens of its own.
  Before: the six whole slot files. After: a block store holding the six states (each
  block once). Both against the distinct tokens (the tokens of the sessions' prefix tree)
  times the state's bytes per token.
- **Writes**: two conversations (6,900 and 2,200 tokens) taking turns, each turn adding
  ~430 tokens. Each turn restores the conversation's state from the store (the joined
  file: ``cache_n`` shows the engine reused it), reads the turn, and saves. Before: the
  whole file the engine writes. After: what the store writes (new blocks, the tail, the
  manifest). Both against the turn's new tokens times bytes per token.

``--parking`` measures the same through strata-serve's own parking (auto-sessions with
``blocks = true`` against ``blocks = false``): disk, writes per save and the switch-back.

Every figure is a ratio measured in the same run as what it is compared with.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path
from typing import Any

from strata_auto_sessions.blocks import BlockStore
from strata_serve.config import EngineSettings
from strata_serve.demo_model import write_demo_model
from strata_serve.engine import LlamaServer
from strata_serve.engine.state_blocks import CutState
from strata_serve.models import packaged_model_path

OPENING_TOKENS = 2289
OWN_TOKENS = 380
SESSIONS = 6
TURN_TOKENS = 430
#: Block sizes of the writes figure (turns are restored from the first).
WRITE_BLOCKS = [64, 256]
#: The two conversations of the writes figure, per model: the issue's sizes where the model's
#: context holds them (the tiny model's is 4,096 tokens, so its pair is smaller).
CONVERSATIONS = {"tiny": {"long": 2400, "short": 800}, "bench": {"long": 6900, "short": 2200},
                 "smollm2": {"long": 6000, "short": 2200}}
#: Characters of the bench's text per token: the demo models read one token a character.
CHARS_PER_TOKEN = {"smollm2": 2.9}
WORDS = ["fox", "owl", "heron", "badger", "otter", "lynx", "crane", "beaver", "hare", "wren", "stoat"]


def text(seed: str, chars: int) -> str:
    """``chars`` characters of text (the demo models read one token a character)."""
    out, n = [], 0
    while sum(map(len, out)) < chars:
        out.append(f"{seed} {WORDS[n % 11]} {n * 7 % 13}. ")
        n += 1
    return "".join(out)[:chars]


def distinct_tokens(sequences: list[tuple[int, ...]]) -> int:
    """The nodes of the sequences' prefix tree: each token counted once per distinct prefix."""
    root: dict[int, Any] = {}
    count = 0
    for seq in sequences:
        node = root
        for token in seq:
            if token not in node:
                node[token] = {}
                count += 1
            node = node[token]
    return count


async def ask(engine: LlamaServer, prompt: str) -> dict[str, Any]:
    status, body = await engine.request("POST", "/completion", json={
        "prompt": prompt, "n_predict": 8, "temperature": 0, "cache_prompt": True, "id_slot": 0})
    assert status == 200, body
    return body


def bytes_per_token(engine: LlamaServer, path: Path) -> float:
    state = engine.state_format.cut(path, 1 << 30)  # type: ignore[union-attr]
    assert isinstance(state, CutState), state
    return len(state.tail.data) / state.tail.cells


async def disk(engine: LlamaServer, work: Path, block_sizes: list[int], cpt: float = 1.0) -> list[dict[str, Any]]:
    slot_dir = engine.info.slot_save_path
    assert slot_dir is not None
    opening = text("Shared opening: the system prompt, the tools, the environment.", int((OPENING_TOKENS - 1) * cpt))
    files = []
    for i in range(SESSIONS):
        await ask(engine, opening + text(f"Session {i} asks its own question", int(OWN_TOKENS * cpt)))
        name = f"session-{i}.bin"
        await engine.save(name, 0)
        files.append(slot_dir / name)
    sequences = []
    for f in files:
        state = engine.state_format.cut(f, 1 << 30)  # type: ignore[union-attr]
        assert isinstance(state, CutState), state
        sequences.append(state.tokens)
    bpt = bytes_per_token(engine, files[0])
    distinct = distinct_tokens(sequences)
    ideal = distinct * bpt
    whole = sum(f.stat().st_size for f in files)
    rows = [{"layout": "whole files (before)", "bytes": whole, "ratio": whole / ideal, "distinct": distinct, "bpt": bpt}]
    for block in block_sizes:
        for compression in (None, "zstd"):
            store = BlockStore(work / f"disk-{block}-{compression}", engine.state_format,  # type: ignore[arg-type]
                               fingerprint={"bench": 1}, block_tokens=block, compression=compression)
            start = time.perf_counter()
            for i, f in enumerate(files):
                store.save(f"session-{i}", f)
            save_s = time.perf_counter() - start
            start = time.perf_counter()
            for i in range(SESSIONS):
                store.materialize(store.chain_of(f"session-{i}"), work / "joined.bin")  # type: ignore[arg-type]
            join_s = time.perf_counter() - start
            stored = store.usage().bytes
            rows.append({"layout": f"blocks of {block}" + (", zstd" if compression else ""), "bytes": stored,
                         "ratio": stored / ideal, "distinct": distinct, "bpt": bpt,
                         "save_ms": 1000 * save_s / SESSIONS, "join_ms": 1000 * join_s / SESSIONS})
    return rows


async def writes(engine: LlamaServer, work: Path, blocks: list[int], rounds: int,
                 sizes: dict[str, int], cpt: float = 1.0) -> list[dict[str, Any]]:
    """Each turn restores from the first store (blocks of ``blocks[0]``) and saves into every one."""
    slot_dir = engine.info.slot_save_path
    assert slot_dir is not None
    stores = {block: BlockStore(work / f"writes-{block}", engine.state_format,  # type: ignore[arg-type]
                                fingerprint={"bench": 1}, block_tokens=block) for block in blocks}
    store = stores[blocks[0]]
    prompts = {name: text(f"The {name} conversation", int(size * cpt)) for name, size in sizes.items()}
    tokens = dict.fromkeys(sizes, 0)
    rows = []
    for r in range(rounds + 1):
        for name in sizes:
            if r:
                prompts[name] += text(f"Turn {r} of {name}", int(TURN_TOKENS * cpt))
                store.materialize(store.chain_of(name), slot_dir / "joined.bin")  # type: ignore[arg-type]
                await engine.restore("joined.bin", 0)
            body = await ask(engine, prompts[name])
            reused = body["timings"]["cache_n"]
            saved = await engine.save("staged.bin", 0)
            reports = {block: each.save(name, slot_dir / "staged.bin") for block, each in stores.items()}
            report = reports[blocks[0]]
            assert report.refused is None, report.refused
            new = report.tokens - tokens[name]
            tokens[name] = report.tokens
            if r:  # round 0 writes each conversation's whole state, before and after alike
                bpt = report.state_bytes / report.tokens
                rows.append({"round": r, "conversation": name, "tokens": report.tokens, "new": new,
                             "reused": reused, "whole": saved.bytes, "whole_ratio": saved.bytes / (new * bpt),
                             **{f"blocks-{b}": rep.bytes_written for b, rep in reports.items()},
                             **{f"ratio-{b}": rep.bytes_written / (new * bpt) for b, rep in reports.items()}})
    return rows


def table(disk_rows: dict[str, list[dict[str, Any]]], write_rows: dict[str, list[dict[str, Any]]],
          blocks: list[int]) -> str:
    out = ["# Blocks, not files: disk and writes", "",
           "`python -m bench.blocks`: a bare llama-server, one slot, RAM cache off, random-weight demo models.", ""]
    for model, rows in disk_rows.items():
        first = rows[0]
        out += [f"## Disk, {model} model: {SESSIONS} sessions sharing a {OPENING_TOKENS:,}-token opening "
                f"(+{OWN_TOKENS} each)", "",
                f"Distinct tokens {first['distinct']:,}, {first['bpt']:,.0f} bytes of state per token: "
                f"ideal {first['distinct'] * first['bpt'] / 1e6:.1f} MB.", "",
                "| stored as | MB on disk | x distinct tokens' bytes | save ms/session | join ms/session |",
                "|---|---:|---:|---:|---:|"]
        for row in rows:
            times = (f"{row['save_ms']:.0f} | {row['join_ms']:.0f}" if "save_ms" in row
                     else "(the engine's save) | (none)")
            out.append(f"| {row['layout']} | {row['bytes'] / 1e6:.2f} | {row['ratio']:.2f}x | {times} |")
        out.append("")
    for model, rows in write_rows.items():
        out += [f"## Writes, {model} model: conversations of {CONVERSATIONS[model]['long']:,} and "
                f"{CONVERSATIONS[model]['short']:,} tokens taking turns, +{TURN_TOKENS} tokens a turn", "",
                f"Each turn restored from the blocks of {blocks[0]} (`cache_n`: the tokens the engine reused).", "",
                "| round | conversation | tokens | new | cache_n | whole file MB | x new tokens' bytes | "
                + " | ".join(f"blocks of {b}: MB | x" for b in blocks) + " |",
                "|---:|---|---:|---:|---:|---:|---:|" + "---:|---:|" * len(blocks)]
        for row in rows:
            out.append(f"| {row['round']} | {row['conversation']} | {row['tokens']:,} | {row['new']} | "
                       f"{row['reused']:,} | {row['whole'] / 1e6:.2f} | {row['whole_ratio']:.1f}x | "
                       + " | ".join(f"{row[f'blocks-{b}'] / 1e6:.3f} | {row[f'ratio-{b}']:.2f}x" for b in blocks)
                       + " |")
        whole = sum(r["whole"] for r in rows)
        new_bytes = sum(r["whole"] / r["whole_ratio"] for r in rows)
        summary = ", ".join(f"blocks of {b} {sum(r[f'blocks-{b}'] for r in rows) / 1e6:.2f} MB "
                            f"({sum(r[f'blocks-{b}'] for r in rows) / new_bytes:.2f}x)" for b in blocks)
        out += ["", f"All turns: whole files {whole / 1e6:.1f} MB written ({whole / new_bytes:.1f}x the new "
                f"tokens' bytes), {summary}.", ""]
    return "\n".join(out)


# -- through strata-serve's own parking (auto-sessions, ``blocks = true`` against ``false``) ----------------

#: Each conversation of the parking figures: a turn's words, its sizes (kept short: the
#: machine this runs on is shared).
PARKING_SIZES = {"long": 2400, "short": 800}
PARKING_ROUNDS = 2


def parked_tokens(slot_dir: Path, state_format: Any) -> tuple[list[tuple[int, ...]], float]:
    """The token sequences of every conversation parked in ``slot_dir`` (whole files, or
    blocks joined) and the state's bytes per token."""
    from strata_auto_sessions.parked_blocks import ParkedBlocks

    sequences, state_bytes = [], 0
    paths = list(slot_dir.glob("auto-*.bin"))
    blocks = ParkedBlocks.existing(slot_dir)
    if blocks is not None:
        blocks.store.format = state_format
        for n, m in enumerate(blocks.store.manifests()):
            joined = slot_dir / f"bench-joined-{n}.bin"
            blocks.store.materialize(blocks.store.chain_of(m.key), joined)  # type: ignore[arg-type]
            paths.append(joined)
    for path in paths:
        state = state_format.cut(path, 1 << 30)
        assert isinstance(state, CutState), state
        sequences.append(state.tokens)
        state_bytes += len(state.tail.data)
        if path.name.startswith("bench-joined-"):
            path.unlink()
    return sequences, state_bytes / sum(len(s) for s in sequences)


def parking_disk_bytes(slot_dir: Path) -> int:
    whole = sum(p.stat().st_size for p in slot_dir.glob("auto-*.bin"))
    store = slot_dir / "blocks"
    return whole + (sum(p.stat().st_size for p in store.rglob("*") if p.is_file()) if store.is_dir() else 0)


#: How the parking is run: whole files; blocks with the newest states kept whole in memory
#: (the default with blocks); blocks joined at every restore (nothing kept in memory).
PARKED_AS = {"whole files": {"blocks": False}, "blocks of 64, kept": {"blocks": True},
             "blocks of 64, joined": {"blocks": True, "stage_keep_mb": 0}}


async def through_parking(name: str, model: Path, work: Path, how: str, cpt: float,
                          disk: bool = True) -> dict[str, Any]:
    """Six sessions sharing an opening (unless not ``disk``), then two conversations taking
    turns, through strata-serve with auto-sessions parking as ``how`` says (:data:`PARKED_AS`)."""
    import statistics

    from bench.harness import chat, client_session, strata
    from strata_serve.engine.llama_server.state_format import LlamaStateFormat

    blocks = PARKED_AS[how]["blocks"]
    slot_dir = work / f"parking-{name}-{how.replace(' ', '-').replace(',', '')}"
    plugins = {"auto_sessions": {"min_tokens": 64, "idle_save_s": 0, "keep": 64, **PARKED_AS[how]}}
    ctx = int(max(OPENING_TOKENS + OWN_TOKENS, PARKING_SIZES["long"] + TURN_TOKENS * (PARKING_ROUNDS + 1)) + 1024)
    opening = text("Shared opening: the system prompt, the tools, the environment.", int((OPENING_TOKENS - 1) * cpt))
    flush = [{"role": "user", "content": "hi"}]  # parks the conversation the slot holds, is not worth a file
    async with strata(model, ctx, slot_dir, 0, plugins=plugins, engine={"side_slot_tokens": 0}) as url, \
            client_session() as session:

        async def stats() -> dict[str, Any]:
            async with session.get(url + "/stats") as reply:
                return ((await reply.json()).get("plugins") or {}).get("auto_sessions") or {}

        for i in range(SESSIONS if disk else 0):
            own = text(f"Session {i} asks its own question", int(OWN_TOKENS * cpt))
            await chat(session, url, [{"role": "system", "content": opening}, {"role": "user", "content": own}])
        disk_bytes, distinct, bpt = 0, 0, 0.0
        if disk:
            await chat(session, url, flush)
            disk_bytes = parking_disk_bytes(slot_dir)
            sequences, bpt = parked_tokens(slot_dir, LlamaStateFormat())
            distinct = distinct_tokens(sequences)
        # Two conversations taking turns: each request parks the other one.
        history = {c: [{"role": "user", "content": text(f"The {c} conversation", int(size * cpt))}]
                   for c, size in PARKING_SIZES.items()}
        last: dict[str, int] = {}
        written = new_bytes = 0.0
        returns: list[float] = []
        restore_ms: list[float] = []
        save_ms: list[float] = []
        for r in range(PARKING_ROUNDS + 1):
            for c in PARKING_SIZES:
                other = next(o for o in PARKING_SIZES if o != c)
                before = await stats()
                reply = await chat(session, url, history[c])
                after = await stats()
                if r:
                    returns.append(reply.ttft_s)
                    if after.get("restores", 0) - before.get("restores", 0) == 1:
                        restore_ms.append(after["restore_ms"] - before["restore_ms"])
                if after.get("saves", 0) - before.get("saves", 0) == 1:
                    if r:
                        save_ms.append(after["save_ms"] - before["save_ms"])
                    tokens = after["saved_tokens"] - before["saved_tokens"]
                    if not bpt:  # without the disk figure: the state's bytes per token from this save
                        bpt = (after["block_state_bytes"] - before["block_state_bytes"]) / tokens if blocks \
                            else (after["saved_bytes"] - before["saved_bytes"]) / tokens
                    if other in last:
                        key = "block_written_bytes" if blocks else "saved_bytes"
                        written += after[key] - before[key]
                        new_bytes += (tokens - last[other]) * bpt
                    last[other] = tokens
                history[c] = history[c] + [
                    {"role": "assistant", "content": reply.text},
                    {"role": "user", "content": text(f"Turn {r} of {c}", int(TURN_TOKENS * cpt))}]
        final = await stats()
    return {"model": name, "how": how, "blocks": blocks, "disk_bytes": disk_bytes, "distinct": distinct, "bpt": bpt,
            "disk_ratio": disk_bytes / (distinct * bpt) if disk else float("nan"), "written": written,
            "writes_ratio": written / new_bytes if new_bytes else float("nan"),
            "switch_back_s": statistics.median(returns), "restore_ms": statistics.median(restore_ms or [0.0]),
            "save_ms": statistics.median(save_ms or [0.0]),
            "refused": {k: v for k, v in final.items() if k.startswith("blocks_refused_") and v}}


def parking_table(rows: list[dict[str, Any]]) -> str:
    out = ["## Through strata-serve's parking (`--parking`): blocks = true against false, one run", "",
           f"auto-sessions parks the conversations itself (one slot, RAM cache off, idle saves off). Disk: "
           f"{SESSIONS} sessions sharing a {OPENING_TOKENS:,}-token opening (+{OWN_TOKENS} each), everything "
           f"the slot directory keeps (files, blocks, manifests) against the distinct tokens' bytes. Writes: "
           f"conversations of {PARKING_SIZES['long']:,} and {PARKING_SIZES['short']:,} tokens taking turns, "
           f"+{TURN_TOKENS} a turn, {PARKING_ROUNDS} rounds after the first: what the parking wrote per save "
           f"(whole: the file; blocks: new blocks, tail, manifest; the engine's own file, staged in memory, "
           f"is not counted) against the turn's new tokens' bytes. Switch-back: time to the first "
           f"token of each return (the other conversation saved, this one restored), median; the save and the "
           f"restore alone as auto-sessions measured them, median. Blocks, kept: the newest states are kept "
           f"whole in memory (the default); joined: every restore joins its blocks (`stage_keep_mb = 0`).", "",
           "| model | parked as | disk MB | x distinct | written MB | x new tokens | switch-back s | save ms | "
           "restore ms |",
           "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for row in rows:
        disk = f"{row['disk_bytes'] / 1e6:.2f} | {row['disk_ratio']:.2f}x" if row["disk_bytes"] else "- | -"
        out.append(f"| {row['model']} | {row['how']} | {disk} | "
                   f"{row['written'] / 1e6:.2f} | {row['writes_ratio']:.2f}x | {row['switch_back_s']:.3f} | "
                   f"{row['save_ms']:.0f} | {row['restore_ms']:.0f} |")
    refused = {row["model"]: row["refused"] for row in rows if row["refused"]}
    out += ["", f"States kept whole by the format's refusal: {refused or 'none'}.", ""]
    return "\n".join(out)


async def parking_main(names: list[str], out: Path | None, disk: bool = True) -> str:
    rows = []
    with tempfile.TemporaryDirectory(prefix="strata-blocks-parking-") as tmp:
        work = Path(tmp)
        for name in names:
            model = model_path(name, work)
            for how in PARKED_AS:
                rows.append(await through_parking(name, model, work, how, CHARS_PER_TOKEN.get(name, 1.0), disk))
                print(rows[-1], flush=True)
    report = parking_table(rows)
    if out is not None:
        out.write_text(out.read_text() + "\n" + report + "\n" if out.exists() else report + "\n")
    return report


def model_path(name: str, work: Path) -> Path:
    if name == "smollm2":
        path = packaged_model_path("smollm2")
        if path is None:
            raise SystemExit("SmolLM2 is not installed: `make setup` installs it")
        return path
    return write_demo_model(work / f"{name}.gguf", size=name)


async def main(quick: bool, out: Path | None, names: list[str] | None = None, disk_only: bool = False) -> str:
    with tempfile.TemporaryDirectory(prefix="strata-blocks-") as tmp:
        work = Path(tmp)
        names = names or (["tiny"] if quick else ["tiny", "bench"])
        models = {name: model_path(name, work) for name in names}
        block_sizes = [64, 256] if quick else [64, 128, 256, 512]
        disk_rows, write_rows = {}, {}
        for name, model in models.items():
            ctx = 4096 if name == "tiny" else 8192 if name == "smollm2" else CONVERSATIONS[name]["long"] + TURN_TOKENS * 4 + 1024
            engine = LlamaServer(EngineSettings(model=model, ctx_size=ctx, slot_save_path=work / f"slots-{name}",
                                                side_slot_tokens=0, cache_ram_mib=0, log_level="DEBUG",
                                                start_timeout_s=300, request_timeout_s=3600))
            await engine.start()
            try:
                cpt = CHARS_PER_TOKEN.get(name, 1.0)
                disk_rows[name] = await disk(engine, work / name, block_sizes, cpt)
                if not disk_only:
                    write_rows[name] = await writes(engine, work / name, WRITE_BLOCKS, 1 if quick else 3,
                                                    CONVERSATIONS[name], cpt)
            finally:
                await engine.stop()
        report = table(disk_rows, write_rows, WRITE_BLOCKS)
    if out is not None:
        out.write_text(report + "\n")
    return report


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="the tiny model only, one round of turns")
    parser.add_argument("--out", type=Path, default=None, help="also write the tables to this file")
    parser.add_argument("--models", default=None, help="comma-separated: tiny, bench, smollm2 (default: tiny,bench)")
    parser.add_argument("--disk-only", action="store_true", help="the disk figure alone")
    parser.add_argument("--turns-only", action="store_true",
                        help="with --parking: the conversations taking turns alone (no disk figure; quicker)")
    parser.add_argument("--parking", action="store_true",
                        help="through strata-serve's parking, blocks against whole files (appended to --out)")
    args = parser.parse_args()
    if args.parking:
        print(asyncio.run(parking_main(args.models.split(",") if args.models else ["bench", "smollm2"], args.out,
                                       disk=not args.turns_only)))
    else:
        print(asyncio.run(main(args.quick, args.out, args.models.split(",") if args.models else None,
                               args.disk_only)))
