"""A shared tier that misbehaves, for real: a directory whose files block on ``open()`` (as
on a hung NFS mount; made here by putting a FIFO, which no process writes, where each file
the store holds was), and heads damaged in the store. What a client, ``/health``, the
process and the store's listing see; never the tier's file names: every file the store
holds is hung alike, whatever its layout."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import os
import signal
import socket
import subprocess
import threading
import sys
import time
from pathlib import Path

import aiohttp

from strata_auto_sessions.config import SharedConfig
from strata_auto_sessions.shared import Head
from strata_auto_sessions.shared.sweep import sweep
from strata_serve.testing import ask, chat, conversation

from .test_auto_sessions import log_lines, parking

#: Calls on the tier give up after this long here (5 s by default); a turn that waits for
#: the hung store once takes about this long, one that does not takes well under it.
TIMEOUT_S = 8.0
#: Long enough that the whole test runs inside one wait (a hung tier is asked again after it).
RETRY_S = 120.0
SHARED = {"timeout_s": TIMEOUT_S, "retry_s": RETRY_S}
#: A turn that waits for the hung store once: its call's bound, then the engine's work.
FIRST_TURN_S = TIMEOUT_S + 15


def stored_files(root: Path) -> list[Path]:
    return sorted(path for path in root.rglob("*") if path.is_file() or path.is_fifo())


def hang_every_file(root: Path) -> int:
    """Every file the store holds becomes a FIFO no process writes: opening it for reading
    blocks (listing the directory does not), as on a hung network mount. How many."""
    hung = 0
    for path in stored_files(root):
        if path.is_file():
            path.unlink()
            os.mkfifo(path, 0o600)
            hung += 1
    return hung


def release(root: Path) -> None:
    """Whatever blocks opening one of the FIFOs is let through (it reads an empty file), and
    the FIFOs go: a thread stuck on them ends, so nothing of the test outlives it."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        readers = 0
        for path in root.rglob("*"):
            if not path.is_fifo():
                continue
            try:
                fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
            except OSError as exc:
                if exc.errno != errno.ENXIO:  # ENXIO: nobody waits on it
                    raise
                continue
            readers += 1
            os.close(fd)
        if not readers:
            break
        time.sleep(0.05)
    for path in root.rglob("*"):
        if path.is_fifo():
            path.unlink()


async def timed_ask(client, messages) -> tuple[dict, float]:
    began = time.monotonic()
    answer = await ask(client, messages)
    return answer, time.monotonic() - began


async def test_a_hung_shared_directory_costs_one_wait_and_every_request_is_answered(auto_client, tmp_path, caplog):
    # Before: each turn's calls on the hung files gave up after timeout_s, but their threads
    # stayed blocked in the event loop's default pool; once it was full (6 threads here),
    # every turn waited for a thread that never came, and the requests behind it too.
    root = tmp_path / "shared"
    root.mkdir()
    client = await auto_client(idle_save_s=0, shared={"url": f"file://{root}", **SHARED})
    shared = parking(client).shared
    a, b, c = conversation("hung-a"), conversation("hung-b"), conversation("hung-c")
    await ask(client, a)
    await ask(client, b)  # a parked and uploaded
    await ask(client, a)  # b parked and uploaded, a restored
    assert await shared.settled(30), "the uploads ended"
    assert (await client.get("/health")).status == 200

    assert hang_every_file(root) >= 4  # both conversations' files, and their heads
    try:
        # b's turn looks its state up in the hung store: it waits for it once; another
        # client's request, behind it in the FIFO, is answered too.
        began = time.monotonic()
        (b_back, c_back) = await asyncio.wait_for(asyncio.gather(ask(client, b), ask(client, c)), FIRST_TURN_S * 2)
        took = time.monotonic() - began
        assert took < FIRST_TURN_S * 2, f"two requests took {took:.1f} s"
        assert b_back["timings"]["cache_n"] > 100, "b restored from the slot directory"
        assert c_back["choices"]

        health = await client.get("/health")
        reported = await health.json()
        assert health.status == 200, "the replica answers: a balancer keeps it"
        assert reported["status"] == "degraded" and "shared tier" in reported["degraded"]["auto_sessions"], reported

        # The tier is taken for hung: no later turn waits for it, however many switches.
        for turn, messages in enumerate([a, b, c, a, b, a, c, b]):
            back, took = await asyncio.wait_for(timed_ask(client, messages), FIRST_TURN_S)
            assert took < TIMEOUT_S, f"turn {turn} waited for the hung store again ({took:.1f} s)"
            assert back["timings"]["cache_n"] > 100, f"turn {turn}: restored from the slot directory"
        # The server's other work still gets a thread.
        assert await asyncio.wait_for(asyncio.to_thread(lambda: "ran"), 5) == "ran"
        assert any("taken for hung" in line for line in log_lines(caplog))
    finally:
        release(root)


