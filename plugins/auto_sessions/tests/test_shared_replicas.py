"""Several replicas behind HAProxy, sharing one tier: real strata-serve processes, each
with its own llama-server and slot directory, on loopback (tests/replicas.py), and a
shared directory or S3 (moto's server, its address reaching the replicas through the
usual AWS variables). Without a shared tier, the same steps are the control: a failover
re-reads the conversation in full, and a replica that comes back restores its own stale
copy."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from strata_auto_sessions.digests import digest_matches
from strata_auto_sessions.naming import PREFIX, SESSION_NAME, key_of_file, session_name, sibling_of
from strata_auto_sessions.shared import DirectoryTier, Head, S3Tier, SharedTier
from strata_auto_sessions.sidecar import Sidecar
from strata_serve.testing import conversation
from tests.replicas import Answer, Replica, Replicas, after_a_failover, reread_in_full, restored_from

from . import head_gate as head_gate_plugin
from .shared_fixtures import new_bucket

#: How long a save and its upload may take before a test gives up on it.
UPLOAD_TIMEOUT_S = 30
#: Saves soon after a turn, so the state a test kills a replica on is saved (and uploaded).
IDLE_SAVE_S = 0.5
HEADER = "X-Claude-Code-Session-Id"


@dataclass
class Tier:
    """The shared tier the replicas are given (None: none, the control) and the test's own
    handle on it, to see what landed there."""

    kind: str
    url: str | None
    handle: SharedTier | None


async def open_tier(kind: str, tmp_path: Path, s3_endpoint: str) -> Tier:
    """A shared tier of ``kind`` (``directory``, ``s3``) for replicas to be given."""
    if kind == "directory":
        root = tmp_path / "shared"
        root.mkdir()
        return Tier(kind, f"file://{root}", DirectoryTier(root))
    bucket = await new_bucket(s3_endpoint)
    return Tier(kind, f"s3://{bucket}/strata", S3Tier(bucket, "strata", endpoint_url=s3_endpoint))


@contextlib.asynccontextmanager
async def opened(kind: str, tmp_path, s3_env) -> AsyncIterator[Tier]:
    """A shared tier of ``kind``, closed after use."""
    found = await open_tier(kind, tmp_path, s3_env)
    assert found.handle is not None
    try:
        yield found
    finally:
        await found.handle.close()


@pytest.fixture(params=["none", "directory", "s3"])
async def tier(request, tmp_path, s3_env) -> AsyncIterator[Tier]:
    if request.param == "none":
        yield Tier("none", None, None)
        return
    async with opened(request.param, tmp_path, s3_env) as found:
        yield found


@pytest.fixture(params=["directory", "s3"])
async def shared(request, tmp_path, s3_env) -> AsyncIterator[Tier]:
    """A shared tier, each kind in turn (no control)."""
    async with opened(request.param, tmp_path, s3_env) as found:
        yield found


def config_for(url: str | None, idle_save_s: float = IDLE_SAVE_S, **shared: Any) -> dict:
    parking: dict = {"idle_save_s": idle_save_s}
    if url is not None:
        parking["shared"] = {"url": url, "retry_s": 0.5, **shared}
    return {"plugins": {"auto_sessions": parking}}


async def served(replicas: Replicas, messages: list[dict], headers: dict[str, str]) -> Answer:
    answer = await replicas.ask(messages, headers)
    assert answer.status == 200, answer.body
    return answer


async def parking_stats(replicas: Replicas, name: str) -> dict:
    """auto-sessions' counters on replica ``name`` (its ``/stats``)."""
    return (await replicas.stats(name))["plugins"]["auto_sessions"]


def then(messages: list[dict], answer: Answer, text: str) -> list[dict]:
    """The next turn: ``messages``, the answer given to them, and ``text``."""
    return messages + [{"role": "assistant", "content": answer.body["choices"][0]["message"]["content"]},
                       {"role": "user", "content": text}]


def total(answer: Answer) -> int:
    """The tokens of the turn's prompt: what its saved state holds at least."""
    return answer.reuse.cached + answer.reuse.prompt


