"""The shared tier's contract, run against both tiers: a directory every server mounts, and
S3 (moto's standalone server on loopback, a real S3 API over HTTP). Then the start check
that refuses a store ignoring conditional writes, against a named stand-in."""

from __future__ import annotations

import asyncio
import json
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from strata_auto_sessions.shared import (
    ConditionFailed, ConditionsIgnored, DirectoryTier, Head, S3Tier, SharedTierError, check_conditions, tier_for,
)
from strata_auto_sessions.config import SharedConfig
from strata_auto_sessions.shared.sweep import sweep

from .shared_fixtures import S3_ENV, new_bucket


def head(generation: int, **more) -> Head:
    return Head(generation=generation, upload=f"u{generation}", tokens=10 * generation, bytes=100, **more)


async def test_put_fetch_list_delete(tier, tmp_path):
    source = tmp_path / "state.bin"
    source.write_bytes(b"state " * 1000)
    await tier.put("auto-chat.bin.u1", source)
    await tier.put("auto-chat.json.u1", source)
    await tier.put("auto-other.bin.u1", source)
    target = tmp_path / "back.bin"
    assert await tier.fetch("auto-chat.bin.u1", target) == 6000
    assert target.read_bytes() == source.read_bytes()
    listed = await tier.list("auto-chat.")
    assert sorted(item.name for item in listed) == ["auto-chat.bin.u1", "auto-chat.json.u1"]
    assert all(item.bytes == 6000 and abs(item.modified - time.time()) < 120 for item in listed)
    await tier.delete("auto-chat.bin.u1")
    await tier.delete("auto-chat.bin.u1")  # nothing there: no error
    assert [item.name for item in await tier.list("auto-chat.")] == ["auto-chat.json.u1"]
    with pytest.raises(FileNotFoundError):
        await tier.fetch("auto-chat.bin.u1", tmp_path / "nothing.bin")


async def test_a_head_is_written_first_once_then_only_over_the_version_read(tier):
    assert await tier.head("auto-chat.bin") is None
    first = await tier.put_head("auto-chat.bin", head(1), None)
    with pytest.raises(ConditionFailed):
        await tier.put_head("auto-chat.bin", head(1, writer="another server"), None)
    read, version = await tier.head("auto-chat.bin")
    assert (read.generation, read.upload, read.tokens, version) == (1, "u1", 10, first)
    second = await tier.put_head("auto-chat.bin", head(2), first)
    assert second != first
    with pytest.raises(ConditionFailed):  # a server that read generation 1 lost the race
        await tier.put_head("auto-chat.bin", head(2, writer="slower server"), first)
    read, version = await tier.head("auto-chat.bin")
    assert (read.generation, read.writer, version) == (2, "", second)


async def test_a_head_is_removed_only_at_the_version_read(tier):
    first = await tier.put_head("auto-chat.bin", head(1), None)
    second = await tier.put_head("auto-chat.bin", head(2), first)
    with pytest.raises(ConditionFailed):
        await tier.delete_head("auto-chat.bin", first)
    assert (await tier.head("auto-chat.bin"))[0].generation == 2
    await tier.delete_head("auto-chat.bin", second)
    assert await tier.head("auto-chat.bin") is None


async def test_a_tombstone_reads_back_as_one(tier):
    await tier.put_head("auto-chat.bin", Head(generation=3, upload=None, removed=123.5), None)
    read, _ = await tier.head("auto-chat.bin")
    assert read.tombstone and read.removed == 123.5 and read.objects("auto-chat.bin", "auto-chat.json") is None


async def test_tenants_are_apart_as_their_file_names_are(tier, tmp_path):
    source = tmp_path / "s.bin"
    source.write_bytes(b"x")
    for name in ("auto-alice--chat.bin", "auto-bob--chat.bin", "auto-chat.bin"):
        await tier.put_head(name, head(1), None)
        await tier.put(f"{name}.u1", source)
    assert await tier.heads("auto-alice--") == ["auto-alice--chat.bin"]
    assert sorted(await tier.heads("auto-chat.")) == ["auto-chat.bin"]
    assert [item.name for item in await tier.list("auto-bob--")] == ["auto-bob--chat.bin.u1"]


async def test_the_start_check_passes_on_a_store_that_keeps_its_conditions(tier):
    await check_conditions(tier)
    assert [name for name in await tier.heads("auto-.probe")] == []  # the probe is gone