# -- a stop with the tier hung: a real server process ---------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_server(slots: Path, shared: Path, model: Path, port: int, log_file: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "STRATA_PLUGINS__AUTO_SESSIONS__MIN_TOKENS": "100",
           "STRATA_PLUGINS__AUTO_SESSIONS__IDLE_SAVE_S": "0", "STRATA_SERVER__SHUTDOWN_GRACE_S": "0.5",
           "STRATA_ENGINE__SIDE_SLOT_TOKENS": "0",
           "STRATA_PLUGINS__AUTO_SESSIONS__SHARED__URL": f"file://{shared}",
           "STRATA_PLUGINS__AUTO_SESSIONS__SHARED__TIMEOUT_S": "1",
           "STRATA_PLUGINS__AUTO_SESSIONS__SHARED__RETRY_S": str(RETRY_S)}
    with open(log_file, "a") as log:
        # A session of its own: a kill of the group takes the server and its engine.
        return subprocess.Popen(
            [sys.executable, "-m", "strata_serve.cli", "run", "--model", str(model), "--port", str(port),
             "--slot-save-path", str(slots), "--cache-ram", "0"],
            stderr=log, stdout=log, env=env, start_new_session=True)


def wait_for(log_file: Path, text: str, proc: subprocess.Popen, count: int = 1, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while log_file.read_text().count(text) < count:
        assert proc.poll() is None, log_file.read_text()[-3000:]
        if time.monotonic() > deadline:
            raise AssertionError(f"never saw {text!r} {count} time(s):\n{log_file.read_text()[-3000:]}")
        time.sleep(0.1)


async def post(port: int, messages: list[dict]) -> dict:
    async with aiohttp.ClientSession() as session:
        async with session.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=chat(messages),
                                timeout=aiohttp.ClientTimeout(total=FIRST_TURN_S)) as resp:
            assert resp.status == 200, await resp.text()
            return await resp.json()


async def test_a_stop_with_the_shared_directory_hung_ends_and_saves_what_it_held(tmp_path, strata_demo_model):
    # Before: the log said "stopped" and the process ran on (60 s and more): the threads
    # blocked on the hung files were the event loop's, and the exit waited for them.
    shared = tmp_path / "shared"
    shared.mkdir()
    port, log_file = free_port(), tmp_path / "server.log"
    proc = start_server(tmp_path / "slots", shared, strata_demo_model, port, log_file)
    try:
        await asyncio.to_thread(wait_for, log_file, "[strata] listening on", proc)
        a, b = conversation("stop-a"), conversation("stop-b")
        await post(port, a)
        await post(port, b)  # a parked and uploaded
        await post(port, a)  # b parked and uploaded
        await asyncio.to_thread(wait_for, log_file, "shared tier: uploaded", proc, 2, 30)
        assert hang_every_file(shared) >= 4
        answer = await post(port, b)  # looked up in the hung store, answered
        assert answer["timings"]["cache_n"] > 100

        began = time.monotonic()
        os.killpg(proc.pid, signal.SIGTERM)
        assert await asyncio.to_thread(proc.wait, 30) == 0, "the stop ends within its bound"
        took = time.monotonic() - began
        text = log_file.read_text()
        assert "[strata] stopped" in text, text[-3000:]
        assert "not saved: conversation" not in text, text[-3000:]
        assert "(shutdown)" in text, "the conversation held was parked at the stop"
        assert took < 30, f"the stop took {took:.1f} s"
    finally:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        release(shared)


# -- a damaged head --------------------------------------------------------------------


async def stored(tier) -> dict[str, bytes]:
    """Every record the store holds, by where it is: the directory's files, the bucket's keys."""
    if hasattr(tier, "root"):
        return {str(path): path.read_bytes() for path in stored_files(tier.root)}
    client = await tier._c()
    found = {}
    async for page in client.get_paginator("list_objects_v2").paginate(Bucket=tier.bucket):
        for item in page.get("Contents", []):
            answer = await client.get_object(Bucket=tier.bucket, Key=item["Key"])
            async with answer["Body"] as body:
                found[item["Key"]] = await body.read()
    return found


async def overwrite(tier, where: str, data: bytes) -> None:
    if hasattr(tier, "root"):
        Path(where).write_bytes(data)
        return
    client = await tier._c()
    await client.put_object(Bucket=tier.bucket, Key=where, Body=data)