async def saved_locally(slot_dir: Path, key: str, tokens: int) -> Sidecar:
    """Until the replica's slot directory holds the conversation ``key`` at ``tokens`` or
    more (its idle save)."""
    deadline = time.monotonic() + UPLOAD_TIMEOUT_S
    while True:
        sidecar = await asyncio.to_thread(Sidecar.read, slot_dir / session_name(key, "json"))
        if sidecar is not None and sidecar.tokens >= tokens:
            return sidecar
        assert time.monotonic() < deadline, f"{key} of {tokens} tokens not saved in {slot_dir}: {sidecar}"
        await asyncio.sleep(0.1)


async def uploaded(tier: SharedTier, name: str, tokens: int) -> Head:
    """Until the shared tier's head of ``name`` names a state of at least ``tokens``."""
    deadline = time.monotonic() + UPLOAD_TIMEOUT_S
    while True:
        current = await tier.head(name)
        if current is not None and current[0].tokens >= tokens:
            return current[0]
        assert time.monotonic() < deadline, f"{name} of {tokens} tokens not uploaded: {current}"
        await asyncio.sleep(0.1)


async def test_kill_9_of_a_replica_then_its_return_with_a_shared_tier(tmp_path, strata_demo_model, tier):
    """A conversation's replica is killed: the other takes it over from the shared tier's
    state; it moves on there; the killed replica back, the conversation returns to it,
    which fetches the newer state rather than restoring its own stale copy."""
    headers = {HEADER: "voyage"}
    async with Replicas(tmp_path, strata_demo_model, count=2, config=config_for(tier.url)) as replicas:
        turn1 = conversation("voyage")
        first = await served(replicas, turn1, headers)
        holder = first.replica
        assert holder is not None
        other = next(name for name in replicas.names if name != holder)
        turn2 = then(turn1, first, "And then?")
        second = await served(replicas, turn2, headers)
        assert second.replica == holder and second.reuse.state == "slot", second.reuse
        assert second.key is not None
        name = session_name(second.key, "bin")
        stale = await saved_locally(replicas[holder].slot_dir, second.key, total(second))
        if tier.handle is not None:
            # The state killed on is the one shared: saved and uploaded first.
            head = await uploaded(tier.handle, name, total(second))
            assert head.tokens == stale.tokens

        await replicas.kill(holder)
        await replicas.wait_for_state(holder, "DOWN")
        turn3 = then(turn2, second, "And after that?")
        began = time.monotonic()
        third, reuse = await after_a_failover(replicas, turn3, headers)
        took = time.monotonic() - began
        assert third.replica == other
        print(f"\n[{tier.kind}] failover turn: {reuse}, {took:.2f} s; saved {stale.tokens} tokens")
        if tier.handle is None:
            assert reread_in_full(reuse), reuse
        else:
            assert restored_from(reuse, head.tokens), (reuse, head)
            assert (await parking_stats(replicas, other))["shared_fetches"] == 1

        turn4 = then(turn3, third, "Go on.")
        fourth = await served(replicas, turn4, headers)
        assert fourth.replica == other and fourth.reuse.state == "slot", fourth.reuse
        newer = await saved_locally(replicas[other].slot_dir, second.key, total(fourth))
        assert newer.tokens > stale.tokens
        if tier.handle is not None:
            shared = await uploaded(tier.handle, name, total(fourth))
            assert shared.tokens == newer.tokens and shared.generation > head.generation

        await replicas.restart(holder)
        await replicas.wait_for_state(holder, "UP")
        fifth = await served(replicas, then(turn4, fourth, "And at last?"), headers)
        assert fifth.replica == holder  # consistent hashing: back where it was
        print(f"[{tier.kind}] back on its replica: {fifth.reuse}; its stale copy {stale.tokens}, "
              f"the newer state {newer.tokens} tokens")
        log = replicas[holder].log_file.read_text().split("--- start 2")[1]
        if tier.handle is None:
            # The control: its own stale copy is all it has.
            assert restored_from(fifth.reuse, stale.tokens) and fifth.reuse.cached < newer.tokens - 3, fifth.reuse
        else:
            assert restored_from(fifth.reuse, newer.tokens), (fifth.reuse, newer)
            assert (await parking_stats(replicas, holder))["shared_fetches"] == 1
            assert re.search(rf"shared tier: fetched {re.escape(name)} .*generation {shared.generation}\b", log), log


