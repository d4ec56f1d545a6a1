"""``strata-serve sessions`` with a shared tier (a directory, and S3 on moto's server): what
only the tier holds is listed and removed there, a damaged head is a row, and a tier that
cannot be read never hides the slot directory's rows.

The conversations are parked by a server (the in-memory engine, auto-sessions, the shared
tier) on a slot directory of its own; the command runs on another one, so what it lists
and removes of them the tier alone holds. What a removal did is judged by what ``ls``
prints and by what a later server can fetch back.
"""

from __future__ import annotations

import asyncio
import json
import socket

import pytest
from click.testing import CliRunner

import strata_auto_sessions
from strata_serve.cli import cli
from strata_serve.testing import chat, conversation

from .test_auto_sessions import parking

KEYS = {"api_keys": {"alice": "alice-key", "bob": "bob-key"}}


async def server(factory, settings_factory, tmp_path, url, name):
    """A server on the in-memory engine with slot directory ``tmp_path / name`` and the tier:
    every switch saves, every save is shared, every fetch pays."""
    settings = settings_factory(
        plugins={"auto_sessions": {"min_tokens": 100, "min_prefill_s": 0, "idle_save_s": 0,
                                   "shared": {"url": url, "retry_s": 0.5}}},
        engine={"slot_save_path": str(tmp_path / name)}, server={"port": 0, "shutdown_grace_s": 10, **KEYS})
    return await factory(strata_auto_sessions, settings=settings)


async def turn(client, messages, key) -> tuple[str, str | None]:
    """One turn of ``messages`` as the holder of API key ``key``: (its conversation key, X-Strata-State)."""
    reply = await client.post("/v1/chat/completions", json=chat(messages, max_tokens=3),
                              headers={"Authorization": f"Bearer {key}"})
    assert reply.status == 200, await reply.text()
    return reply.headers["X-Strata-Conversation"], reply.headers.get("X-Strata-State")


@pytest.fixture
async def in_the_tier(strata_memory_client_factory, strata_settings_factory, tmp_path, shared_url):
    """alice's two conversations and bob's two, parked and shared by a server that then
    stopped: {"alice": [key, key], "bob": [key, key]}; the tier holds them, the command's
    slot directory (``tmp_path / "cli"``) nothing."""
    one = await server(strata_memory_client_factory, strata_settings_factory, tmp_path, shared_url, "one")
    keys: dict[str, list[str]] = {"alice": [], "bob": []}
    for name, tenant in (("one", "alice"), ("two", "alice"), ("three", "bob"), ("four", "bob")):
        keys[tenant].append((await turn(one, conversation(name), f"{tenant}-key"))[0])
    # Too short to park: "four" leaves the slot (saved), and nothing is left to save at the stop.
    await turn(one, [{"role": "user", "content": "hi"}], "bob-key")
    assert await parking(one).shared.settled(30), "uploads ended"
    assert parking(one).stats.shared_uploads == 4, parking(one).stats
    await one.close()
    (tmp_path / "cli").mkdir()
    return keys


async def command(tmp_path, url, *args) -> tuple[int, str, object]:
    """``strata-serve sessions --config ... ARGS`` on the slot directory ``tmp_path / "cli"``
    (in a thread: the command runs an event loop of its own): exit code, output (stdout and
    stderr), and the exception that ended it (None when it exited with 0, SystemExit when it
    exited with another code; anything else is a traceback)."""
    config = tmp_path / "strata.toml"
    config.write_text(f'[engine]\nslot_save_path = "{tmp_path / "cli"}"\n'
                      f'[plugins.auto_sessions.shared]\nurl = "{url}"\ntimeout_s = 15\n')
    result = await asyncio.to_thread(CliRunner().invoke, cli, ["sessions", "--config", str(config), *args])
    return result.exit_code, result.output, result.exception


async def shared_rows(tmp_path, url) -> dict[str, list[dict]]:
    """``ls --json``'s rows of the shared tier, by key."""
    code, output, _ = await command(tmp_path, url, "ls", "--json")
    assert code == 0, output
    rows: dict[str, list[dict]] = {}
    for row in map(json.loads, output.splitlines()):
        if row.get("shared"):
            rows.setdefault(row["key"], []).append(row)
    return rows