async def put_head_and_find_it(tier, name: str, head: Head) -> str:
    """Write ``head`` through the tier; where the store keeps it (the one record that appeared)."""
    before = await stored(tier)
    await tier.put_head(name, head, None)
    appeared = [where for where in await stored(tier) if where not in before]
    assert len(appeared) == 1, appeared
    return appeared[0]


def with_field(record: bytes, field: str, value: object) -> bytes:
    """The record with ``field`` set to ``value`` wherever it is in its JSON."""
    def change(node: object) -> object:
        if isinstance(node, dict):
            return {key: value if key == field else change(item) for key, item in node.items()}
        return node
    return json.dumps(change(json.loads(record))).encode()


class Stats:
    shared_damaged_heads = 0


async def test_a_damaged_head_never_stops_the_sweep(tier, tmp_path, caplog):
    # Before: a head cut short ended the sweep ("sweep not done"), one with a wrong-typed
    # field in a TypeError: no conversation expired again, no object was collected.
    config = SharedConfig(url="file:///unused", max_age_days=1, transfer_timeout_s=0.1, lease_s=0.2)
    source = tmp_path / "state.bin"
    source.write_bytes(b"state")
    old = Head(generation=1, upload="u1", written=time.time() - 2 * 86400)
    cut = await put_head_and_find_it(tier, "auto-cut.bin", Head(generation=1, upload="u1"))
    typed = await put_head_and_find_it(tier, "auto-typed.bin", Head(generation=1, upload="u1"))
    await tier.put_head("auto-old.bin", old, None)
    for obj in ("auto-cut.bin.u1", "auto-typed.bin.u1", "auto-old.bin.u1", "auto-stray.bin.u9"):
        await tier.put(obj, source)
    records = await stored(tier)
    await overwrite(tier, cut, records[cut][: len(records[cut]) // 2])
    await overwrite(tier, typed, with_field(records[typed], "written", "yesterday"))

    async def call(work):
        return await asyncio.wait_for(work, 10)

    stats = Stats()
    heads, objects = await sweep(tier, config, call, stats)
    deadline = time.monotonic() + 10
    while objects < 2:  # the objects no head names, once their lease is over
        assert time.monotonic() < deadline, f"the sweep removed {objects} object(s)"
        await asyncio.sleep(0.1)
        objects += (await sweep(tier, config, call, stats))[1]
    assert heads == 1 and await tier.head("auto-old.bin") is None, "the old conversation expired all the same"
    left = sorted(item.name for item in await tier.list("auto-"))
    assert "auto-stray.bin.u9" not in left and "auto-old.bin.u1" not in left, left
    # The damaged heads' conversations keep their objects: nobody knows which they name.
    assert "auto-cut.bin.u1" in left and "auto-typed.bin.u1" in left, left
    assert stats.shared_damaged_heads >= 2
    said = [line for line in log_lines(caplog) if "damaged head passed over by the sweep" in line]
    assert any("auto-cut.bin" in line for line in said) and any("auto-typed.bin" in line for line in said), said


async def test_calls_on_a_hung_directory_hold_a_few_threads_then_are_refused_at_once(tmp_path):
    # Before: each abandoned call held one more thread of the event loop's default pool,
    # and the calls after it queued behind them, each waiting out its own timeout.
    from strata_auto_sessions.shared import DirectoryTier, SharedTierError
    from strata_auto_sessions.shared.tier import TIER_THREADS

    root = tmp_path / "shared"
    root.mkdir()
    tier = DirectoryTier(root)
    await tier.put_head("auto-chat.bin", Head(generation=1, upload="u1"), None)
    hang_every_file(root)
    threads = threading.active_count()
    try:
        refused = None
        for _ in range(4 * TIER_THREADS):
            began = time.monotonic()
            try:
                await asyncio.wait_for(tier.head("auto-chat.bin"), 0.2)
            except TimeoutError:
                continue
            except SharedTierError as exc:
                refused, took = exc, time.monotonic() - began
                break
        assert refused is not None and took < 0.1, "refused at once, not after its timeout"
        assert threading.active_count() - threads <= TIER_THREADS
        # The default pool was never touched: it runs work at once.
        assert await asyncio.wait_for(asyncio.to_thread(lambda: "ran"), 2) == "ran"
    finally:
        release(root)
    deadline = time.monotonic() + 10
    while True:  # the calls let through return their threads: it answers again
        try:
            await tier.put_head("auto-other.bin", Head(generation=1, upload="u1"), None)
            break
        except SharedTierError:
            assert time.monotonic() < deadline, "the tier never answered again"
            await asyncio.sleep(0.05)
    assert (await tier.head("auto-other.bin"))[0].generation == 1
    await tier.close()