async def test_directory_locks_expire_when_their_server_died(tmp_path):
    tier = DirectoryTier(tmp_path, lock_expiry_s=0.3, lock_wait_s=2)
    first = await tier.put_head("auto-chat.bin", head(1), None)
    lock = tmp_path / "locks" / "auto-chat.bin.lock"
    lock.write_text(json.dumps({"token": "a dead server's", "expires": time.time() + 0.3}))
    version = await tier.put_head("auto-chat.bin", head(2), first)  # waited for the expiry, then broke it
    assert (await tier.head("auto-chat.bin"))[1] == version and not lock.exists()


async def test_a_live_directory_lock_holds_a_compare_and_swap_off(tmp_path):
    tier = DirectoryTier(tmp_path, lock_expiry_s=60, lock_wait_s=0.2)
    first = await tier.put_head("auto-chat.bin", head(1), None)
    (tmp_path / "locks" / "auto-chat.bin.lock").write_text(json.dumps({"token": "t", "expires": time.time() + 60}))
    with pytest.raises(SharedTierError, match="locked by another server"):
        await tier.put_head("auto-chat.bin", head(2), first)
    assert (await tier.head("auto-chat.bin"))[1] == first


async def test_a_directory_object_is_never_seen_half_written(tmp_path):
    tier = DirectoryTier(tmp_path)
    source = tmp_path / "big.bin"
    source.write_bytes(b"y" * 3_000_000)
    await tier.put("auto-chat.bin.u1", source)
    assert [p.name for p in (tmp_path / "objects").iterdir()] == ["auto-chat.bin.u1"]  # no temporary left


class ConditionBlindS3(S3Tier):
    """A stand-in for an S3 store that ignores ``If-Match`` and ``If-None-Match``: it writes
    every head unconditionally (as some S3 look-alikes do)."""

    async def put_head(self, name, head, expect):
        client = await self._c()
        answer = await client.put_object(Bucket=self.bucket, Key=self._head_key(name), Body=head.encode())
        return str(answer["ETag"])


async def test_the_start_check_refuses_a_store_that_ignores_conditions(s3_server, monkeypatch):
    for name, value in S3_ENV.items():
        monkeypatch.setenv(name, value)
    blind = ConditionBlindS3(await new_bucket(s3_server), "p", endpoint_url=s3_server)
    try:
        with pytest.raises(ConditionsIgnored, match="ignores conditional writes.*shared mode is refused"):
            await check_conditions(blind)
    finally:
        await blind.close()


async def test_a_bucket_that_does_not_exist_is_named_not_taken_for_a_missing_object(s3_server, monkeypatch):
    # Every call answers 404 NoSuchBucket: taken for a missing head, the start check said
    # "no head to replace" and the uploads "does not answer".
    for name, value in S3_ENV.items():
        monkeypatch.setenv(name, value)
    tier = S3Tier("strata-never-made", "p", endpoint_url=s3_server)
    try:
        for call in (tier.head("auto-x.bin"), tier.put_head("auto-x.bin", head(1), None),
                     tier.put_head("auto-x.bin", head(2), '"etag"'), check_conditions(tier)):
            with pytest.raises(SharedTierError, match="NoSuchBucket: the bucket does not exist") as refused:
                await call
            assert not isinstance(refused.value, (ConditionFailed, FileNotFoundError)), refused.value
    finally:
        await tier.close()


async def test_the_url_chooses_the_tier(tmp_path, s3_env):
    directory = tier_for(SharedConfig(url=f"file://{tmp_path}"))
    assert isinstance(directory, DirectoryTier) and directory.root == Path(tmp_path)
    s3 = tier_for(SharedConfig(url="s3://my-bucket/some/prefix"))
    assert isinstance(s3, S3Tier) and (s3.bucket, s3.prefix) == ("my-bucket", "some/prefix/")
    await s3.close()
    with pytest.raises(ValueError, match="file:// or s3://"):
        SharedConfig(url="ftp://nowhere")


async def test_a_directory_tier_keeps_what_it_stores_to_its_owner_whatever_the_umask(tmp_path):
    # The objects hold transcripts: they were 0644 (0666 under umask 0) while the slot
    # directory's files are 0600.
    root = tmp_path / "shared"
    root.mkdir()
    tier = DirectoryTier(root)
    source = tmp_path / "state.bin"
    source.write_bytes(b"a transcript")
    previous = os.umask(0)
    try:
        await tier.put("auto-chat.bin.u1", source)
        first = await tier.put_head("auto-chat.bin", head(1), None)
        await tier.put_head("auto-chat.bin", head(2), first)
        fetched = tmp_path / "fetched.bin"
        await tier.fetch("auto-chat.bin.u1", fetched)
    finally:
        os.umask(previous)
        await tier.close()
    made = list(root.rglob("*"))
    assert any(path.is_file() for path in made) and any(path.is_dir() for path in made)
    modes = {str(path.relative_to(root)): oct(stat.S_IMODE(path.stat().st_mode)) for path in made}
    assert all(modes[str(path.relative_to(root))] == (oct(0o700) if path.is_dir() else oct(0o600))
               for path in made), modes
    assert stat.S_IMODE(fetched.stat().st_mode) == 0o600