def held_there(rows: list[dict]) -> bool:
    return any(row["tokens"] is not None and row["removed_s"] is None for row in rows)


async def fetched_back(factory, settings_factory, tmp_path, url, messages, tenant) -> bool:
    """Whether a new server (a slot directory of its own) gets the conversation's state from the tier."""
    name = f"later-{len(list(tmp_path.glob('later-*')))}"
    later = await server(factory, settings_factory, tmp_path, url, name)
    try:
        _, state = await turn(later, messages, f"{tenant}-key")
        fetches = parking(later).stats.shared_fetches
        assert (state == "disk") == (fetches == 1), (state, fetches)
        return state == "disk"
    finally:
        await later.close()


async def test_rm_of_a_tenant_or_all_removes_what_only_the_shared_tier_holds(
        in_the_tier, tmp_path, shared_url, strata_memory_client_factory, strata_settings_factory):
    rows = await shared_rows(tmp_path, shared_url)
    assert sorted(rows) == sorted(in_the_tier["alice"] + in_the_tier["bob"])
    assert all(held_there(rows[key]) for key in rows)

    code, output, _ = await command(tmp_path, shared_url, "rm", "--tenant", "alice")
    assert code == 0, output
    assert "2 session(s) removed" in output and "held by the running server" not in output, output
    rows = await shared_rows(tmp_path, shared_url)
    assert sorted(key for key in rows if held_there(rows[key])) == sorted(in_the_tier["bob"])
    assert all(row["removed_s"] is not None for key in in_the_tier["alice"] for row in rows[key])
    # A later server gets nothing of alice's back, and bob's as ever.
    for name, tenant, back in (("one", "alice", False), ("three", "bob", True)):
        assert await fetched_back(strata_memory_client_factory, strata_settings_factory, tmp_path, shared_url,
                                  conversation(name), tenant) is back, name

    # Each later server saved what it held when it stopped (alice's "one" begun anew, after
    # the removal, is shared again): --all takes whatever the tier holds now.
    rows = await shared_rows(tmp_path, shared_url)
    live = [key for key in rows if held_there(rows[key])]
    assert set(in_the_tier["bob"]) <= set(live), live
    code, output, _ = await command(tmp_path, shared_url, "rm", "--all")
    assert code == 0 and f"{len(live)} session(s) removed" in output, output
    assert not any(held_there(found) for found in (await shared_rows(tmp_path, shared_url)).values())
    code, output, _ = await command(tmp_path, shared_url, "rm", "--all")  # what was removed is not again
    assert code == 0 and "0 session(s) removed" in output, output
    assert not await fetched_back(strata_memory_client_factory, strata_settings_factory, tmp_path, shared_url,
                                  conversation("three"), "bob")


async def test_rm_of_a_key_only_the_shared_tier_holds_removes_it_there(
        in_the_tier, tmp_path, shared_url, strata_memory_client_factory, strata_settings_factory):
    key = in_the_tier["alice"][0]
    code, output, _ = await command(tmp_path, shared_url, "rm", key)
    assert code == 0, output
    assert "held by the running server" not in output and "1 session(s) removed" in output, output
    rows = await shared_rows(tmp_path, shared_url)
    assert not held_there(rows[key]) and held_there(rows[in_the_tier["alice"][1]])
    # Removed already: there is no such session any more.
    code, output, _ = await command(tmp_path, shared_url, "rm", key)
    assert code == 1 and f"no session {key!r}" in output and "nothing removed" in output, output
    assert not await fetched_back(strata_memory_client_factory, strata_settings_factory, tmp_path, shared_url,
                                  conversation("one"), "alice")


