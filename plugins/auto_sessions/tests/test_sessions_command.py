"""``strata-serve sessions``: ls, inspect, rm, prune, on files a real server parked, and
rm while that server runs."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

import strata_auto_sessions
from strata_auto_sessions.naming import HELD_NAME
from strata_auto_sessions.parked_blocks import ParkedBlocks
from strata_auto_sessions.store import SessionStore, Sidecar, file_key
from strata_serve.api import SERVICE
from strata_serve.cli import cli
from strata_serve.testing import ask, conversation

from tests.parked_state import settle

from strata_auto_sessions.testing import is_parked
from .test_auto_sessions import key_of, log_lines, parking, slot_dir

KEYS = {"api_keys": {"alice": "alice-key", "bob": "bob-key"}}


def more(messages: list[dict], text: str) -> list[dict]:
    return messages + [{"role": "assistant", "content": "ok"}, {"role": "user", "content": text}]


def sessions(directory, *args) -> tuple[int, str]:
    result = CliRunner().invoke(cli, ["sessions", "--slot-dir", str(directory), *args])
    return result.exit_code, result.output


def listed(directory) -> dict[str, dict]:
    code, output = sessions(directory, "ls", "--json")
    assert code == 0, output
    return {row["key"]: row for row in map(json.loads, output.splitlines())}


async def park_three(strata_client_factory, strata_settings_factory, **plugin_config) -> Path:
    settings = strata_settings_factory(plugins={"auto_sessions": {"min_tokens": 100, **plugin_config}},
                                       server={"port": 0, "shutdown_grace_s": 10, **KEYS})
    client = await strata_client_factory(strata_auto_sessions, settings=settings)
    for name, key in (("one", "alice-key"), ("two", "alice-key"), ("three", "bob-key")):
        await ask(client, conversation(name), key=key, max_tokens=4)
    directory = slot_dir(client)
    await client.close()
    return directory


@pytest.fixture
async def parked(strata_client_factory, strata_settings_factory):
    """A slot directory where a stopped server parked alice's two conversations and bob's one."""
    return await park_three(strata_client_factory, strata_settings_factory)


@pytest.fixture
async def parked_whole(strata_client_factory, strata_settings_factory):
    """:func:`parked`, as whole files (the listing of blocks: test_block_parking.py)."""
    return await park_three(strata_client_factory, strata_settings_factory, blocks=False)


def test_the_sessions_command_is_offered_by_auto_sessions():
    result = CliRunner().invoke(cli, ["--help"])
    assert result.exit_code == 0 and re.search(r"\n  sessions +The parked conversations", result.output), result.output


@pytest.mark.parametrize("command", ["ls", "rm", "inspect", "prune"])
def test_each_commands_help_needs_no_settings(command, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)  # no strata.toml found by default
    for name in [n for n in os.environ if n.startswith("STRATA_")]:
        monkeypatch.delenv(name)
    result = CliRunner().invoke(cli, ["sessions", command, "--help"])
    assert result.exit_code == 0 and result.output.startswith(f"Usage: cli sessions {command}"), result.output
    # The command itself still says what it lacks.
    result = CliRunner().invoke(cli, ["sessions", "ls"])
    assert result.exit_code == 1 and "no slot directory" in result.output, result.output


async def test_ls_shows_every_session_with_its_tenant_size_and_whether_the_engine_can_use_it(parked_whole):
    parked = parked_whole
    rows = listed(parked)
    assert sorted(row["tenant"] for row in rows.values()) == ["alice", "alice", "bob"]
    for key, row in rows.items():
        assert row["tokens"] > 700 and row["bytes"] == (parked / f"auto-{key}.bin").stat().st_size
        assert row["compatible"] == "yes"
    code, output = sessions(parked, "ls")
    assert code == 0 and "COMPATIBLE" in output and "3 session(s)" in output
    # A file saved with another KV cache type: told apart, with the reason.
    key = next(iter(rows))
    sidecar = json.loads((parked / f"auto-{key}.json").read_text())
    sidecar["fingerprint"]["layout"]["cache_type_k"] = "q8_0"
    (parked / f"auto-{key}.json").write_text(json.dumps(sidecar))
    assert listed(parked)[key]["compatible"].startswith("no (cache_type): cache_type_k differs: saved with q8_0")


async def test_inspect_shows_one_session(parked_whole):
    parked = parked_whole
    key = next(iter(listed(parked)))
    code, output = sessions(parked, "inspect", key)
    assert code == 0, output
    assert f"auto-{key}.bin" in output and "intact: yes" in output and "compatible: yes" in output
    assert "message boundaries" in output and '"tenant"' in output
    (parked / f"auto-{key}.bin").write_bytes(b"damaged")
    assert "intact: no" in sessions(parked, "inspect", key)[1]
    code, output = sessions(parked, "inspect", "nosuch")
    assert code == 1 and "no session 'nosuch'" in output
    for odd in ("../../etc/passwd", "a.b", "", "auto-x"):
        code, output = sessions(parked, "inspect", odd)
        assert code == 1 and f"no session {odd!r}" in output and "Traceback" not in output, (odd, output)


async def test_rm_a_key_a_tenant_or_all(parked):
    rows = listed(parked)
    alice = [key for key, row in rows.items() if row["tenant"] == "alice"]
    (bob,) = [key for key, row in rows.items() if row["tenant"] == "bob"]
    code, output = sessions(parked, "rm", "nosuch", alice[0])
    assert code == 1 and "nothing removed" in output and len(listed(parked)) == 3
    code, output = sessions(parked, "rm")
    assert code == 2 and "one of them" in output

    assert sessions(parked, "rm", alice[0])[0] == 0
    assert sorted(listed(parked)) == sorted([alice[1], bob])
    assert not is_parked(parked, alice[0]) and not (parked / f"auto-{alice[0]}.json").exists()
    code, output = sessions(parked, "rm", "--tenant", "bob")
    assert code == 0 and f"removed {bob}" in output and sorted(listed(parked)) == [alice[1]]
    code, output = sessions(parked, "rm", "--all")
    assert code == 0 and "1 session(s) removed" in output and listed(parked) == {}


async def test_prune_keeps_the_newest_within_max_gb(parked):
    rows = listed(parked)
    newest = min(rows, key=lambda key: rows[key]["last_used_s"])
    one_file = rows[newest]["bytes"] / 1024**3
    code, output = sessions(parked, "prune", "--max-gb", f"{one_file * 1.5:.9f}")
    assert code == 0 and "2 session(s) pruned; 1 left" in output, output
    assert list(listed(parked)) == [newest]


def waits_for_a_flock(path: Path) -> bool:
    """A process of ours is blocked in ``flock`` on ``path`` (``/proc/locks`` lists it after ``->``)."""
    inode, pid = str(path.stat().st_ino), str(os.getpid())
    for line in Path("/proc/locks").read_text().splitlines():
        fields = line.split()
        if fields[1:3] == ["->", "FLOCK"] and fields[5] == pid and fields[6].rsplit(":", 1)[1] == inode:
            return True
    return False


async def test_rm_waits_for_a_save_in_progress(parked):
    """The lock: while the server holds it (a commit, a prune, a restore), rm waits."""
    key = next(iter(listed(parked)))
    server_side = SessionStore(parked)
    done = threading.Event()
    with server_side.lock():
        worker = threading.Thread(target=lambda: (sessions(parked, "rm", key), done.set()))
        worker.start()
        deadline = time.monotonic() + 10
        while not waits_for_a_flock(parked):  # rm's flock, blocked behind the server's
            assert not done.is_set(), "rm ran while the lock was held"
            assert time.monotonic() < deadline, "rm never waited for the lock"
            time.sleep(0.01)
        assert not done.is_set(), "rm ran while the lock was held"
        assert is_parked(parked, key)
    worker.join(timeout=10)
    assert done.is_set() and not is_parked(parked, key)


async def test_rm_while_the_server_runs_is_never_undone_by_its_saves(auto_client, caplog):
    caplog.set_level(logging.INFO, logger="strata_auto_sessions")
    client = await auto_client()
    a, b = conversation("secret"), conversation("other")
    await ask(client, a)
    await ask(client, b)       # a is parked
    await ask(client, a)       # a is restored: the slot holds it, and its file
    key = key_of(client, a)
    directory = slot_dir(client)
    assert client.app[SERVICE].slots[0].key == key

    code, output = await asyncio.to_thread(sessions, directory, "rm", key)
    assert code == 0 and f"removed {key}" in output
    await ask(client, a + [{"role": "assistant", "content": "x"}, {"role": "user", "content": "more"}])
    await ask(client, b)       # the switch would save a again: dropped, the slot erased
    assert not is_parked(directory, key) and not (directory / f"auto-{key}.json").exists()
    assert any(f"{key} was removed by hand" in line for line in log_lines(caplog))
    assert key not in listed(directory)
    again = await ask(client, a)
    assert again["timings"]["cache_n"] < 40, "nothing of it was kept"
    assert parking(client).stats.restores == 2, "a before the rm, b after it: nothing since"


async def test_prune_while_the_server_holds_a_conversation_does_not_lose_it(auto_client, caplog):
    """Pruning is about disk, not deletion: the held conversation whose file is pruned is
    saved again when it leaves the slot, and comes back from that file."""
    caplog.set_level(logging.INFO, logger="strata_auto_sessions")
    client = await auto_client(idle_save_s=0.2)
    a, b = conversation("kept"), conversation("next")
    await ask(client, a)
    key, directory, stats = key_of(client, a), slot_dir(client), parking(client).stats
    deadline = time.monotonic() + 20
    while stats.idle_saves < 1:  # saved while idle: its file is current
        assert time.monotonic() < deadline, "no save while idle"
        await asyncio.sleep(0.05)
    assert client.app[SERVICE].slots[0].file_current

    code, output = await asyncio.to_thread(sessions, directory, "prune", "--max-gb", "0")
    assert code == 0 and f"pruned {key}" in output, output
    assert not is_parked(directory, key)

    await ask(client, b)  # a leaves the slot: its file is gone, so it is saved again
    assert is_parked(directory, key)
    assert stats.saves == 2 and stats.save_skips_unchanged == 0
    assert any(f"{key}'s file is gone since it was saved: saving it again" in line for line in log_lines(caplog))
    back = await ask(client, a)
    assert stats.restores == 1 and back["timings"]["cache_n"] > 600, "a came back from its file"


async def test_rm_of_a_held_conversation_whose_file_is_current_erases_it_from_the_slot(auto_client, caplog):
    """rm is deletion: the held copy goes too, even when the file was current (nothing left to save)."""
    caplog.set_level(logging.INFO, logger="strata_auto_sessions")
    client = await auto_client(idle_save_s=0.2)
    a, b = conversation("secret"), conversation("next")
    await ask(client, a)
    key, directory, stats = key_of(client, a), slot_dir(client), parking(client).stats
    deadline = time.monotonic() + 20
    while stats.idle_saves < 1:
        assert time.monotonic() < deadline, "no save while idle"
        await asyncio.sleep(0.05)

    code, output = await asyncio.to_thread(sessions, directory, "rm", key)
    assert code == 0 and f"removed {key}" in output, output
    await ask(client, b)  # a leaves the slot: its save is dropped and the slot erased
    assert not is_parked(directory, key)
    assert any(f"{key} was removed by hand" in line for line in log_lines(caplog))
    again = await ask(client, a)
    assert again["timings"]["cache_n"] < 40, "nothing of it was kept"


@pytest.mark.parametrize("field, value", [("last_used", "1"), ("tokens", "10")])
@pytest.mark.parametrize("blocks", [False, True], ids=["whole", "blocks"])
async def test_a_wrong_typed_sidecar_is_refused_and_parking_goes_on(auto_client, caplog, field, value, blocks):
    """One sidecar with a field of another type: that file is refused (logged, counted,
    listed as damaged); the server starts with auto-sessions on, parks and restores the others."""
    caplog.set_level(logging.INFO, logger="strata_auto_sessions")
    first = await auto_client(idle_save_s=0, blocks=blocks)
    a, b, c = conversation("typed-a"), conversation("typed-b"), conversation("typed-c")
    await ask(first, a)
    await ask(first, b)  # a is parked
    await first.close()  # b too
    directory, key_a, key_b = slot_dir(first), key_of(first, a), key_of(first, b)
    sidecar = json.loads((directory / f"auto-{key_a}.json").read_text())
    sidecar[field] = value
    (directory / f"auto-{key_a}.json").write_text(json.dumps(sidecar))

    code, output = sessions(directory, "ls")
    assert code == 0 and "Traceback" not in output, output
    client = await auto_client(idle_save_s=0, blocks=blocks)
    stats = parking(client).stats  # auto-sessions started
    assert stats.damaged_files == 1 and stats.files_on_disk == 1
    assert any(f"auto-{key_a}.bin is left alone" in line and repr(field) in line for line in log_lines(caplog))
    rows = listed(directory)
    assert rows[key_a]["compatible"].startswith("no (damaged)") and repr(field) in rows[key_a]["damaged"]
    assert rows[key_b]["compatible"] == "yes"

    back = await ask(client, b)
    assert stats.restores == 1 and back["timings"]["cache_n"] > 600, "b came back from its file"
    await ask(client, c)  # b is saved again, c answered
    by_tokens = stats.restores_by_tokens
    refused = await ask(client, a)
    if not blocks:  # nothing says the whole file is this conversation's: never restored
        assert stats.restores_refused_damaged == 1 and stats.restore_failures == 0
        assert refused["timings"]["cache_n"] < 40
        assert any(f"not restoring auto-{key_a}.bin: its sidecar is damaged" in line for line in log_lines(caplog))
    else:
        # Left alone as a whole file is (its manifest kept through the start and the saves'
        # prunes); its blocks, named by the tokens they hold, come back by the prompt's tokens.
        assert ParkedBlocks.existing(directory).manifest(key_a, 0) is not None
        assert stats.restores_by_tokens == by_tokens + 1 and refused["timings"]["cache_n"] > 600, refused["timings"]
    await ask(client, b)  # a leaves the slot: saved with a sound sidecar
    assert stats.restores == (3 if blocks else 2) and listed(directory)[key_a]["compatible"] == "yes"


HOLD_LOCK = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDONLY | os.O_DIRECTORY)
fcntl.flock(fd, fcntl.LOCK_EX)
print("held", flush=True)
time.sleep(float(sys.argv[2]))
"""


