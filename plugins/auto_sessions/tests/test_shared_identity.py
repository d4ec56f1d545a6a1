"""Replicas never take each other's state: a conversation's shared state is its own, its
newest wins wherever it was made, what a replica could not share before a restart is
shared after it, and the bookkeeping beside the files holds what exists.

Two replicas (real strata-serve processes, each with its own llama-server and slot
directory, tests/replicas.py) share a directory or S3 (moto's server). Each test says what
a client sees (``X-Strata-State``, what the next turn reused: ``cache_n``), never how the
tier names what it keeps.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import pytest

from strata_auto_sessions.shared.ledger import LEDGER_NAME
from strata_serve.testing import ask, conversation
from tests.replicas import RESTORE_SLACK, Answer, Replicas, Reuse

from strata_auto_sessions.testing import all_parked_names
from .shared_fixtures import S3_ENV, new_bucket
from .test_auto_sessions import parking
from .test_shared_parking import settled
from .test_shared_replicas import HEADER, Tier, config_for, opened, parking_stats, then, total, until
from .test_shared_store_down import Store, free_port, new_bucket_named
from .test_siblings import shared_opening

@pytest.fixture(params=["directory", "s3"])
async def shared(request, tmp_path, s3_env) -> AsyncIterator[Tier]:
    """A shared tier, each kind in turn, and the tests' own handle on it."""
    async with opened(request.param, tmp_path, s3_env) as found:
        yield found


#: One slot per engine (no side slot): another conversation takes the slot's place.
ONE_SLOT = {"engine": {"side_slot_tokens": 0}}


def own_state(reuse: Reuse, before: Answer) -> bool:
    """Whether a turn was restored from its own conversation's state as of the turn
    ``before`` (all of that turn's prompt reused, bar the last few tokens): another
    conversation's state under the same key holds the shared opening alone, an older turn
    of its own holds less."""
    return reuse.state == "disk" and reuse.cached >= total(before) - RESTORE_SLACK


async def turn(replicas: Replicas, via: str, messages: list[dict], headers: dict[str, str] | None = None) -> Answer:
    """One turn straight to replica ``via``, then until its idle save is made and its
    upload ended (shared, or refused): the next step sees what this turn left."""
    before = await parking_stats(replicas, via)
    answer = await replicas.ask(messages, headers or {}, via=via)
    assert answer.status == 200, answer.body

    async def saved_and_sent() -> bool:
        now = await parking_stats(replicas, via)
        return now["saves"] > before["saves"] and now["shared_uploads"] + now["shared_uploads_lost"] >= now["saves"]

    await until(f"{via}'s idle save shared", saved_and_sent)
    return answer


async def test_two_conversations_under_one_key_on_two_replicas_each_keep_their_own_state(
        tmp_path, strata_demo_model, shared):
    """X on one replica and Y on the other, at the same time, open alike: one key, and
    each its replica's first conversation under it. Each one's next turn on its replica
    comes back to its own state, and each moving to the other replica comes with its own
    state. Before, both were the key's first file on their replica, one name in the tier:
    one upload landed, the other was refused, and the refused replica's next switch
    fetched the other conversation's state over its own and restored it (the shared
    opening alone reused)."""
    config = {**config_for(shared.url), **ONE_SLOT}
    async with Replicas(tmp_path, strata_demo_model, count=2, config=config) as replicas:
        one, two = replicas.names
        x1, y1 = shared_opening("xray"), shared_opening("yankee")
        # At once: neither replica finds the other's conversation shared when its own starts.
        x, y = await asyncio.gather(turn(replicas, one, x1), turn(replicas, two, y1))
        assert x.key is not None and x.key == y.key, "one key for both"

        await asyncio.gather(turn(replicas, one, conversation("interlude-one")),
                             turn(replicas, two, conversation("interlude-two")))
        x2, y2 = then(x1, x, "And then?"), then(y1, y, "And then?")
        x_back = await turn(replicas, one, x2)
        y_back = await turn(replicas, two, y2)
        print(f"\n[{shared.kind}] back on their replicas: X {x_back.reuse}, its prompt was {total(x)} tokens; "
              f"Y {y_back.reuse}, its prompt was {total(y)} tokens")
        assert own_state(x_back.reuse, x), x_back.reuse
        assert own_state(y_back.reuse, y), y_back.reuse

        x_moved = await turn(replicas, two, then(x2, x_back, "Go on."))
        y_moved = await turn(replicas, one, then(y2, y_back, "Go on."))
        print(f"[{shared.kind}] each on the other's replica: X {x_moved.reuse}, Y {y_moved.reuse}")
        assert own_state(x_moved.reuse, x_back), x_moved.reuse
        assert own_state(y_moved.reuse, y_back), y_moved.reuse


