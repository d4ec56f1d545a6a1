"""Faults survived, bad input refused, nothing lost (run alone: ``pytest -m reliability``).

Real engine, real files. Each test fails if the behaviour it names breaks; the
table in docs/reliability.md lists them with what happens.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import strata_auto_sessions
import strata_serve
from strata_serve.api import SERVICE
from strata_serve.testing import conversation, until_idle
from tests.ports import listen_port
from tests.parked_state import (
    PATH_TOLERANCE,
    WRONG_STATE_DISTANCE,
    engine_ask,
    logprob_body,
    logprob_distance,
    reordered,
    sharp_demo_model,
    text_of,
    wrong_state_answer,
)

pytestmark = pytest.mark.reliability
MIN_TOKENS = 100
#: Tokens generated per turn of the load test, each compared by its top logprobs.
LOAD_TOKENS = 8


def body(messages, **extra) -> dict:
    return {"messages": messages, "max_tokens": 8, "temperature": 0, **extra}


async def ask(client, messages, **extra):
    resp = await client.post("/v1/chat/completions", json=body(messages, **extra))
    return resp.status, await resp.json()


def parking(client):
    return client.app[SERVICE].state["auto_sessions"]


@pytest.fixture
def auto_client(strata_client_factory, strata_settings_factory):
    async def make(slot_dir: Path | None = None, *, blocks: bool | None = None, **engine):
        if slot_dir is not None:
            engine["slot_save_path"] = str(slot_dir)
        plugin = {"min_tokens": MIN_TOKENS} if blocks is None else {"min_tokens": MIN_TOKENS, "blocks": blocks}
        settings = strata_settings_factory(plugins={"auto_sessions": plugin}, engine=engine)
        return await strata_client_factory(strata_auto_sessions, settings=settings)

    return make


def only_complete_files(directory: Path) -> None:
    """No temporary left behind, every session file has its sidecar."""
    names = {p.name for p in directory.iterdir()}
    assert not [n for n in names if n.startswith("tmp-")], names
    for name in names:
        if name.endswith(".bin"):
            assert name[:-4] + ".json" in names, names


# -- the engine killed at the worst moments ----------------------------------------


#: How much of the state the engine may write before it dies in the middle of a save.
PARTIAL_BYTES = 64 * 1024


def unread_bytes_at(port: int) -> int:
    """Bytes sent to ``port`` on this machine that its process has not read yet (IPv4 or
    IPv6; on a connection established, or one its client has closed since)."""
    total = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] in ("01", "08"):  # ESTABLISHED, CLOSE_WAIT
                total += int(fields[4].split(":")[1], 16)
    return total


@pytest.mark.parametrize("during", ["save", "restore"])
async def test_engine_killed_during_a_slot_operation(auto_client, during, caplog):
    """The engine dies in the middle of the call (not before it is sent).

    Save: the engine may write 64 KiB of the state (``RLIMIT_FSIZE``), then dies of
    SIGXFSZ in the middle of the temporary file. Restore: the engine is frozen, the
    restore call reaches its socket, then the engine is killed with SIGKILL. Either
    way the request is answered by the restarted engine once it is ready.
    """
    import resource

    client = await auto_client()
    service = client.app[SERVICE]
    engine = service.engine
    slots = engine.info.slot_save_path
    a, b = conversation("kill-a"), conversation("kill-b")
    await ask(client, a)
    if during == "restore":
        await ask(client, b)  # A saved; B held
    real = getattr(engine, during)
    seen: dict[str, object] = {}

    async def save_dies_writing(filename, slot=0):
        resource.prlimit(engine.pid, resource.RLIMIT_CORE, (0, 0))
        resource.prlimit(engine.pid, resource.RLIMIT_FSIZE, (PARTIAL_BYTES, PARTIAL_BYTES))
        try:
            return await real(filename, slot)
        finally:
            seen["temporary"] = (slots / filename).stat().st_size if (slots / filename).exists() else None

    async def restore_killed_in_flight(filename, slot=0):
        pid = engine.pid
        os.kill(pid, signal.SIGSTOP)
        deadline = time.monotonic() + 10
        while not stopped(pid):  # else a thread not stopped yet may read the call
            assert time.monotonic() < deadline, "the engine's threads did not all stop in 10 s"
            await asyncio.sleep(0.005)
        call = asyncio.create_task(real(filename, slot))
        while unread_bytes_at(engine._port) == 0:
            assert time.monotonic() < deadline and not call.done(), "the restore call never reached the engine"
            await asyncio.sleep(0.005)
        os.kill(pid, signal.SIGKILL)
        seen["killed"] = pid
        return await call

    setattr(engine, during, save_dies_writing if during == "save" else restore_killed_in_flight)
    caplog.set_level(logging.INFO, logger="strata_auto_sessions")
    status, answer = await ask(client, b if during == "save" else a)
    setattr(engine, during, real)
    if during == "save":
        assert seen["temporary"] is not None and 0 < seen["temporary"] <= PARTIAL_BYTES, seen
    # The request waits for the restarted engine to be ready, then is answered.
    assert status == 200, answer
    assert engine.generation == 2, "the engine was restarted"
    verb = "saving" if during == "save" else "restoring"
    assert [r for r in caplog.records if r.levelno == logging.WARNING
            and verb in r.getMessage() and "failed" in r.getMessage()], caplog.text
    only_complete_files(slots)
    if during == "save":
        assert not (slots / f"auto-{service.conversation_key(_req(a))}.bin").exists()
    else:
        assert answer["timings"]["cache_n"] < MIN_TOKENS, "answered by a full prefill"
    # The held state was reset with the restart, then follows the requests again.
    status, _ = await ask(client, conversation("after"))
    assert status == 200
    assert service.slots[0].key == service.conversation_key(_req(conversation("after")))
    await ask(client, a)
    assert parking(client).stats.saves >= 1


def _req(messages):
    from strata_serve.hook_types import StrataRequest

    return StrataRequest(route="chat", body={"messages": messages})


# -- the disk: full, read-only, gone ---------------------------------------------


@contextlib.contextmanager
def tmpfs(path: Path, size: str):
    path.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(path)], check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


async def test_disk_full_during_a_save(auto_client, tmp_path, caplog):
    with tmpfs(tmp_path / "small", "900k") as slots:
        client = await auto_client(slots, blocks=False)  # whole files: the space comes back by removing them
        a, b, c = conversation("full-a"), conversation("full-b"), conversation("full-c")
        await ask(client, a)
        status, _ = await ask(client, b)  # A saved (about 0.5 MB): fits
        assert status == 200 and parking(client).stats.saves == 1
        status, answer = await ask(client, c)  # B's save does not fit
        assert status == 200 and answer["choices"]
        assert parking(client).stats.save_failures == 1
        only_complete_files(slots)
        assert len(list(slots.glob("auto-*.bin"))) == 1
        for leftover in slots.glob("auto-*"):
            leftover.unlink()  # space comes back
        await ask(client, a)  # C saved now
        assert parking(client).stats.saves == 2
        only_complete_files(slots)
        await client.close()


async def test_disk_full_during_a_save_in_blocks(auto_client, tmp_path, caplog):
    """Parking in blocks (the default): the engine's save goes to memory and fits; the new
    blocks do not fit the slot directory. The save fails, logged, the request is answered,
    no temporary is left in the block store, the conversation parked before keeps every
    block it names; once space is back the next save works."""
    with tmpfs(tmp_path / "small", "2m") as slots:
        client = await auto_client(slots)
        a, b, c = conversation("bfull-a"), conversation("bfull-b"), conversation("bfull-c")
        await ask(client, a)
        status, _ = await ask(client, b)  # A saved in blocks (about 0.5 MB): fits
        assert status == 200 and parking(client).stats.saves == 1
        store = parking(client).store
        key_a = client.app[SERVICE].conversation_key(_req(a))
        assert store.blocks is not None and store.blocks.manifest(key_a, 0) is not None
        ballast = slots / "ballast"
        with open(ballast, "wb", buffering=0) as f:  # the file system full to its last byte
            for chunk in (b"\0" * (1 << 16), b"\0" * 512):
                with contextlib.suppress(OSError):
                    while True:
                        f.write(chunk)
        status, answer = await ask(client, c)  # B's blocks do not fit
        assert status == 200 and answer["choices"]
        assert parking(client).stats.save_failures == 1
        assert not [p for p in slots.rglob("*") if p.name.endswith(".tmp") or p.name.startswith("tmp-")]
        assert store.intact(key_a, store.sidecar(key_a)), "A's manifest and blocks untouched"
        assert store.staging is not None and store.staging.on, "the slot directory's disk, not staging's fault"
        ballast.unlink()  # space comes back
        await ask(client, a)  # C saved now
        assert parking(client).stats.saves == 2
        only_complete_files(slots)
        await client.close()


async def test_a_save_the_engine_reports_whole_but_left_short_is_never_kept(auto_client, monkeypatch, caplog):
    """The engine writes a state file through C stdio and does not check the close: the
    last buffered block, written at close, may fail and leave the file short while the
    engine reports every byte written (``n_written``). Made real here with a file size
    limit on the engine's process (``RLIMIT_FSIZE``, its SIGXFSZ ignored, as a shell's
    ``trap '' XFSZ`` leaves it): every write the engine checks fits, the last block does
    not. strata's own writes (the sidecar) are not limited: only the size on disk,
    compared with the engine's count before the file gets its name, tells. The save fails
    and is logged; no file, no temporary; without the limit the next save works."""
    import resource

    from strata_serve.engine.llama_server import process

    engine_preexec = process.engine_preexec

    def ignoring_sigxfsz() -> None:
        engine_preexec()
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # kept through exec: a write past the limit fails

    monkeypatch.setattr(process, "engine_preexec", ignoring_sigxfsz)
    caplog.set_level(logging.INFO, logger="strata_auto_sessions")
    client = await auto_client()
    service = client.app[SERVICE]
    engine = service.engine
    slots = engine.info.slot_save_path
    a, b, c = conversation("short-a"), conversation("short-b"), conversation("short-c")
    await ask(client, a)
    await ask(client, b)  # A saved, whole
    assert parking(client).stats.saves == 1
    # How long B's file is: the engine's own count for a save of the slot as it is.
    probe = await engine.save("probe.bin")
    whole = probe.bytes
    (slots / "probe.bin").unlink()
    block = os.stat(slots).st_blksize
    limit = (whole - 1) // block * block  # all but the last block, the one written at close
    real_save = engine.save
    seen: dict[str, object] = {}

    async def save_under_the_limit(filename, slot=0):
        unlimited = resource.prlimit(engine.pid, resource.RLIMIT_FSIZE)
        resource.prlimit(engine.pid, resource.RLIMIT_FSIZE, (limit, unlimited[1]))  # the soft limit only
        try:
            seen["answer"] = await real_save(filename, slot)
        finally:
            resource.prlimit(engine.pid, resource.RLIMIT_FSIZE, unlimited)
        seen["on_disk"] = (slots / filename).stat().st_size
        return seen["answer"]

    monkeypatch.setattr(engine, "save", save_under_the_limit)
    status, answer = await ask(client, c)  # B is saved for the switch
    monkeypatch.setattr(engine, "save", real_save)
    assert status == 200 and answer["choices"]
    assert seen["answer"].bytes == whole and seen["on_disk"] == limit < whole, (
        "the engine reported every byte and wrote fewer", seen, whole)
    stats = parking(client).stats
    assert stats.save_failures == 1 and stats.saves == 1, stats
    assert any(f"holds {limit:,} bytes; the engine reported {whole:,}" in r.getMessage() for r in caplog.records
               if r.levelno == logging.WARNING), caplog.text
    key_b = service.conversation_key(_req(b))
    assert not (slots / f"auto-{key_b}.bin").exists() and not (slots / f"auto-{key_b}.json").exists()
    only_complete_files(slots)
    status, _ = await ask(client, a)  # C saved, whole
    assert status == 200 and parking(client).stats.saves == 2
    only_complete_files(slots)
    status, back = await ask(client, c)
    assert status == 200 and back["timings"]["cache_n"] > 600, "C's file is whole: restored and reused"


async def test_read_only_directory_then_writable_again(auto_client, tmp_path):
    with tmpfs(tmp_path / "ro", "10m") as slots:
        client = await auto_client(slots)
        a, b = conversation("ro-a"), conversation("ro-b")
        await ask(client, a)
        subprocess.run(["mount", "-o", "remount,ro", str(slots)], check=True)
        status, answer = await ask(client, b)
        assert status == 200 and answer["choices"]
        assert parking(client).stats.save_failures == 1 and parking(client).stats.saves == 0
        subprocess.run(["mount", "-o", "remount,rw", str(slots)], check=True)
        await ask(client, a)
        assert parking(client).stats.saves == 1
        only_complete_files(slots)
        await client.close()


async def test_directory_removed_while_running(auto_client, tmp_path):
    client = await auto_client()
    slots = client.app[SERVICE].engine.info.slot_save_path
    a, b = conversation("gone-a"), conversation("gone-b")
    await ask(client, a)
    shutil.rmtree(slots)
    status, answer = await ask(client, b)
    assert status == 200 and answer["choices"]
    assert parking(client).stats.save_failures == 1
    slots.mkdir()
    await ask(client, a)
    assert parking(client).stats.saves == 1
    only_complete_files(slots)


# -- files that must never be restored --------------------------------------------


async def test_symlink_under_a_session_name_is_never_followed(auto_client, tmp_path, caplog):
    client = await auto_client()
    a = conversation("link")
    key = client.app[SERVICE].conversation_key(_req(a))
    outside = tmp_path / "elsewhere.bin"
    outside.write_bytes(b"\0" * 5000)
    (client.app[SERVICE].engine.info.slot_save_path / f"auto-{key}.bin").symlink_to(outside)
    status, answer = await ask(client, a)
    assert status == 200 and answer["timings"]["cache_n"] == 0
    assert parking(client).stats.restores == 0 and parking(client).stats.restore_failures == 0
    assert outside.read_bytes() == b"\0" * 5000


async def test_a_symlink_under_a_session_name_beside_its_sidecar_is_never_followed(auto_client, tmp_path, caplog):
    """The worst case: a conversation's own file moved outside the directory and a symlink
    left under its name, the sidecar beside it describing the target exactly (size and
    sampled digest). The link is never followed: not restored (the conversation is read
    anew), not listed, not pruned; the target keeps its bytes and time, also when the
    conversation is saved again under its name (the link is replaced, not written through)."""
    from strata_auto_sessions.store import sample_digest

    caplog.set_level(logging.INFO, logger="strata_auto_sessions")
    client = await auto_client(blocks=False)  # a whole file moved out, a link left under its name
    service = client.app[SERVICE]
    slots = service.engine.info.slot_save_path
    store = parking(client).store
    a, b = conversation("linked-a"), conversation("linked-b")
    await ask(client, a)
    await ask(client, b)  # A parked: its file and sidecar
    key = service.conversation_key(_req(a))
    name = f"auto-{key}.bin"
    outside = tmp_path / "outside" / name
    outside.parent.mkdir()
    shutil.move(slots / name, outside)
    (slots / name).symlink_to(outside)
    sidecar = store.sidecar(key)
    assert sidecar is not None and sidecar.bytes == outside.stat().st_size
    assert sample_digest(outside) == sidecar.digest, "the sidecar fits the target"
    kept = outside.read_bytes(), outside.stat().st_mtime_ns

    again = a + [{"role": "assistant", "content": "x"}, {"role": "user", "content": "back"}]
    status, answer = await ask(client, again)
    assert status == 200 and answer["timings"]["cache_n"] < 40, "read anew, never restored through the link"
    stats = parking(client).stats
    assert stats.restores == 0 and stats.restore_failures == 0, stats
    assert any(f"not restoring {name}: it is a symlink" in r.getMessage() for r in caplog.records), caplog.text
    assert key not in dict(store.sessions()) and store.usage()[0] == 1, "only B's file is listed"
    store.prune(keep=0, max_bytes=0, protect=frozenset())
    assert (slots / name).is_symlink(), "a link is never pruned"
    await ask(client, b)  # A leaves the slot: saved under its name
    assert not (slots / name).is_symlink() and (slots / name).is_file()
    assert (outside.read_bytes(), outside.stat().st_mtime_ns) == kept, "the target was touched"


# -- a normal stop in the middle of an answer ----------------------------------------


def wait_for(log_file: Path, text: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if text in log_file.read_text():
            return
        time.sleep(0.05)
    raise AssertionError(f"never saw {text!r}:\n{log_file.read_text()[-3000:]}")


def start_server(tmp_path: Path, model: Path, port: int, log, **settings: str) -> subprocess.Popen:
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "STRATA_PLUGINS__AUTO_SESSIONS__MIN_TOKENS": str(MIN_TOKENS),
        "STRATA_SERVER__SHUTDOWN_GRACE_S": "0.5",
        "STRATA_ENGINE__LOG_LEVEL": "DEBUG",
        **settings,
    }
    return subprocess.Popen(
        [sys.executable, "-m", "strata_serve.cli", "run", "--model", str(model), "--port", str(port),
         "--slot-save-path", str(tmp_path / "slots"), "--cache-ram", "0"],
        stderr=log, env=env,
    )


async def test_sigterm_mid_stream_cuts_cleanly_saves_and_the_next_start_restores(tmp_path, strata_demo_model):
    import aiohttp

    port = listen_port()
    log_file = tmp_path / "server.log"
    a = conversation("sigterm")
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    with open(log_file, "a") as log, start_server(tmp_path, strata_demo_model, port, log) as proc:
        try:
            await asyncio.to_thread(wait_for, log_file, "listening on")
            async with aiohttp.ClientSession() as session:
                async with session.post(url, json=body(a)) as resp:
                    assert resp.status == 200
                async with session.post(url, json=body(a, max_tokens=3000, stream=True)) as resp:
                    await resp.content.readany()
                    began = time.monotonic()
                    proc.send_signal(signal.SIGTERM)
                    rest = (await resp.content.read()).decode()  # a complete stream either way
            assert time.monotonic() - began < 15
            assert "[DONE]" in rest or "the server is shutting down" in rest, rest[-500:]
            assert await asyncio.to_thread(proc.wait, 30) == 0
            text = log_file.read_text()
            assert "(shutdown)" in text and "auto sessions: saved" in text
        finally:
            if proc.poll() is None:
                proc.kill()

    log_file = tmp_path / "second-start.log"
    with open(log_file, "a") as log, start_server(tmp_path, strata_demo_model, port, log) as proc:
        try:
            await asyncio.to_thread(wait_for, log_file, "listening on", 60)
            async with aiohttp.ClientSession() as session:
                async with session.post(url, json=body(a)) as resp:
                    answer = await resp.json()
            assert "auto sessions: restored" in log_file.read_text()
            assert answer["timings"]["cache_n"] > MIN_TOKENS
        finally:
            proc.send_signal(signal.SIGTERM)
            await asyncio.to_thread(proc.wait, 30)


async def hold_a_conversation_then_hang_the_engine(log_file: Path, port: int) -> tuple[str, int]:
    """A conversation worth a file held in the slot (its idle save never comes), then the
    engine frozen with SIGSTOP: it takes calls and answers none, like a hung engine."""
    import aiohttp

    await asyncio.to_thread(wait_for, log_file, "listening on")
    engine_pid = int(re.search(r"engine ready at .* \(pid (\d+)\)", log_file.read_text()).group(1))
    async with aiohttp.ClientSession() as session:
        async with session.post(f"http://127.0.0.1:{port}/v1/chat/completions",
                                json=body(conversation("hung"))) as resp:
            assert resp.status == 200
            key = resp.headers["X-Strata-Conversation"]
        # The answer leaves before its request's turn ends (post_request): the engine is
        # frozen once the turn is over, with no call of that request in flight, so that
        # every later call waits unread in its socket (unread_by_the_engine).
        deadline = time.monotonic() + 30
        while True:
            async with session.get(f"http://127.0.0.1:{port}/stats") as resp:
                if (await resp.json())["phases"]["requests"] >= 1:
                    break
            assert time.monotonic() < deadline, "the request's turn never ended"
            await asyncio.sleep(0.02)
    os.kill(engine_pid, signal.SIGSTOP)
    # A signal is delivered when each thread next runs: a thread woken from its read by
    # the signal may still take a call that arrives meanwhile before it stops. Every
    # thread stopped, a later call stays unread.
    deadline = time.monotonic() + 30
    while not stopped(engine_pid):
        assert time.monotonic() < deadline, "the engine's threads did not all stop in 30 s"
        await asyncio.sleep(0.01)
    return key, engine_pid


def stopped(pid: int) -> bool:
    """Every thread of process ``pid`` is stopped by a signal (state T)."""
    states = []
    for status in Path(f"/proc/{pid}/task").glob("*/status"):
        with contextlib.suppress(FileNotFoundError):
            states.append(re.search(r"^State:\s+(\S)", status.read_text(), re.M).group(1))
    return bool(states) and all(state == "T" for state in states)


def unread_by_the_engine(log_file: Path) -> bool:
    """A request waits in the engine's socket, unread: sent to the frozen engine.

    The engine is frozen after its last answer was read, and nothing but the stop
    calls it then (the supervisor watches its process, not its port).
    """
    port = int(re.search(r"engine ready at http://[^:]+:(\d+) ", log_file.read_text()).group(1))
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(FileNotFoundError):
            for line in Path(table).read_text().splitlines()[1:]:
                fields = line.split()
                local_port, state, queues = int(fields[1].rsplit(":", 1)[1], 16), fields[3], fields[4]
                if local_port == port and state == "01" and int(queues.split(":")[1], 16) > 0:
                    return True
    return False


def gone(pid: int) -> bool:
    """The process has ended (a zombie not yet reaped by its parent counts as ended)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def end_the_engine(pid: int | None) -> None:
    """A test that failed must not leave a frozen engine behind."""
    if pid is not None and not gone(pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


async def test_a_stop_with_the_engine_hung_ends_within_its_bound_and_names_what_it_did_not_save(
    tmp_path, strata_demo_model
):
    # The shutdown save used to wait on the engine as long as engine.request_timeout_s
    # (3,600 s): 45 s after SIGTERM the server still ran.
    port = listen_port()
    log_file = tmp_path / "server.log"
    engine_pid = None
    with open(log_file, "a") as log, start_server(
        tmp_path, strata_demo_model, port, log, STRATA_SERVER__SHUTDOWN_SAVE_S="3",
        STRATA_PLUGINS__AUTO_SESSIONS__IDLE_SAVE_S="0",
    ) as proc:
        try:
            key, engine_pid = await hold_a_conversation_then_hang_the_engine(log_file, port)
            began = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            # The bound: 3 s of saves, then the engine's 10 s to heed SIGTERM before SIGKILL.
            assert await asyncio.to_thread(proc.wait, 60) == 0
            took = time.monotonic() - began
            text = log_file.read_text()
            assert "the stop's saves did not finish in 3 s" in text, text[-3000:]
            assert f"not saved: conversation {key} (slot 0, " in text
            assert "[strata] stopped" in text
            assert took < 45, f"the stop took {took:.0f} s"
            assert gone(engine_pid), "the frozen engine is killed with the server"
            assert not list((tmp_path / "slots").glob("auto-*.bin"))
        finally:
            if proc.poll() is None:
                proc.kill()
            end_the_engine(engine_pid)


@pytest.mark.parametrize("second", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
async def test_a_second_signal_stops_at_once(tmp_path, strata_demo_model, second):
    # Left to its bound (server.shutdown_save_s, 60 s by default), this stop would take a
    # minute more; a second signal used to be ignored.
    port = listen_port()
    log_file = tmp_path / "server.log"
    engine_pid = None
    with open(log_file, "a") as log, start_server(
        tmp_path, strata_demo_model, port, log, STRATA_PLUGINS__AUTO_SESSIONS__IDLE_SAVE_S="0",
    ) as proc:
        try:
            key, engine_pid = await hold_a_conversation_then_hang_the_engine(log_file, port)
            proc.send_signal(signal.SIGTERM)
            await asyncio.to_thread(wait_for, log_file, "[strata] stopping:")
            # The stop's save is sent, and waits on the frozen engine.
            deadline = time.monotonic() + 30
            while not unread_by_the_engine(log_file):
                assert proc.poll() is None and time.monotonic() < deadline, (
                    f"the stop called no engine in 30 s:\n{log_file.read_text()[-3000:]}")
                await asyncio.sleep(0.02)
            assert proc.poll() is None, "the first signal alone does not stop it this soon"
            began = time.monotonic()
            proc.send_signal(second)
            assert await asyncio.to_thread(proc.wait, 30) == 0
            took = time.monotonic() - began
            text = log_file.read_text()
            assert "stopping now" in text and f"not saved: conversation {key} (slot 0, " in text, text[-3000:]
            assert "[strata] stopped" in text
            assert took < 10, f"the stop took {took:.0f} s after the second signal"
            assert gone(engine_pid), "the frozen engine is killed with the server"
        finally:
            if proc.poll() is None:
                proc.kill()
            end_the_engine(engine_pid)


# -- load ------------------------------------------------------------------------


async def test_twenty_clients_five_conversations_ten_turns(auto_client, llama_server_factory, tmp_path):
    """Every answer the same as the same conversation's run alone (top logprobs, on a
    model whose answers depend on their state); nothing lost; memory flat."""
    model = sharp_demo_model(tmp_path)
    names = [f"load{n}" for n in range(5)]

    def next_turn(messages: list[dict], answer: dict, turn: int) -> list[dict]:
        return messages + [{"role": "assistant", "content": text_of(answer)}, {"role": "user", "content": f"turn {turn}?"}]

    reference: dict[str, list[dict]] = {}
    alone = await llama_server_factory(model=model)
    for name in names:
        messages, answers = conversation(name), []
        for turn in range(10):
            answers.append(await engine_ask(alone, logprob_body(messages, LOAD_TOKENS)))
            messages = next_turn(messages, answers[-1], turn)
        reference[name] = answers
    # The control: the second turn of the first conversation, answered from a wrong state.
    first = conversation(names[0])
    wrong = await wrong_state_answer(alone, alone.info.slot_save_path, first, reordered(first),
                                     next_turn(first, reference[names[0]][0], 0), LOAD_TOKENS)
    assert logprob_distance(wrong, reference[names[0]][1]) > WRONG_STATE_DISTANCE

    client = await auto_client(model=str(model))
    statuses: list[int] = []

    async def one_client(n: int) -> list[dict]:
        name = names[n % 5]
        messages, answers = conversation(name), []
        for turn in range(10):
            resp = await client.post("/v1/chat/completions", json=logprob_body(messages, LOAD_TOKENS))
            statuses.append(resp.status)
            answers.append(await resp.json())
            messages = next_turn(messages, answers[-1], turn)
        return answers

    def rss_kib() -> int:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
        return 0

    first_round = await asyncio.gather(*(one_client(n) for n in range(20)))
    rss_after_first = rss_kib()
    second_round = await asyncio.gather(*(one_client(n) for n in range(20)))
    assert statuses == [200] * 400
    distances = [(n, turn, logprob_distance(answer, reference[names[n % 5]][turn]))
                 for n, answers in enumerate(first_round + second_round) for turn, answer in enumerate(answers)]
    assert all(d <= PATH_TOLERANCE for _, _, d in distances), [(n, t, d) for n, t, d in distances
                                                                if d > PATH_TOLERANCE]
    stats = parking(client).stats
    assert stats.restores > 20 and stats.save_failures == 0 and stats.restore_failures == 0
    service = client.app[SERVICE]
    await until_idle(service)  # the last answers left before their post_request steps ended
    assert service.fifo.idle and not service._tasks
    assert rss_kib() - rss_after_first < 50_000, "memory grows with traffic"


# -- a stop while a plugin's own task waits for the FIFO ----------------------------------


class BackgroundHolder:
    """Test double of a plugin that uses the engine from a task of its own (like a save
    while idle): the task takes the FIFO, and ``on_shutdown`` waits for it to finish."""

    strata_name = "background_holder"

    def __init__(self) -> None:
        self.task: asyncio.Task | None = None
        self.events: list[str] = []

    async def work(self, service) -> None:
        async with service.fifo.hold():
            self.events.append("background work")

    @strata_serve.hookimpl
    async def on_shutdown(self, service):
        if self.task is not None:
            await self.task
        self.events.append("on_shutdown")


async def test_shutdown_right_after_a_plugin_task_started_does_not_deadlock(strata_client_factory):
    """The task is created, then the stop begins before it has run at all.

    On Python 3.12+ ``asyncio.wait_for`` on an idle FIFO returns without yielding, so the
    stop used to take the FIFO first and then wait, in ``on_shutdown``, for a task that
    waited for the FIFO.
    """
    holder = BackgroundHolder()
    client = await strata_client_factory(holder)
    service = client.app[SERVICE]
    status, _ = await ask(client, [{"role": "user", "content": "hello"}])
    await until_idle(service)
    assert status == 200 and service.fifo.idle
    holder.task = asyncio.create_task(holder.work(service))
    await asyncio.wait_for(service.shutdown(), 10)
    assert holder.events == ["background work", "on_shutdown"]