@pytest.mark.parametrize("hold_s, lock_wait_s, saved", [(6, 60, True), (60, 3, False)],
                         ids=["released-in-time", "held-too-long"])
async def test_a_lock_held_by_another_process_never_stops_the_server(auto_client, caplog, hold_s, lock_wait_s,
                                                                     saved):
    """Another process (a second server whose engine hangs in a restore, a `sessions`
    command) holds the directory's lock while this server switches conversations: /health
    answers at once meanwhile; the switch waits for the lock, at most lock_wait_s, then
    gives its save up (logged); the request is answered 200 either way."""
    import subprocess
    import sys

    caplog.set_level(logging.INFO, logger="strata_auto_sessions")
    client = await auto_client(idle_save_s=0, lock_wait_s=lock_wait_s)
    a, b = conversation("locked-a"), conversation("locked-b")
    await ask(client, a)
    directory, stats = slot_dir(client), parking(client).stats
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(directory), str(hold_s)],
                              stdout=subprocess.PIPE)
    try:
        assert await asyncio.wait_for(asyncio.to_thread(holder.stdout.readline), 30) == b"held\n"
        loop = asyncio.get_running_loop()
        switch = asyncio.create_task(client.post("/v1/chat/completions",
                                                 json={"messages": b, "max_tokens": 4, "temperature": 0}))
        watched_until = loop.time() + min(hold_s, lock_wait_s) - 1.5
        answers = []
        while loop.time() < watched_until:
            began = loop.time()
            health = await asyncio.wait_for(client.get("/health"), 30)
            answers.append((round(loop.time() - began, 2), health.status))
            await asyncio.sleep(0.25)
        assert answers and all(took < 1.0 and status == 200 for took, status in answers), answers
        assert not switch.done(), "the switch did not wait for the lock"
        resp = await asyncio.wait_for(switch, 120)
        assert resp.status == 200, await resp.text()
    finally:
        holder.kill()
        holder.wait()
        holder.stdout.close()
    key_a = key_of(client, a)
    if saved:
        assert stats.saves == 1 and is_parked(directory, key_a)
    else:
        assert stats.saves == 0 and stats.save_failures == 1 and not is_parked(directory, key_a)
        assert any(f"saving {key_a} given up" in line and "lock" in line for line in log_lines(caplog))
        assert not list(directory.glob("tmp-auto-*")), "no temporary left"
    again = await ask(client, a)  # the lock is free: the switch back parks b as ever
    assert stats.saves == (2 if saved else 1) and is_parked(directory, key_of(client, b))
    if saved:
        assert stats.restores == 1 and again["timings"]["cache_n"] > 600, "a came back from its file"