# -- the same turn on both replicas at once ----------------------------------------------


@pytest.fixture
def head_gate(tmp_path, monkeypatch) -> Path:
    """The head gate (head_gate.py) in the replicas started after this: a directory that,
    armed, holds each replica's upload at its head write until both reached it."""
    site = head_gate_plugin.install(tmp_path / "gate-site")
    gate = tmp_path / "gate"
    gate.mkdir()
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")])))
    monkeypatch.setenv(head_gate_plugin.GATE_VARIABLE, str(gate))
    return gate


async def until(what: str, check: Any, timeout: float = UPLOAD_TIMEOUT_S) -> Any:
    """Until the coroutine function ``check`` answers something true; that answer."""
    deadline = time.monotonic() + timeout
    while True:
        found = await check()
        if found:
            return found
        assert time.monotonic() < deadline, f"{what}: not within {timeout:g} s"
        await asyncio.sleep(0.1)


async def no_state_under_another_name(slot_dirs: list[Path], tier: SharedTier, scratch: Path) -> int:
    """Every conversation file, in each slot directory and in the shared tier, is the one its
    name says: its sidecar names the key the file's name does, and the file is the size
    and sampled digest its sidecar (in the tier: its head) records. Returns the files seen."""
    seen = 0
    for directory in slot_dirs:
        for side in directory.glob(f"{PREFIX}*.json"):
            match = SESSION_NAME.fullmatch(side.name)
            if match is None:
                continue  # the store's own files (auto-.engine.json, ...)
            sidecar = Sidecar.load(side)
            state = side.with_suffix(".bin")
            assert sidecar.key == key_of_file(match["key"]) and sidecar.sibling == sibling_of(match), (side, sidecar)
            assert state.stat().st_size == sidecar.bytes and digest_matches(state, sidecar.digest), state
            seen += 1
    for name in await tier.heads(PREFIX):
        match = SESSION_NAME.fullmatch(name)
        if match is None or match["ext"] != "bin":
            continue
        current = await tier.head(name)
        assert current is not None
        head = current[0]
        objects = head.objects(name, name[: -len(".bin")] + ".json")
        if objects is None:
            continue  # a tombstone
        state, side = scratch / f"{name}.{head.upload}", scratch / f"{name}.{head.upload}.json"
        assert await tier.fetch(objects[0], state) == head.bytes
        await tier.fetch(objects[1], side)
        sidecar = Sidecar.load(side)
        assert sidecar.key == key_of_file(match["key"]) and sidecar.tokens == head.tokens, (name, sidecar, head)
        assert digest_matches(state, head.digest), name
        seen += 1
    return seen