#: A server process that dies in the middle of an upload: the tier's ``put`` of a source
#: that stops coming (a FIFO for the directory; for S3, whose large files go in parts, the
#: second part is never read), killed once the store shows the upload begun.
KILLED_UPLOAD = """
import asyncio, sys, time
from pathlib import Path

kind, where, source = sys.argv[1:4]
if kind == "directory":
    from strata_auto_sessions.shared import DirectoryTier
    tier = DirectoryTier(Path(where))
else:
    from strata_auto_sessions.shared import s3
    s3.PART_BYTES = 5 * 1024 * 1024
    read_part = s3._read_part

    def stalled(path, offset, size):
        if offset:
            time.sleep(3600)
        return read_part(path, offset, size)

    s3._read_part = stalled
    tier = s3.S3Tier(where, "strata/prefix", endpoint_url=sys.argv[4])
asyncio.run(tier.put("auto-killed.bin.u1", Path(source)))
"""


async def begun(tier) -> bool:
    """Whether the store shows the upload begun: a file under the directory; an S3
    multipart upload holding a part."""
    if isinstance(tier, DirectoryTier):
        return bool(await leftovers(tier))
    client = await tier._c()
    for upload in (await client.list_multipart_uploads(Bucket=tier.bucket)).get("Uploads", []):
        parts = await client.list_parts(Bucket=tier.bucket, Key=upload["Key"], UploadId=upload["UploadId"])
        if parts.get("Parts"):
            return True
    return False


async def leftovers(tier) -> list[str]:
    """What the store holds beside its finished objects and heads: every file under the
    directory; the bucket's objects and open multipart uploads."""
    if isinstance(tier, DirectoryTier):
        return sorted(str(path) for path in tier.root.rglob("*") if path.is_file())
    client = await tier._c()
    objects = await client.list_objects_v2(Bucket=tier.bucket)
    uploads = await client.list_multipart_uploads(Bucket=tier.bucket)
    return sorted([item["Key"] for item in objects.get("Contents", [])]
                  + [f"upload of {item['Key']}" for item in uploads.get("Uploads", [])])


async def test_an_upload_killed_midway_leaves_nothing_once_its_lease_is_over(tier, tmp_path):
    # A killed upload's partial object stayed forever: the directory's temporary (the sweep
    # passed over dot-files), S3's open multipart upload (nothing aborted it).
    kind = "directory" if isinstance(tier, DirectoryTier) else "s3"
    source = tmp_path / "state.bin"
    if kind == "directory":
        os.mkfifo(source)
        args = [str(tier.root), str(source)]
    else:
        source.write_bytes(os.urandom(12 * 1024 * 1024))
        args = [tier.bucket, str(source), tier._endpoint_url]
    child = subprocess.Popen([sys.executable, "-c", KILLED_UPLOAD, kind, *args])
    writer = None
    try:
        if kind == "directory":  # a first MiB and a half, then nothing (the source stays open)
            writer = await asyncio.to_thread(os.open, source, os.O_WRONLY)
            await asyncio.to_thread(os.write, writer, os.urandom(1536 * 1024))
        deadline = time.monotonic() + 30
        while not await begun(tier):
            assert child.poll() is None and time.monotonic() < deadline, "the upload never began"
            await asyncio.sleep(0.05)
        child.kill()
        child.wait(10)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(10)
        if writer is not None:
            os.close(writer)
    assert await leftovers(tier), "the killed upload left something"

    async def call(work):
        return await asyncio.wait_for(work, 10)

    # Within its lease an upload may still be under way: kept.
    await sweep(tier, SharedConfig(url="file:///unused", transfer_timeout_s=1, lease_s=3600), call)
    assert await leftovers(tier)
    short = SharedConfig(url="file:///unused", transfer_timeout_s=0.5, lease_s=1)
    deadline = time.monotonic() + 20
    while left := await leftovers(tier):
        assert time.monotonic() < deadline, f"left once its lease was over: {left}"
        await asyncio.sleep(0.2)
        await sweep(tier, short, call)