async def test_rm_of_a_held_conversation_not_yet_saved_by_key(auto_client, caplog):
    """No file yet: rm finds it among what the server holds, says so, and it is never written."""
    caplog.set_level(logging.INFO, logger="strata_auto_sessions")
    client = await auto_client(idle_save_s=0)
    a, b = conversation("unsaved"), conversation("next")
    await ask(client, a)
    key, directory = key_of(client, a), slot_dir(client)
    assert client.app[SERVICE].slots[0].key == key and not is_parked(directory, key)

    code, output = await asyncio.to_thread(sessions, directory, "rm", key)
    assert code == 0, output
    assert f"removed {key}: held by the running server, not saved yet" in output and "1 session(s) removed" in output
    await ask(client, b)  # the switch would save a: dropped, the slot erased
    assert not is_parked(directory, key) and not (directory / f"auto-{key}.json").exists()
    assert any(f"{key} was removed by hand" in line for line in log_lines(caplog))
    again = await ask(client, a)
    assert again["timings"]["cache_n"] < 40, "nothing of it was kept"
    code, output = await asyncio.to_thread(sessions, directory, "rm", "nosuch")
    assert code == 1 and "no session 'nosuch'" in output, "only what the server holds or parked is removable"


async def test_rm_of_a_conversation_left_to_the_engines_ram_cache_drops_it_at_the_stop(auto_client, caplog):
    """Left to the engine's RAM cache, a conversation has no file and no slot, yet it is the
    server's: the in-use record names it, so rm finds it, and the stop, which saves every
    conversation left in RAM, drops it. And a switch between conversations the server
    already holds (in its slot or in the engine's RAM) has nothing new to record: no write."""
    caplog.set_level(logging.INFO, logger="strata_auto_sessions")
    client = await auto_client(engine={"cache_ram_mib": 256}, idle_save_s=600)
    a, b, c = conversation("ram-rm-a"), conversation("ram-rm-b"), conversation("ram-rm-c")
    for messages in (a, b, c):
        await ask(client, messages)
    stats, directory = parking(client).stats, slot_dir(client)
    assert stats.ram_switches == 2, "a and b left the slot through the engine's RAM cache"
    key_a, key_b, key_c = (key_of(client, messages) for messages in (a, b, c))
    assert is_parked(directory, key_a), "the first switch saved a (it measures a state's size)"
    assert not is_parked(directory, key_b), "b is in the engine's RAM alone"
    record = directory / HELD_NAME
    assert sorted(json.loads(record.read_text())["keys"]) == sorted([key_a, key_b, key_c])
    store, writes = parking(client).store, []
    write = store.record_held
    store.record_held = lambda keys: (writes.append(keys), write(keys))[1]
    await ask(client, more(a, "and a again?"))  # c leaves for RAM, a comes back from it
    assert stats.ram_switches == 3 and stats.ram_hits == 1
    assert writes == [], "the same three conversations: nothing was written"

    code, output = await asyncio.to_thread(sessions, directory, "rm", key_b)
    assert code == 0, output
    assert f"removed {key_b}: held by the running server, not saved yet" in output, output
    await client.close()  # the stop brings each conversation left in RAM back and saves it
    assert is_parked(directory, key_c), "the stop saved what was left in RAM"
    assert not is_parked(directory, key_b), "but not the one removed by hand"
    assert any(f"{key_b} was removed by hand" in line for line in log_lines(caplog))


