"""The shared tier carries blocks (#41): two strata-serve instances parking in blocks (two
real engines) and one shared tier, a directory or S3 (moto's server on loopback). An
upload after a turn sends its manifest and the blocks the tier lacks, a replica's fetch
brings only the blocks it lacks, and the state restored is the conversation's."""

from __future__ import annotations

import asyncio

import pytest

from strata_auto_sessions.shared.blocks import manifest_digest
from strata_serve.testing import ask, conversation

from . import test_shared_parking as shared_parking
from strata_auto_sessions.testing import is_parked
from .test_auto_sessions import key_of, parking


def long_opening(name: str) -> list[dict]:
    """About 2,000 tokens on the demo model."""
    return [{"role": "user", "content": f"Conversation {name}: " + " ".join(f"{name}{n} ship sea wind"
                                                                         for n in range(105))}]


def then(messages, answer, text):
    return messages + [{"role": "assistant", "content": answer["choices"][0]["message"]["content"]},
                       {"role": "user", "content": text}]


def turn_text(name: str) -> str:
    """About 350 tokens on the demo model."""
    return "Next: " + " ".join(f"{name}{n} harbour tide" for n in range(22))


async def server(auto_client, tmp_path, where, url, *, blocks=True, shared_blocks=True):
    return await auto_client(engine={"slot_save_path": str(tmp_path / where)}, idle_save_s=0, blocks=blocks,
                             shared={"url": url, "retry_s": 0.5, "blocks": shared_blocks})


async def settled(*clients):
    for client in clients:
        assert await parking(client).shared.settled(30), "uploads ended"


async def head_of(client, name):
    return (await parking(client).shared.tier.head(name))[0]


@pytest.mark.parametrize("shared_blocks", [True, False], ids=["blocks", "whole-files"])
async def test_an_upload_after_a_turn_sends_only_the_blocks_the_tier_lacks(auto_client, tmp_path, shared_url,
                                                                           shared_blocks):
    one = await server(auto_client, tmp_path, "one", shared_url, shared_blocks=shared_blocks)
    await ask(one, conversation("other"))  # shared before A's turns are measured
    a = long_opening("log")
    first = await ask(one, a)
    await ask(one, conversation("other"))  # a switch: A is saved, then uploaded
    await settled(one)
    key = key_of(one, a)
    name = parking(one).store.bin_name(key)
    before = await head_of(one, name)
    assert before.manifest is shared_blocks
    sent_before = parking(one).stats.shared_uploaded_bytes

    await ask(one, then(a, first, turn_text("log")))
    await ask(one, conversation("other"))  # A's next turn saved, then uploaded
    await settled(one)
    after = await head_of(one, name)
    assert after.generation == 2 and after.manifest is shared_blocks
    new_tokens = after.tokens - before.tokens
    per_token = after.bytes / after.tokens
    assert new_tokens >= 300, (before.tokens, after.tokens)
    sent = parking(one).stats.shared_uploaded_bytes - sent_before  # everything uploaded meanwhile
    ratio = sent / (new_tokens * per_token)
    print(f"upload of a turn ({'blocks' if shared_blocks else 'whole files'}): {sent:,} bytes for {new_tokens} new "
          f"tokens of {per_token:.0f} bytes: {ratio:.2f}x")
    if shared_blocks:
        assert ratio <= 1.5, (sent, new_tokens, per_token, ratio)
    else:  # the control: a whole file sends the whole context again
        assert ratio > 5, (sent, new_tokens, per_token, ratio)


async def test_a_replica_fetches_only_the_blocks_it_lacks_and_restores_the_newest_state(auto_client, tmp_path,
                                                                                        shared_url):
    one = await server(auto_client, tmp_path, "one", shared_url)
    two = await server(auto_client, tmp_path, "two", shared_url)
    a = long_opening("trip")
    first = await ask(one, a)
    await ask(one, conversation("other-one"))
    await settled(one)
    key = key_of(one, a)
    name = parking(one).store.bin_name(key)
    saved = await head_of(one, name)

    a2 = then(a, first, turn_text("trip"))
    second = await ask(two, a2)  # two holds none of A: every block fetched, then restored
    assert parking(two).stats.shared_fetches == 1 and parking(two).stats.restores == 1
    assert second["timings"]["cache_n"] >= saved.tokens - 3, (second["timings"], saved.tokens)
    await ask(two, conversation("other-two"))  # A's next turn saved on two and shared
    await settled(two)
    newer = await head_of(two, name)
    assert newer.generation == 2 and newer.manifest

    fetched_before = parking(one).stats.shared_fetched_bytes
    third = await ask(one, then(a2, second, "And after that?"))  # one holds all but the last turn
    assert parking(one).stats.shared_fetches == 1 and parking(one).stats.restores == 1
    assert third["timings"]["cache_n"] >= newer.tokens - 3, (third["timings"], newer.tokens)
    fetched = parking(one).stats.shared_fetched_bytes - fetched_before
    per_token = newer.bytes / newer.tokens
    print(f"fetch of the last turn: {fetched:,} bytes for {newer.tokens - saved.tokens} new tokens of "
          f"{per_token:.0f} bytes ({fetched / ((newer.tokens - saved.tokens) * per_token):.2f}x); the whole state "
          f"{newer.bytes:,} bytes")
    assert fetched <= 1.5 * (newer.tokens - saved.tokens) * per_token, (fetched, newer.tokens, saved.tokens)
    assert parking(one).store.sidecar(key).tokens == newer.tokens


