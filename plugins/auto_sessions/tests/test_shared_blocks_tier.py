"""The shared tier's block objects, run against both tiers (a directory every server
mounts, and S3 on moto's server on loopback): written once under their name, never
over; listed; fetched; removed. And a head that names a manifest."""

from __future__ import annotations

import asyncio
import json
import time as _time

import pytest

from strata_auto_sessions.blocks import Manifest
from strata_auto_sessions.config import SharedConfig
from strata_auto_sessions.shared import Head
from strata_auto_sessions.shared import sweep as sweeping
from strata_auto_sessions.shared.blocks import encode_manifest
from strata_auto_sessions.shared.sweep import remove_by_hand, sweep


async def test_a_block_is_written_once_and_never_over(tier):
    assert await tier.put_block("ab12", b"first") is True
    assert await tier.put_block("ab12", b"second") is False
    assert await tier.fetch_block("ab12") == b"first"
    assert [(b.name, b.bytes) for b in await tier.blocks()] == [("ab12", 5)]
    await tier.delete_block("ab12")
    await tier.delete_block("ab12")  # nothing there: no error
    assert await tier.blocks() == []
    with pytest.raises(FileNotFoundError):
        await tier.fetch_block("ab12")


async def test_two_writers_of_one_block_at_once_one_writes_it(tier):
    written = await asyncio.gather(*(tier.put_block("cd34", b"same bytes") for _ in range(6)))
    assert sorted(written) == [False] * 5 + [True]
    assert await tier.fetch_block("cd34") == b"same bytes"


async def test_blocks_are_apart_from_objects_and_heads(tier):
    await tier.put_block("auto-x", b"block")
    await tier.put_bytes("auto-x.bin.manifest.u1", b"{}")
    assert [o.name for o in await tier.list("auto-")] == ["auto-x.bin.manifest.u1"]
    assert await tier.fetch_bytes("auto-x.bin.manifest.u1") == b"{}"
    assert [b.name for b in await tier.blocks()] == ["auto-x"]
    with pytest.raises(FileNotFoundError):
        await tier.fetch_bytes("auto-y.bin.manifest.u1")


async def test_a_manifest_head_names_its_manifest_and_reads_back_as_one(tier):
    head = Head(generation=1, upload="u1", tokens=10, bytes=100, manifest=True)
    await tier.put_head("auto-x.bin", head, None)
    read = await tier.head("auto-x.bin")
    assert read is not None and read[0].manifest is True
    assert read[0].objects("auto-x.bin", "auto-x.json") == ("auto-x.bin.manifest.u1", "auto-x.json.u1")
    # A head of an earlier version (no such field) is a whole file's.
    old = Head.decode(b'{"generation": 2, "upload": "u2"}')
    assert old.manifest is False and old.objects("auto-x.bin", "auto-x.json") == ("auto-x.bin.u2", "auto-x.json.u2")


class _Later:
    """``time`` as the sweep reads it, ``shift`` seconds on."""

    def __init__(self, shift: float):
        self.shift = shift

    def time(self) -> float:
        return _time.time() + self.shift

    def monotonic(self) -> float:
        return _time.monotonic()


def manifest_of(key: str, chain: list[str], tail: str | None) -> Manifest:
    return Manifest(key=key, tenant=None, format_version="v", layout="l", n_stream=1, block_tokens=2, root="r",
                    chain=chain, tail=tail, tail_tokens=[1] if tail else [], tokens=2 * len(chain) + bool(tail))


async def share(tier, name: str, upload: str, manifest: Manifest) -> None:
    head = Head(generation=1, upload=upload, tokens=manifest.tokens, bytes=10, manifest=True)
    await tier.put_bytes(head.objects(name, name[:-4] + ".json")[0], encode_manifest(manifest))
    await tier.put_head(name, head, None)


async def test_the_sweep_removes_a_block_only_when_no_manifest_holds_it_and_its_lease_is_over(tier, monkeypatch):
    config = SharedConfig(url="file:///unused", transfer_timeout_s=1, lease_s=60)

    async def call(work):
        return await asyncio.wait_for(work, 10)

    for block in ("b1", "b2", "b3", "t1", "t2", "loose"):
        await tier.put_block(block, block.encode())
    await share(tier, "auto-a.bin", "u1", manifest_of("a#0", ["b1", "b2"], "t1"))
    await share(tier, "auto-b.bin", "u2", manifest_of("b#0", ["b1", "b3"], "t2"))

    async def blocks_left():
        return sorted(b.name for b in await tier.blocks())

    await sweep(tier, config, call)  # every block younger than its lease: none goes
    assert await blocks_left() == ["b1", "b2", "b3", "loose", "t1", "t2"]
    monkeypatch.setattr(sweeping, "time", _Later(120))
    await sweep(tier, config, call)  # past the lease: the one no manifest names goes
    assert await blocks_left() == ["b1", "b2", "b3", "t1", "t2"]

    # sessions rm of a: a tombstone; its manifest object goes once its lease is over, and
    # with it the blocks no other head's manifest holds (b1 is b's too).
    monkeypatch.setattr(sweeping, "time", _time)
    assert await remove_by_hand(tier, config, ["a"]) == ["auto-a.bin"]
    monkeypatch.setattr(sweeping, "time", _Later(120))
    await sweep(tier, config, call)
    assert await blocks_left() == ["b1", "b3", "t2"]


async def test_a_manifest_not_read_keeps_every_block(tier, monkeypatch):
    config = SharedConfig(url="file:///unused", transfer_timeout_s=1, lease_s=60)

    async def call(work):
        return await asyncio.wait_for(work, 10)

    await tier.put_block("b1", b"b1")
    await tier.put_block("loose", b"loose")
    await share(tier, "auto-a.bin", "u1", manifest_of("a#0", ["b1"], None))
    await tier.put_head("auto-c.bin", Head(generation=1, upload="u9", tokens=2, bytes=10, manifest=True), None)
    await tier.put_bytes("auto-c.bin.manifest.u9", b"not a manifest")  # a head's manifest, damaged
    monkeypatch.setattr(sweeping, "time", _Later(120))
    await sweep(tier, config, call)  # what the damaged one holds is unknown: no block goes
    assert sorted(b.name for b in await tier.blocks()) == ["b1", "loose"]


async def test_a_replica_of_an_earlier_version_finds_no_file_under_a_manifest_head(tier, tmp_path):
    """An earlier version reads the head (the field it does not know is left out), and
    fetches the file under the upload's name: there is none, so its fetch fails and
    nothing is restored, never the manifest taken for a state."""
    await share(tier, "auto-a.bin", "u1", manifest_of("a#0", ["b1"], None))
    head = Head.decode(json.dumps({k: v for k, v in json.loads((await tier.head("auto-a.bin"))[0].encode()).items()
                                   if k != "manifest"}).encode())
    with pytest.raises(FileNotFoundError):
        await tier.fetch(f"auto-a.bin.{head.upload}", tmp_path / "state.bin")