async def test_rm_of_a_tenant_takes_its_held_conversation_not_yet_saved(strata_client_factory,
                                                                         strata_settings_factory, caplog):
    caplog.set_level(logging.INFO, logger="strata_auto_sessions")
    settings = strata_settings_factory(plugins={"auto_sessions": {"min_tokens": 100, "idle_save_s": 0}},
                                       server={"port": 0, "shutdown_grace_s": 10, **KEYS})
    client = await strata_client_factory(strata_auto_sessions, settings=settings)
    a, b = conversation("alice-unsaved"), conversation("bob-parked")
    await ask(client, b, key="bob-key")
    await ask(client, a, key="alice-key")  # bob's parked, alice's held and not saved
    directory = slot_dir(client)
    held = client.app[SERVICE].slots[0]
    alice = held.key
    assert held.tenant == "alice" and not is_parked(directory, alice)

    code, output = await asyncio.to_thread(sessions, directory, "rm", "--tenant", "alice")
    assert code == 0, output
    assert f"removed {alice}: held by the running server" in output and "1 session(s) removed" in output
    assert [row["tenant"] for row in listed(directory).values()] == ["bob"], "bob's file stays"
    back = await ask(client, b, key="bob-key")  # alice's leaves the slot: dropped
    assert back["timings"]["cache_n"] > 600, "bob's came back from its file"
    assert not is_parked(directory, alice)
    again = await ask(client, a, key="alice-key")
    assert again["timings"]["cache_n"] < 40, "nothing of alice's was kept"


