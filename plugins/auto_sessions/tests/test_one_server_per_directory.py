"""One server per slot directory: a second server's start on a directory a live server
uses is refused (it would undo that one's pending removals); a killed server's lock
never blocks the next start. Real server processes (``strata-serve run``)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
from click.testing import CliRunner

from strata_serve.cli import cli
from strata_serve.testing import chat, conversation

MIN_TOKENS = 100


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start(slots: Path, model: Path, port: int, log_file: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "STRATA_PLUGINS__AUTO_SESSIONS__MIN_TOKENS": str(MIN_TOKENS),
           "STRATA_PLUGINS__AUTO_SESSIONS__IDLE_SAVE_S": "0", "STRATA_SERVER__SHUTDOWN_GRACE_S": "0.5",
           # One slot: the test parks and restores a conversation a side slot would keep.
           "STRATA_ENGINE__SIDE_SLOT_TOKENS": "0"}
    with open(log_file, "a") as log:
        # A session of its own: a kill -9 of the group takes the server and its engine.
        return subprocess.Popen(
            [sys.executable, "-m", "strata_serve.cli", "run", "--model", str(model), "--port", str(port),
             "--slot-save-path", str(slots), "--cache-ram", "0"],
            stderr=log, stdout=log, env=env, start_new_session=True)


def wait_for(log_file: Path, text: str, proc: subprocess.Popen, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if text in log_file.read_text():
            return
        assert proc.poll() is None or text in log_file.read_text(), log_file.read_text()[-3000:]
        time.sleep(0.1)
    raise AssertionError(f"never saw {text!r}:\n{log_file.read_text()[-3000:]}")


async def ask(port: int, messages: list[dict]) -> dict:
    async with aiohttp.ClientSession() as session:
        async with session.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=chat(messages)) as resp:
            assert resp.status == 200, await resp.text()
            return await resp.json()


def stop(proc: subprocess.Popen, sig: int = signal.SIGTERM) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, sig)
        proc.wait(30)


async def test_a_second_server_on_a_directory_in_use_is_refused_and_a_killed_ones_lock_is_not(
        tmp_path, strata_demo_model):
    slots = tmp_path / "slots"
    port, log = free_port(), tmp_path / "first.log"
    first = start(slots, strata_demo_model, port, log)
    try:
        await asyncio.to_thread(wait_for, log, "[strata] listening on", first)
        a, b = conversation("kept-away"), conversation("other")
        await ask(port, a)
        await ask(port, b)  # a parked
        await ask(port, a)  # a restored: held by the first server, its file current
        key = re.findall(r"restored [\d,]+ tokens from auto-([\w-]+)\.bin", log.read_text())[-1]
        result = await asyncio.to_thread(CliRunner().invoke, cli, ["sessions", "--slot-dir", str(slots), "rm", key])
        assert result.exit_code == 0 and f"removed {key}" in result.output, result.output

        second_log = tmp_path / "second.log"
        second = start(slots, strata_demo_model, free_port(), second_log)
        try:
            # It ends (its log then complete), or it listens: a failure, seen at once.
            deadline = time.monotonic() + 120
            while second.poll() is None and "[strata] listening on" not in second_log.read_text():
                assert time.monotonic() < deadline, "the second server neither started nor stopped"
                await asyncio.sleep(0.05)
            code = second.poll()
        finally:
            stop(second, signal.SIGKILL)
        text = second_log.read_text()
        assert code is not None and code != 0 and "[strata] listening on" not in text, text[-3000:]
        assert f"another strata-serve server (pid {first.pid}) uses the slot directory {slots}" in text, text[-3000:]
        assert key in json.loads((slots / "auto-.removed.json").read_text()), "the pending removal stands"

        await ask(port, b)  # a leaves the first server's slot: its save is dropped
        assert not (slots / f"auto-{key}.bin").exists(), "the removed conversation never came back"
        await ask(port, conversation("held-at-the-kill"))  # held, never saved
        # A plain answer leaves before post_request records the slot's new holder: until
        # then the record still names b, parked as the request came in.
        deadline, held = time.monotonic() + 30, []
        while len(held) != 1:
            assert time.monotonic() < deadline, f"the held record never came down to one: {held}"
            await asyncio.sleep(0.05)
            with contextlib.suppress(FileNotFoundError):  # between the record's two renames
                held = json.loads((slots / "auto-.held.json").read_text())["keys"]
        assert not (slots / f"auto-{held[0]}.bin").exists()
    finally:
        stop(first, signal.SIGKILL)  # kill -9: its lock file stays behind, unheld

    assert (slots / "auto-.server.json").exists()
    # What the killed server held is held by no one: rm does not take its word for it.
    result = await asyncio.to_thread(CliRunner().invoke, cli, ["sessions", "--slot-dir", str(slots), "rm", held[0]])
    assert result.exit_code == 1 and f"no session {held[0]!r}" in result.output, result.output
    third_log = tmp_path / "third.log"
    third = start(slots, strata_demo_model, port, third_log)
    try:
        await asyncio.to_thread(wait_for, third_log, "[strata] listening on", third)
        reply = await ask(port, conversation("after-the-kill"))
        assert reply["choices"], reply
    finally:
        stop(third)
