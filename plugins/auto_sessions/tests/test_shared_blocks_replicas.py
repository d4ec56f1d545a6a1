"""The same turn on two replica processes at once, conversations parked and shared in
blocks (#41): the head's compare-and-swap lets one upload land; the other is refused, its
manifest and sidecar objects deleted (its blocks, named by their content, are the tier's
to keep or sweep); the losing replica's next turn restores the winner's state."""

from __future__ import annotations

import asyncio

from strata_auto_sessions.naming import session_name
from strata_serve.testing import conversation
from tests.replicas import Replicas, restored_from

from . import head_gate as head_gate_plugin
from . import test_shared_replicas as replica_tests
from .test_shared_replicas import HEADER, config_for, parking_stats, served, then, total, until, uploaded

#: The replicas' fixtures: the shared tier (each kind) and the head gate.
shared = replica_tests.shared
head_gate = replica_tests.head_gate


async def test_the_same_turn_on_both_replicas_at_once_one_save_wins_in_blocks(
        tmp_path, strata_demo_model, shared, head_gate):
    assert shared.handle is not None
    headers = {HEADER: "duel-blocks"}
    config = config_for(shared.url, timeout_s=head_gate_plugin.WAIT_S + 10)
    config["plugins"]["auto_sessions"]["blocks"] = True
    config["engine"] = {"side_slot_tokens": 0}
    async with Replicas(tmp_path, strata_demo_model, count=2, config=config) as replicas:
        turn1 = conversation("duel-blocks")
        first = await served(replicas, turn1, headers)
        holder = first.replica
        assert holder is not None and first.key is not None
        other = next(name for name in replicas.names if name != holder)
        name = session_name(first.key, "bin")
        before = await uploaded(shared.handle, name, total(first))
        assert before.generation == 1 and before.manifest

        (head_gate / "armed").write_text("2")
        turn2 = then(turn1, first, "And then?")
        answers = await asyncio.gather(*(replicas.ask(turn2, headers, via=via) for via in (holder, other)))
        assert [answer.status for answer in answers] == [200, 200], [answer.body for answer in answers]
        assert answers[0].reuse.state == "slot" and restored_from(answers[1].reuse, before.tokens), answers

        async def both_settled() -> dict[str, dict] | None:
            counts = {n: await parking_stats(replicas, n) for n in replicas.names}
            done = sum(c["shared_uploads"] + c["shared_uploads_lost"] for c in counts.values())
            return counts if done >= 3 else None

        counts = await until("both saves of the second turn shared or refused", both_settled)
        (head_gate / "armed").unlink()
        lost = {n: c["shared_uploads_lost"] for n, c in counts.items()}
        assert sorted(lost.values()) == [0, 1], counts
        loser = next(n for n, k in lost.items() if k == 1)
        current = await shared.handle.head(name)
        assert current is not None
        head = current[0]
        assert head.generation == 2 and head.manifest, head
        handle = shared.handle

        async def the_losers_deleted() -> bool:
            uploads = {item.name.rsplit(".", 1)[1] for item in await handle.list(name[: -len(".bin")])}
            return uploads == {before.upload, head.upload}

        await until("the losing upload's objects deleted", the_losers_deleted)
        interlude = await replicas.ask(conversation("interlude"), via=loser)
        assert interlude.status == 200, interlude.body
        third = await replicas.ask(then(turn2, answers[0], "And after that?"), headers, via=loser)
        assert third.status == 200, third.body
        assert restored_from(third.reuse, head.tokens), (third.reuse, head)