async def test_a_conversation_started_anew_after_its_rm_parks_normally(auto_client, caplog):
    """The removal is about the state that existed when rm ran (its time against when the
    slot's state began): the same key's conversation started afresh later is saved, and
    comes back from its file."""
    caplog.set_level(logging.INFO, logger="strata_auto_sessions")
    client = await auto_client(idle_save_s=0)
    a, b = conversation("removed-then-anew"), conversation("between")
    await ask(client, a)
    await ask(client, b)  # a parked
    key, directory, stats = key_of(client, a), slot_dir(client), parking(client).stats
    code, output = await asyncio.to_thread(sessions, directory, "rm", key)
    assert code == 0 and f"removed {key} (" in output, output

    anew = await ask(client, a)  # started anew by its client: read from the start
    assert anew["timings"]["cache_n"] < 40
    assert client.app[SERVICE].slots[0].since > SessionStore(directory).removed_by_hand()[key]
    await ask(client, b)  # a leaves the slot: saved, not dropped
    assert is_parked(directory, key), "the new state was saved"
    assert not any(f"{key} was removed by hand" in line for line in log_lines(caplog))
    assert key not in SessionStore(directory).removed_by_hand(), "the removal is done with"
    restores = stats.restores
    back = await ask(client, a)
    assert back["timings"]["cache_n"] > 600 and stats.restores == restores + 1, "it came back from its file"