async def test_a_server_parking_whole_files_refuses_a_conversation_shared_in_blocks(auto_client, tmp_path,
                                                                                   shared_url, caplog):
    one = await server(auto_client, tmp_path, "one", shared_url)
    two = await server(auto_client, tmp_path, "two", shared_url, blocks=False)
    a = long_opening("plain")
    first = await ask(one, a)
    await ask(one, conversation("other-one"))
    await settled(one)
    answer = await ask(two, then(a, first, "Go on."))  # answered, from the prompt: nothing restored
    assert parking(two).stats.shared_fetches == 0 and parking(two).stats.shared_fetch_failures == 1
    assert parking(two).stats.restores == 0 and answer["timings"]["cache_n"] < 100
    assert "parks whole files" in caplog.text


@pytest.fixture
def servers_in_blocks(auto_client):
    """``auto_client`` parking in blocks, and the servers it made."""
    made = []

    async def make(*plugins, **config):
        client = await auto_client(*plugins, **{"blocks": True, **config})
        made.append(client)
        return client

    make.made = made
    return make


async def in_blocks_only(servers, tier_url):
    """Every head in the tier names a manifest, and each server sent or fetched blocks."""
    tier = parking(servers.made[0]).shared.tier
    for name in await tier.heads("auto-"):
        current = await tier.head(name)
        assert current is not None and (current[0].tombstone or current[0].manifest), (name, current)
    assert all(parking(client).shared.tier_blocks.known for client in servers.made), tier_url


async def test_the_failover_holds_in_blocks(servers_in_blocks, tmp_path, shared_url):
    await shared_parking.test_a_conversation_moves_between_servers_and_back_with_its_newest_state(
        servers_in_blocks, tmp_path, shared_url)
    await in_blocks_only(servers_in_blocks, shared_url)


async def test_two_writers_hold_in_blocks(servers_in_blocks, tmp_path, shared_url, caplog):
    await shared_parking.test_a_save_made_from_an_older_turn_never_overwrites_a_newer_one(
        servers_in_blocks, tmp_path, caplog, shared_url)
    await in_blocks_only(servers_in_blocks, shared_url)


async def test_a_conversation_pruned_here_while_its_blocks_are_sent_is_shared_whole(auto_client, tmp_path,
                                                                                     shared_url):
    """``keep = 1``: A's upload is held at its first block while the next save prunes A
    here (its manifest, its sidecar and, but for the upload, its blocks). The upload still
    sends every block, as a whole file's hard link does, and another server restores A from
    the tier. Before, the pruned blocks were gone from under the upload: A was shared by
    neither server."""
    one = await auto_client(engine={"slot_save_path": str(tmp_path / "one")}, idle_save_s=0, blocks=True, keep=1,
                            shared={"url": shared_url, "retry_s": 0.5})
    tier = parking(one).shared.tier_blocks.tier
    reached, release = asyncio.Event(), asyncio.Event()
    real_put_block = tier.put_block

    async def held_put_block(name, data):
        if not reached.is_set():
            reached.set()
            await release.wait()
        return await real_put_block(name, data)

    tier.put_block = held_put_block
    a = long_opening("pruned")
    first = await ask(one, a)
    await ask(one, conversation("p-b"))  # A saved; its upload held at its first block
    await asyncio.wait_for(reached.wait(), 30)
    await ask(one, conversation("p-c"))  # B saved: A pruned here while its upload is held
    key = key_of(one, a)
    assert not is_parked(parking(one).store.directory, key) and parking(one).stats.prunes >= 1
    release.set()
    await settled(one)
    assert parking(one).stats.shared_upload_failures == 0
    saved = await head_of(one, parking(one).store.bin_name(key))
    assert saved.manifest

    two = await server(auto_client, tmp_path, "two", shared_url)
    answer = await ask(two, then(a, first, "Go on."))
    assert parking(two).stats.shared_fetches == 1 and parking(two).stats.restores == 1
    assert answer["timings"]["cache_n"] >= saved.tokens - 3, (answer["timings"], saved.tokens)


async def test_another_answer_to_the_same_prompt_is_shared_though_it_is_as_long(auto_client, tmp_path, shared_url):
    """A's prompt asked again, answered otherwise with as many tokens (a regenerated answer):
    the same prompt, the same count, other blocks. Its head moves on to the new state.
    Before, a head in blocks carried no digest, and a state of the same prompt and count
    was taken for the one the head held: the tier kept the first answer's state."""
    one = await server(auto_client, tmp_path, "one", shared_url)
    a = long_opening("redo")
    answer = {"temperature": 1.0, "max_tokens": 8, "ignore_eos": True}
    await ask(one, a, seed=1, **answer)
    await ask(one, conversation("other"))  # A saved, then uploaded
    await settled(one)
    key = key_of(one, a)
    name = parking(one).store.bin_name(key)
    blocks = parking(one).store.blocks
    first_state, first_head = blocks.manifest(key, 0), await head_of(one, name)

    await ask(one, a, seed=2, **answer)  # the same prompt, another answer as long
    await ask(one, conversation("other"))
    await settled(one)
    second_state, second_head = blocks.manifest(key, 0), await head_of(one, name)
    assert second_state.tokens == first_state.tokens and second_state.identity != first_state.identity
    assert second_head.generation == first_head.generation + 1, (first_head, second_head)
    assert second_head.digest == manifest_digest(second_state) != first_head.digest