async def test_the_same_turn_on_both_replicas_at_once_one_save_wins(tmp_path, strata_demo_model, shared,
                                                                    head_gate):
    """A conversation's same next turn reaches both replicas at once (a client retrying on
    the other, a balancer's redispatch): both answer it and save it, both uploads read the
    same head, and the compare-and-swap lets one land. The other is refused, logged and
    counted; its objects are deleted; the next turn on the losing replica fetches and
    restores the winner's state, not its own (its own copy when that is the same bytes); and no file anywhere holds one
    conversation's state under another's name."""
    assert shared.handle is not None
    headers = {HEADER: "duel"}
    # One slot per engine (no side slot): another conversation takes the slot's place.
    # Whole files (their uploads' objects are read here); in blocks: test_shared_blocks_replicas.py.
    config = {**config_for(shared.url, timeout_s=head_gate_plugin.WAIT_S + 10), "engine": {"side_slot_tokens": 0}}
    config["plugins"]["auto_sessions"]["blocks"] = False
    async with Replicas(tmp_path, strata_demo_model, count=2, config=config) as replicas:
        turn1 = conversation("duel")
        first = await served(replicas, turn1, headers)
        holder = first.replica
        assert holder is not None and first.key is not None
        other = next(name for name in replicas.names if name != holder)
        name = session_name(first.key, "bin")
        before = await uploaded(shared.handle, name, total(first))
        assert before.generation == 1

        (head_gate / "armed").write_text("2")
        turn2 = then(turn1, first, "And then?")
        answers = await asyncio.gather(*(replicas.ask(turn2, headers, via=via) for via in (holder, other)))
        assert [answer.status for answer in answers] == [200, 200], [answer.body for answer in answers]
        # The holder went on from its slot; the other fetched the shared state and restored it.
        assert answers[0].reuse.state == "slot" and restored_from(answers[1].reuse, before.tokens), answers
        tokens = total(answers[0])
        assert total(answers[1]) == tokens

        async def both_settled() -> dict[str, dict] | None:
            counts = {name: await parking_stats(replicas, name) for name in replicas.names}
            done = sum(c["shared_uploads"] + c["shared_uploads_lost"] for c in counts.values())
            return counts if done >= 3 else None  # the first turn's upload, and one each since

        counts = await until("both saves of the second turn shared or refused", both_settled)
        (head_gate / "armed").unlink()
        arrivals = sorted(path.name for path in head_gate.glob(f"{name}.*"))
        assert len(arrivals) == 2, f"both uploads met at the head: {arrivals}"
        lost = {name: c["shared_uploads_lost"] for name, c in counts.items()}
        assert sorted(lost.values()) == [0, 1], counts
        winner = next(name for name, n in lost.items() if n == 0)
        loser = next(name for name, n in lost.items() if n == 1)
        assert sum(c["shared_uploads"] for c in counts.values()) == 2, counts
        loser_log = replicas[loser].log_file.read_text()
        assert f"shared tier: {name}: another server saved it at the same time and won" in loser_log, loser_log
        after = (await shared.handle.head(name))
        assert after is not None
        head = after[0]
        assert head.generation == 2 and head.tokens >= tokens, head  # the prompt, and what was answered
        winner_pid = replicas[winner].proc.pid  # type: ignore[union-attr]
        assert head.writer.endswith(f":{winner_pid}"), (head.writer, winner_pid)
        # Objects: the first turn's, and the winner's; the loser's are deleted.
        handle = shared.handle

        async def the_losers_deleted() -> bool:
            uploads = {item.name.rsplit(".", 1)[1] for item in await handle.list(name[: -len(".bin")])}
            return uploads == {before.upload, head.upload}

        await until("the losing upload's objects deleted", the_losers_deleted)

        # The loser's next turn of the conversation: the slot taken by another first (its own
        # copy of the second turn stays on its disk), then the winner's state is fetched.
        interlude = await replicas.ask(conversation("interlude"), via=loser)
        assert interlude.status == 200, interlude.body
        # Both engines may have saved the very same bytes: the loser's copy is then the winner's.
        own = await asyncio.to_thread(Sidecar.read, replicas[loser].slot_dir / session_name(first.key, "json"))
        identical = own is not None and own.digest == head.digest
        turn3 = then(turn2, answers[0], "And after that?")
        third = await replicas.ask(turn3, headers, via=loser)
        assert third.status == 200, third.body
        assert restored_from(third.reuse, head.tokens), (third.reuse, head)
        # The other fetched once already, for the second turn; a copy identical to the winner's is not fetched.
        assert (await parking_stats(replicas, loser))["shared_fetches"] == (
            (1 if loser == other else 0) + (0 if identical else 1))
        fetched = rf"shared tier: fetched {re.escape(name)} .*generation 2, saved by {re.escape(head.writer)}\)"
        assert identical or re.search(fetched, replicas[loser].log_file.read_text()), \
            replicas[loser].log_file.read_text()

        scratch = tmp_path / "scratch"
        scratch.mkdir()
        seen = await no_state_under_another_name([replicas[n].slot_dir for n in replicas.names], shared.handle,
                                                 scratch)
        assert seen >= 3, seen  # the conversation on both disks and in the tier, at least


# -- sessions ls and rm beside the replicas -------------------------------------------------