def test_a_removal_drops_the_saves_of_a_state_begun_before_it_only(tmp_path):
    """The marker's recorded time against when the saved state began (``created``): at or
    before it, every save is dropped; after it, the save is kept and the removal done with."""
    store = SessionStore(tmp_path)

    def save(created: float) -> bool:
        temp = store.temp_name("k")
        (tmp_path / temp).write_bytes(b"state")
        kept = store.commit(temp, "k", Sidecar(key="k", fingerprint={}, tokens=1, bytes=5, created=created,
                                               last_used=created, digest=""))
        assert not (tmp_path / temp).exists(), "no temporary left either way"
        return kept

    store.remove_by_hand(["k"])
    removed_at = store.removed_by_hand()["k"]
    assert save(removed_at - 3600) is False and save(removed_at) is False, "a state the rm was about"
    assert not store.bin_path("k").exists() and "k" in store.removed_by_hand()
    assert save(removed_at + 1) is True, "a state begun after the rm"
    assert store.bin_path("k").exists() and "k" not in store.removed_by_hand()


#: ``strata-serve sessions rm`` in a process of its own, its interpreter started ahead so a
#: removal can be timed to the millisecond. For each JSON line read (``key``, ``delay_s``,
#: ``watch``: the name prefix of the save's temporaries) it waits until the save's
#: temporary state file appears (the engine is writing it), then ``delay_s``, runs the
#: command line's own code (a new store, lock and all, each time), and writes one
#: ``RESULT`` line: when the temporary was seen, and when the command began and ended.
RM_PROCESS = r"""
import json, os, sys, time
from strata_serve.cli import cli

directory = sys.argv[1]

def run(*args):
    try:
        cli.main(["sessions", "--slot-dir", directory, *args], prog_name="strata-serve", standalone_mode=False)
        return 0
    except SystemExit as exc:
        return exc.code
    except Exception as exc:
        print(f"{type(exc).__name__}: {exc}", flush=True)
        return getattr(exc, "exit_code", 1)

run("ls", "--json")  # the plugins' commands are found once, before any timing matters
print("READY", flush=True)
for line in sys.stdin:
    command = json.loads(line)
    seen, deadline = None, time.monotonic() + 30
    while seen is None and time.monotonic() < deadline:
        if any(name.startswith(command["watch"]) and name.endswith(".bin") for name in os.listdir(directory)):
            seen = time.monotonic()
        time.sleep(0.0002)
    time.sleep(command["delay_s"])
    began = time.monotonic()
    code = run("rm", command["key"])
    print("RESULT " + json.dumps({"seen": seen, "began": began, "ended": time.monotonic(), "code": code}),
          flush=True)
"""