async def test_rm_of_a_key_strata_never_makes_is_a_clear_error(in_the_tier, tmp_path, shared_url):
    for odd in ("no/such key", "../../etc/passwd", "a.b", "", "auto-x.1", "é", "x" * 5000):
        code, output, ended = await command(tmp_path, shared_url, "rm", in_the_tier["bob"][0], odd)
        assert isinstance(ended, SystemExit), (odd, ended, output)  # an error said, not a traceback
        # A key of 5,000 characters could be one: there is no such session.
        why = "no such" if len(odd) > 100 else "not a conversation key"
        assert code == 1 and f"no session {odd!r}" in output and "nothing removed" in output, (odd, output)
        assert why == "no such" or why in output, (odd, output)
    rows = await shared_rows(tmp_path, shared_url)
    assert sorted(rows) == sorted(in_the_tier["alice"] + in_the_tier["bob"])
    assert all(held_there(rows[key]) for key in rows)


async def test_ls_shows_a_damaged_shared_head_as_a_row_and_every_other(
        in_the_tier, tmp_path, shared_url, strata_memory_client_factory, strata_settings_factory):
    later = await server(strata_memory_client_factory, strata_settings_factory, tmp_path, shared_url, "writer")
    tier = parking(later).shared.tier
    try:
        names = sorted(await tier.heads("auto-"))
        damaged = {}
        for name, field, value in ((names[0], "written", "yesterday"), (names[1], "tokens", "many")):
            head, version = await tier.head(name)
            setattr(head, field, value)
            await tier.put_head(name, head, version)
            damaged[name] = field
    finally:
        await later.close()

    code, output, ended = await command(tmp_path, shared_url, "ls")
    assert code == 0 and ended is None, (ended, output)  # None: no exception, not even an exit
    assert "2 conversation file(s)" in output and "2 damaged" in output, output
    rows = [row for found in (await shared_rows(tmp_path, shared_url)).values() for row in found]
    assert sorted(row["name"] for row in rows if row.get("damaged")) == sorted(damaged)
    assert sum(held_there([row]) for row in rows) == 2
    lines = output.splitlines()
    for row in rows:
        (line,) = [line for line in lines if line.startswith(row["key"] + " ")]
        if row["name"] in damaged:
            assert "damaged" in line and damaged[row["name"]] in line, line
        else:
            assert "damaged" not in line and f"{row['tokens']:,}" in line, line
    # rm removes the others, and says which it could not (no tombstone is written over a
    # head that cannot be read).
    code, output, ended = await command(tmp_path, shared_url, "rm", "--all")
    assert code == 1 and isinstance(ended, SystemExit) and "2 session(s) removed" in output, output
    assert all(f"{row['key']} ({row['damaged']})" in output for row in rows if row.get("damaged")), output
    rows = [row for found in (await shared_rows(tmp_path, shared_url)).values() for row in found]
    assert not any(held_there([row]) for row in rows) and sum(bool(row.get("damaged")) for row in rows) == 2


def a_port_nothing_listens_on() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


async def test_ls_with_the_shared_tier_unreachable_lists_the_slot_directory_and_says_so(
        in_the_tier, tmp_path, monkeypatch, shared_url):
    # The command's slot directory is the one the server parked in: local rows to list.
    (tmp_path / "cli").rmdir()
    (tmp_path / "cli").symlink_to(tmp_path / "one")
    if shared_url.startswith("file://"):  # a directory tier not mounted; an S3 endpoint nothing answers on
        url = f"file://{tmp_path / 'not-mounted'}"
    else:
        monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{a_port_nothing_listens_on()}")
        monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
        url = "s3://gone/strata"
    code, output, ended = await command(tmp_path, url, "ls")
    assert isinstance(ended, SystemExit) and code == 1, (ended, output)
    assert "4 session(s)" in output, output  # the four conversations parked there
    assert f"the shared tier {url} could not be read" in output, output
    code, output, ended = await command(tmp_path, url, "ls", "--json")
    assert isinstance(ended, SystemExit) and code == 1, (ended, output)
    rows = [json.loads(line) for line in output.splitlines() if line.startswith("{")]
    assert len(rows) == 4 and not any(row.get("shared") for row in rows)
    # rm reads the tier first: nothing is removed while it cannot be read.
    code, output, ended = await command(tmp_path, url, "rm", "--all")
    assert isinstance(ended, SystemExit) and code == 1 and "nothing removed" in output, output
    code, output, _ = await command(tmp_path, url, "ls", "--json")
    assert len([line for line in output.splitlines() if line.startswith("{")]) == 4
