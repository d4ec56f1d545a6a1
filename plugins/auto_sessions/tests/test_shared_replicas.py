"""Several replicas behind HAProxy, sharing one tier: real strata-serve processes, each
with its own llama-server and slot directory, on loopback (tests/replicas.py), and a
shared directory or S3 (moto's server, its address reaching the replicas through the
usual AWS variables). Without a shared tier, the same steps are the control: a failover
re-reads the conversation in full, and a replica that comes back restores its own stale
copy."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from strata_auto_sessions.naming import session_name
from strata_auto_sessions.shared import DirectoryTier, Head, S3Tier, SharedTier
from strata_auto_sessions.sidecar import Sidecar
from strata_serve.testing import conversation
from tests.replicas import Answer, Replicas, after_a_failover, reread_in_full, restored_from

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


@pytest.fixture(params=["none", "directory", "s3"])
async def tier(request, tmp_path, s3_env) -> AsyncIterator[Tier]:
    if request.param == "none":
        yield Tier("none", None, None)
        return
    if request.param == "directory":
        root = tmp_path / "shared"
        root.mkdir()
        handle: SharedTier = DirectoryTier(root)
        url = f"file://{root}"
    else:
        bucket = await new_bucket(s3_env)
        handle, url = S3Tier(bucket, "strata", endpoint_url=s3_env), f"s3://{bucket}/strata"
    try:
        yield Tier(request.param, url, handle)
    finally:
        await handle.close()


def config_for(url: str | None) -> dict:
    parking: dict = {"idle_save_s": IDLE_SAVE_S}
    if url is not None:
        parking["shared"] = {"url": url, "retry_s": 0.5}
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