async def test_the_newest_state_of_a_conversation_wins_wherever_it_was_made(tmp_path, strata_demo_model, shared):
    """X's first two turns on one replica, the third on the other (from the shared
    state), the fourth on the first again, from its slot (turn 2 plus turns 3 and 4): the
    fourth turn's state is the newest, though the tier's last one came from the other
    replica. Back on the first after a switch, X comes back to turn 4, and on the other too.
    Before, the first replica's upload was refused (the other had written since) and at
    its next switch it fetched turn 3 over its own newer file."""
    headers = {HEADER: "relay"}
    config = {**config_for(shared.url), **ONE_SLOT}
    async with Replicas(tmp_path, strata_demo_model, count=2, config=config) as replicas:
        one, two = replicas.names
        turn1 = conversation("relay")
        first = await turn(replicas, one, turn1, headers)
        turn2 = then(turn1, first, "And then?")
        second = await turn(replicas, one, turn2, headers)
        turn3 = then(turn2, second, "And after that?")
        third = await turn(replicas, two, turn3, headers)
        assert own_state(third.reuse, second), third.reuse  # moved with its state
        turn4 = then(turn3, third, "Go on.")
        fourth = await turn(replicas, one, turn4, headers)
        assert fourth.reuse.state == "slot", fourth.reuse  # turn 2 in its slot, continued

        await turn(replicas, one, conversation("interlude-one"))
        turn5 = then(turn4, fourth, "And at last?")
        back = await turn(replicas, one, turn5, headers)
        print(f"\n[{shared.kind}] back on the first replica: {back.reuse}; turn 4's prompt {total(fourth)}, "
              f"turn 3's {total(third)} tokens")
        assert own_state(back.reuse, fourth), back.reuse

        await turn(replicas, two, conversation("interlude-two"))
        turn6 = then(turn5, back, "Once more?")
        elsewhere = await turn(replicas, two, turn6, headers)
        print(f"[{shared.kind}] on the other replica: {elsewhere.reuse}; turn 5's prompt {total(back)} tokens")
        assert own_state(elsewhere.reuse, back), elsewhere.reuse


# -- uploads pending at a restart ------------------------------------------------------------


@dataclass
class Outage:
    """A shared tier that can be taken away and brought back: a directory moved off its
    path (its mount gone), or moto's S3 server stopped and started again on its port."""

    kind: str
    url: str
    down: Callable[[], Awaitable[None]]
    up: Callable[[], Awaitable[None]]


@pytest.fixture(params=["directory", "s3"])
async def outage(request, tmp_path, monkeypatch) -> AsyncIterator[Outage]:
    if request.param == "directory":
        root = tmp_path / "shared"
        root.mkdir()
        away = tmp_path / "shared-away"

        async def gone() -> None:
            root.rename(away)

        async def back() -> None:
            away.rename(root)

        yield Outage("directory", f"file://{root}", gone, back)
        return
    # moto in a process of its own, the replicas pointed at it by the usual AWS variables.
    port = free_port()
    store = Store(f"http://127.0.0.1:{port}", port)
    await asyncio.to_thread(store.start)
    for name, value in {**S3_ENV, "AWS_ENDPOINT_URL": store.endpoint}.items():
        monkeypatch.setenv(name, value)
    bucket = await new_bucket(store.endpoint)

    async def stopped() -> None:
        await asyncio.to_thread(store.stop)

    async def started() -> None:
        # moto keeps its buckets in memory: made again, as empty as it was (nothing landed).
        await asyncio.to_thread(store.start)
        assert await new_bucket_named(store.endpoint, bucket)

    try:
        yield Outage("s3", f"s3://{bucket}/strata", stopped, started)
    finally:
        with contextlib.suppress(Exception):
            await asyncio.to_thread(store.stop)