def rm_result(process: subprocess.Popen, marker: str = "RESULT ") -> tuple[dict, str]:
    """The next ``RESULT`` of :data:`RM_PROCESS` (or ``READY``), and what the command printed before it."""
    printed = []
    for line in process.stdout:
        if line.startswith(marker):
            return json.loads(line[len(marker):].strip() or "{}"), "".join(printed)
        printed.append(line)
    raise AssertionError(f"the rm process ended: {''.join(printed)}")


#: Rounds of the race; in most of them the removal runs while the switch's save is under way.
RACES = 8


def short_conversation(name: str) -> list[dict]:
    """A conversation of about 250 tokens: worth a file, quick to read."""
    return [{"role": "user", "content": f"Race {name}: " + " ".join(f"{name}{n} sea" for n in range(30))}]


async def test_rm_racing_the_running_servers_saves_never_brings_a_conversation_back(auto_client):
    """``strata-serve sessions rm`` of a conversation the slot holds, in its own process,
    at the moment the running server saves that conversation for a switch (its temporary
    written, its commit under way), over and over at shifting offsets: whichever ends
    first, the conversation's file is gone afterwards and it is never restored again."""
    client = await auto_client(idle_save_s=0)
    directory = slot_dir(client)
    other = short_conversation("other")
    await ask(client, other)
    process = subprocess.Popen([sys.executable, "-c", RM_PROCESS, str(directory)], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    rng = random.Random(7)
    removed, during = [], 0
    try:
        await asyncio.wait_for(asyncio.to_thread(rm_result, process, "READY"), 60)
        for n in range(RACES):
            a = short_conversation(f"r{n}")
            await ask(client, a)
            await ask(client, more(other, f"between {n}"))  # A is parked: it has a file
            a = more(a, "on")
            await ask(client, a)  # A restored and continued: its newest turn is in the slot only
            key = key_of(client, a)
            assert is_parked(directory, key)
            # The switch saves A; rm starts as the engine writes it, and its work (tens of
            # milliseconds) falls across the commit's.
            process.stdin.write(json.dumps({"key": key, "delay_s": rng.uniform(0, 0.01),
                                            "watch": f"tmp-auto-{file_key(key)}-"}) + "\n")
            process.stdin.flush()
            await ask(client, more(other, f"after {n}"))
            answered = time.monotonic()
            result, printed = await asyncio.wait_for(asyncio.to_thread(rm_result, process), 60)
            assert result["code"] == 0 and f"removed {key}" in printed, (result, printed)
            await settle(client)
            # rm began once the save's temporary was there, before the switch was answered.
            during += result["seen"] is not None and result["began"] < answered
            assert not is_parked(directory, key), f"round {n}: the removed {key} came back"
            assert not (directory / f"auto-{key}.json").exists(), f"round {n}: {key}'s sidecar came back"
            assert key not in listed(directory)
            removed.append(a)
    finally:
        process.stdin.close()
        process.wait(10)
        process.stdout.close()
    assert during >= RACES // 3, f"rm ran during the save in {during} of {RACES} rounds only"
    for a in removed:  # never restored: each is read anew
        again = await ask(client, more(a, "back"))
        assert again["timings"]["cache_n"] < 30, "a removed conversation was restored"
    assert not list(directory.glob("tmp-*")), "no temporary left behind"
