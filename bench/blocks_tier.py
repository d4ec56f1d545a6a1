"""Bytes uploaded to the shared tier per turn, blocks against whole files (issue #41's figure).

``python -m bench.blocks_tier [--models tiny] [--out bench/results/blocks.md]``

strata-serve with auto-sessions parking in blocks and a shared tier (a directory, and S3:
moto's server on loopback), one slot, RAM cache off: two conversations taking turns, each
turn adding ~430 tokens, so that each request parks the other conversation and its save is
uploaded. What the uploads sent (``shared_uploaded_bytes``: blocks the tier lacked and the
manifest; whole files: the file), against the turn's new tokens times the state's bytes per
token, with ``shared.blocks`` on and off in the same run (the fetch side is measured by
``plugins/auto_sessions/tests/test_shared_blocks.py``). Every figure is a ratio measured in
the same run as what it is compared with.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from bench.blocks import CHARS_PER_TOKEN, PARKING_ROUNDS, PARKING_SIZES, TURN_TOKENS, model_path, text

S3_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
          "AWS_REGION": "us-east-1"}


async def _bucket(endpoint: str) -> str:
    from aiobotocore.session import get_session

    bucket = f"strata-{uuid.uuid4().hex[:12]}"
    async with get_session().create_client("s3", endpoint_url=endpoint) as client:
        await client.create_bucket(Bucket=bucket)
    return bucket


async def _stats(session: Any, url: str) -> dict[str, Any]:
    async with session.get(url + "/stats") as reply:
        return ((await reply.json()).get("plugins") or {}).get("auto_sessions") or {}


async def _uploads_settled(session: Any, url: str, saves: int, timeout: float = 120.0) -> dict[str, Any]:
    """/stats once every save made so far is uploaded (or dropped), within ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        now = await _stats(session, url)
        if now.get("shared_uploads", 0) + now.get("shared_uploads_lost", 0) >= saves:
            return now
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url}: {saves} uploads not settled in {timeout:g} s: {now}")
        await asyncio.sleep(0.05)


async def turns_through_tier(name: str, model: Path, work: Path, tier_url: str, shared_blocks: bool,
                             cpt: float) -> dict[str, Any]:
    from bench.harness import chat, client_session, strata

    kind = "directory" if tier_url.startswith("file:") else "s3"
    slot_dir = work / f"tier-{name}-{kind}-{'blocks' if shared_blocks else 'whole'}"
    shared = {"url": tier_url, "retry_s": 1, "blocks": shared_blocks}
    plugins = {"auto_sessions": {"min_tokens": 64, "idle_save_s": 0, "blocks": True, "keep": 64, "shared": shared}}
    ctx = int(PARKING_SIZES["long"] + TURN_TOKENS * (PARKING_ROUNDS + 2) + 1024)
    history = {c: [{"role": "user", "content": text(f"The {c} conversation {kind}", int(size * cpt))}]
               for c, size in PARKING_SIZES.items()}
    sent = new_bytes = 0.0
    ratios: list[float] = []
    async with strata(model, ctx, slot_dir, 0, plugins=plugins, engine={"side_slot_tokens": 0}) as url, \
            client_session() as session:
        last: dict[str, tuple[int, int]] = {}  # conversation -> (its tokens, bytes) at its last save
        for r in range(PARKING_ROUNDS + 1):
            for c in PARKING_SIZES:
                other = next(o for o in PARKING_SIZES if o != c)
                before = await _stats(session, url)
                reply = await chat(session, url, history[c])
                mid = await _stats(session, url)
                if mid.get("saves", 0) - before.get("saves", 0) == 1:
                    after = await _uploads_settled(session, url, mid["saves"])
                    tokens = mid["saved_tokens"] - before["saved_tokens"]
                    state_bytes = mid["saved_bytes"] - before["saved_bytes"]
                    if other in last and tokens > last[other][0]:
                        up = after["shared_uploaded_bytes"] - before["shared_uploaded_bytes"]
                        new = (tokens - last[other][0]) * state_bytes / tokens
                        sent += up
                        new_bytes += new
                        ratios.append(up / new)
                    last[other] = (tokens, state_bytes)
                history[c] = history[c] + [
                    {"role": "assistant", "content": reply.text},
                    {"role": "user", "content": text(f"Turn {r} of {c}", int(TURN_TOKENS * cpt))}]
    return {"model": name, "tier": kind, "blocks": shared_blocks, "turns": len(ratios), "sent": sent,
            "ratio": sent / new_bytes if new_bytes else float("nan"),
            "median": statistics.median(ratios) if ratios else float("nan")}


def tier_table(rows: list[dict[str, Any]]) -> str:
    out = ["## Uploads to the shared tier per turn (`python -m bench.blocks_tier`): shared as blocks against "
           "whole files, one run", "",
           f"auto-sessions parking in blocks with a shared tier; conversations of {PARKING_SIZES['long']:,} and "
           f"{PARKING_SIZES['short']:,} tokens taking turns, +{TURN_TOKENS} a turn, {PARKING_ROUNDS} rounds after "
           "the first; each save uploaded before the next request. Sent: what the uploads sent (blocks: the "
           "blocks the tier lacked and the manifest; whole files: the file; sidecars not counted) against "
           "the turn's new tokens' bytes. Taken on a busy 2-core machine (other work running beside it).", "",
           "| model | tier | shared as | turns | sent MB | x new tokens (all turns) | median per turn |",
           "|---|---|---|---:|---:|---:|---:|"]
    for row in rows:
        out.append(f"| {row['model']} | {row['tier']} | {'blocks' if row['blocks'] else 'whole files'} | "
                   f"{row['turns']} | {row['sent'] / 1e6:.2f} | {row['ratio']:.2f}x | {row['median']:.2f}x |")
    return "\n".join(out) + "\n"


async def main(names: list[str], out: Path | None) -> str:
    import logging

    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # moto's server logs every request
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    os.environ.update({**S3_ENV, "AWS_ENDPOINT_URL": endpoint})
    rows = []
    try:
        with tempfile.TemporaryDirectory(prefix="strata-blocks-tier-") as tmp:
            work = Path(tmp)
            for name in names:
                model = model_path(name, work)
                for kind in ("directory", "s3"):
                    for shared_blocks in (False, True):
                        if kind == "directory":
                            root = work / f"shared-{uuid.uuid4().hex[:6]}"
                            root.mkdir()
                            url = f"file://{root}"
                        else:
                            url = f"s3://{await _bucket(endpoint)}/strata"
                        rows.append(await turns_through_tier(name, model, work, url, shared_blocks,
                                                             CHARS_PER_TOKEN.get(name, 1.0)))
                        print(rows[-1], flush=True)
    finally:
        server.stop()
    report = tier_table(rows)
    if out is not None:
        out.write_text(out.read_text() + "\n" + report if out.exists() else report)
    return report


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="tiny", help="comma-separated: tiny, bench, smollm2 (default: tiny)")
    parser.add_argument("--out", type=Path, default=None, help="also append the table to this file")
    args = parser.parse_args()
    print(asyncio.run(main(args.models.split(","), args.out)))