async def sessions_command(replica: Replica, *args: str) -> str:
    """``strata-serve sessions ARGS`` in a process of its own, with the replica's config
    (its shared tier) and slot directory, as an operator runs it on that machine."""
    done = await asyncio.to_thread(
        subprocess.run, [sys.executable, "-m", "strata_serve.cli", "sessions", "--config", str(replica.config_file),
                         "--slot-dir", str(replica.slot_dir), *args],
        capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


async def listed(replica: Replica) -> list[dict]:
    """``sessions ls --json``: the slot directory's rows, then the shared tier's."""
    return [json.loads(line) for line in (await sessions_command(replica, "ls", "--json")).splitlines()]


async def test_sessions_ls_and_rm_through_the_shared_tier_beside_two_replicas(tmp_path, strata_demo_model, shared):
    """With both replicas running, ``strata-serve sessions ls`` (a process of its own, the
    shared tier in its config) lists what the shared tier holds, and ``rm`` removes a
    conversation from it: the replica still holding it in its slot does not upload it
    back when it saves it, and neither replica restores it afterwards."""
    assert shared.handle is not None
    headers = {HEADER: "erase"}
    # Saves at switches only, and one slot per engine: what each replica saves, and when, is
    # the test's doing.
    config = {**config_for(shared.url, idle_save_s=0), "engine": {"side_slot_tokens": 0}}
    async with Replicas(tmp_path, strata_demo_model, count=2, config=config) as replicas:
        turn1 = conversation("erase")
        first = await served(replicas, turn1, headers)
        holder = first.replica
        assert holder is not None and first.key is not None
        other = next(name for name in replicas.names if name != holder)
        key, name = first.key, session_name(first.key, "bin")
        await replicas.ask(conversation("keep-one"), via=holder)  # a switch: the conversation saved, uploaded
        head = await uploaded(shared.handle, name, total(first))
        second = await replicas.ask(then(turn1, first, "And then?"), headers, via=other)
        assert restored_from(second.reuse, head.tokens), second.reuse  # the other holds it now, not saved there

        rows = await listed(replicas[holder])
        shared_rows = {row["key"]: row for row in rows if row.get("shared")}
        assert set(shared_rows) == {key}, rows  # keep-one is in the holder's slot, not saved yet
        row = shared_rows[key]
        assert (row["generation"], row["tokens"], row["bytes"], row["removed_s"]) == (
            head.generation, head.tokens, head.bytes, None), row
        assert row["writer"] == head.writer and row["writer"].endswith(f":{replicas[holder].proc.pid}")  # type: ignore[union-attr]
        assert [r["key"] for r in rows if not r.get("shared")] == [key]  # the holder's own copy
        table = await sessions_command(replicas[holder], "ls")
        assert re.search(rf"^{re.escape(key)}\s+0\s+-\s+{head.tokens:,}\s.*\s{head.generation}\s", table, re.M), table
        assert f"1 conversation file(s), {head.bytes / 1024**2:.2f} MB in the shared tier {shared.url}" in table

        removed = await sessions_command(replicas[holder], "rm", key)
        assert f"removed {name} from the shared tier" in removed, removed
        assert not (replicas[holder].slot_dir / name).exists()
        rows = await listed(replicas[holder])
        row = next(r for r in rows if r.get("shared") and r["key"] == key)
        assert row["removed_s"] is not None and row["tokens"] is None and row["generation"] == head.generation + 1
        assert not [r for r in rows if not r.get("shared")]
        assert "removed " in (await sessions_command(replicas[holder], "ls"))

        # The other saves the state it held from before the removal: not uploaded, its copy removed.
        await replicas.ask(conversation("keep-two"), via=other)
        stats = await until("the other's save refused", lambda: _refused(replicas, other))
        assert stats["shared_uploads"] == 0 and stats["shared_fetches"] == 1, stats
        assert not (replicas[other].slot_dir / name).exists()
        current = await shared.handle.head(name)
        assert current is not None and current[0].tombstone, current

        # Its next turn, on either replica: read again, never restored, never fetched.
        turn3 = then(then(turn1, first, "And then?"), second, "Still there?")
        for via in (other, holder):
            restores = (await parking_stats(replicas, via))["restores"]
            again = await replicas.ask(turn3, headers, via=via)
            assert again.status == 200 and reread_in_full(again.reuse), (via, again.reuse)
            after = await parking_stats(replicas, via)
            assert after["restores"] == restores and after["shared_fetches"] == (1 if via == other else 0), after
        current = await shared.handle.head(name)
        assert current is not None and current[0].tombstone, current


async def _refused(replicas: Replicas, name: str) -> dict | None:
    stats = await parking_stats(replicas, name)
    return stats if stats["shared_uploads_removed"] == 1 else None