async def test_uploads_pending_at_a_restart_land_once_the_store_is_back(tmp_path, strata_demo_model, outage):
    """The store away, three conversations parked on one replica (their uploads fail), the
    replica restarted, the store back: the three are shared within a few ``retry_s``, and
    the other replica takes each over with its state. Before, nothing retried them after
    the restart: the other replica read each again in full."""
    config = {**config_for(outage.url, timeout_s=1.0, transfer_timeout_s=3.0), **ONE_SLOT}
    async with Replicas(tmp_path, strata_demo_model, count=2, config=config) as replicas:
        one, two = replicas.names
        await outage.down()
        chats = [conversation(f"pending{n}") for n in range(3)]
        answers = []
        for chat in chats:
            answer = await replicas.ask(chat, via=one)
            assert answer.status == 200, answer.body
            answers.append(answer)

        async def parked_not_shared() -> bool:
            stats = await parking_stats(replicas, one)
            return stats["saves"] >= 3 and stats["shared_upload_failures"] >= 3

        await until("three saves, their uploads failed", parked_not_shared)
        await replicas[one].stop()
        await replicas.restart(one)
        await outage.up()
        began = time.monotonic()

        async def shared_again() -> bool:
            return (await parking_stats(replicas, one))["shared_uploads"] >= 3

        await until("the pending uploads landed after the restart", shared_again)
        print(f"\n[{outage.kind}] pending uploads landed {time.monotonic() - began:.1f} s after the store came back")
        for chat, answer in zip(chats, answers, strict=True):
            moved = await replicas.ask(then(chat, answer, "And then?"), via=two)
            assert moved.status == 200, moved.body
            assert own_state(moved.reuse, answer), moved.reuse


# -- the ledger beside the files ----------------------------------------------------------------


@pytest.mark.parametrize("blocks", [False, True], ids=["whole", "blocks"])
async def test_the_shared_bookkeeping_holds_the_files_kept_and_is_written_only_on_change(
        auto_client, tmp_path, shared, blocks):
    """Ten conversations with ``keep = 2``: what the server keeps beside the files of what
    the shared tier has of them names the two files kept, no more; and a switch that
    changes nothing there (a lookup, a restore) leaves it unwritten. Before, it named every
    conversation ever uploaded (59 for 60) and was written again at every keyed switch."""
    client = await auto_client(idle_save_s=0, keep=2, blocks=blocks, shared={"url": shared.url, "retry_s": 0.5})
    chats = [conversation(f"many{n}") for n in range(10)]
    for chat in chats:
        await ask(client, chat)
    await ask(client, [{"role": "user", "content": "hi"}])  # the last one parked; this one is not worth a file
    await settled(client)
    # An upload whose conversation was pruned meanwhile (its file, or its blocks, gone) is
    # dropped, not failed and tried again.
    assert parking(client).stats.shared_upload_failures == 0
    directory = parking(client).store.directory
    ledger = directory / LEDGER_NAME
    kept = set(all_parked_names(directory))
    recorded = json.loads(ledger.read_text())
    print(f"\n{len(recorded)} entries recorded, {len(kept)} files kept, {ledger.stat().st_size} bytes")
    assert set(recorded) <= kept and len(kept) == 2, (sorted(recorded), sorted(kept))

    before = os.stat(ledger)
    back = await ask(client, chats[-2])  # looked up, restored: nothing new to record
    assert back["timings"]["cache_n"] > 100, back["timings"]
    after = os.stat(ledger)
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns), "written again"
    assert json.loads(ledger.read_text()) == recorded


def test_ledger_writes_finishing_out_of_order_never_bring_back_an_older_one(tmp_path):
    """Writes run in threads and may finish in any order: the file keeps the newest."""
    from strata_auto_sessions.shared.ledger import Ledger, LedgerEntry

    (tmp_path / "auto-a.bin").write_bytes(b"x")
    ledger = Ledger(tmp_path / "auto-.shared.json")
    ledger.entries["auto-a.bin"] = LedgerEntry(1, dirty=True)
    older = ledger.render()
    ledger.entries["auto-a.bin"] = LedgerEntry(2, dirty=False)
    newer = ledger.render()
    ledger.write(*newer)
    ledger.write(*older)  # the older write lands last
    assert json.loads((tmp_path / "auto-.shared.json").read_text())["auto-a.bin"]["generation"] == 2
