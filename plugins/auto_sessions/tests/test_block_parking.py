"""Parking in blocks of tokens (``blocks = true``) against the real engine: what reaches the
disk, what comes back, what is kept whole, and what pruning and ``sessions rm`` free."""

from __future__ import annotations

import asyncio
import errno
import json
import logging
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

import strata_auto_sessions.store as store_module
from strata_auto_sessions.parked_blocks import BLOCKS_DIR, ParkedBlocks
from strata_serve import CutState
from strata_serve.api import SERVICE
from strata_serve.cli import cli
from strata_serve.engine.llama_server.state_format import LlamaStateFormat
from strata_serve.testing import ask

from .test_auto_sessions import key_of, parking, slot_dir
from .test_shared_parking import settled, shared_head, then

BLOCK = 64


@pytest.fixture(autouse=True)
def plugin_logs(caplog):
    caplog.set_level(logging.INFO, logger="strata_auto_sessions")


def words(name: str, n: int) -> str:
    return " ".join(f"{name}{i} ship sea wind" for i in range(n))


#: An opening six agent sessions share (a system prompt and tools, say): ~1,800 tokens.
OPENING = "You are a careful assistant. " + words("tool", 100)


def agent(name: str, size: int = 20) -> list[dict[str, Any]]:
    """A conversation opening with ``OPENING``, then ~``size * 4.5`` tokens of its own."""
    return [{"role": "system", "content": OPENING}, {"role": "user", "content": f"Task {name}: " + words(name, size)}]


def turn(messages: list[dict[str, Any]], answer: dict[str, Any], text: str) -> list[dict[str, Any]]:
    return messages + [{"role": "assistant", "content": answer["choices"][0]["message"]["content"]},
                       {"role": "user", "content": text}]


def tokens_and_bytes(path: Path) -> tuple[tuple[int, ...], int]:
    """A state file's tokens and the engine's bytes for them (without the file's header)."""
    state = LlamaStateFormat().cut(path, BLOCK)
    assert isinstance(state, CutState), state
    return state.tokens, sum(len(b.data) for b in [*state.blocks, state.tail])


def distinct(sequences: list[tuple[int, ...]]) -> int:
    """Tokens of ``sequences`` with each shared prefix counted once (the nodes of their trie)."""
    prefixes = {seq[:n] for seq in sequences for n in range(1, len(seq) + 1)}
    return len(prefixes)


def parked_states(directory: Path, tmp: Path, keys: list[str]) -> list[tuple[tuple[int, ...], int]]:
    """Each conversation's tokens and state bytes: from its whole file, or its blocks joined."""
    blocks = ParkedBlocks.existing(directory)
    found = []
    for n, key in enumerate(keys):
        whole = directory / f"auto-{key}.bin"
        if whole.is_file():
            found.append(tokens_and_bytes(whole))
            continue
        assert blocks is not None
        blocks.store.format = LlamaStateFormat()
        blocks.join_into(key, 0, tmp / f"joined-{n}.bin")
        found.append(tokens_and_bytes(tmp / f"joined-{n}.bin"))
    return found


def disk_bytes(directory: Path) -> int:
    """Bytes of everything parking keeps in the slot directory: whole files, blocks, manifests."""
    whole = sum(p.stat().st_size for p in directory.glob("auto-*.bin"))
    store = directory / BLOCKS_DIR
    return whole + (sum(p.stat().st_size for p in store.rglob("*") if p.is_file()) if store.is_dir() else 0)


async def park_six(auto_client, slots: Path, blocks: bool) -> tuple[list[str], Any]:
    client = await auto_client(engine={"slot_save_path": str(slots)}, blocks=blocks, idle_save_s=0, keep=12)
    convs = [agent(f"s{n}") for n in range(6)]
    for messages in convs:
        await ask(client, messages, max_tokens=1)
    keys = [key_of(client, m) for m in convs]
    stats = parking(client).stats
    await client.close()  # the sixth is parked at the stop
    return keys, stats


async def test_six_conversations_sharing_an_opening_take_their_distinct_tokens_bytes(auto_client, tmp_path):
    ratios = {}
    for blocks in (True, False):
        slots = tmp_path / f"slots-{blocks}"
        keys, stats = await park_six(auto_client, slots, blocks)
        states = parked_states(slots, tmp_path, keys)
        per_token = sum(b for _t, b in states) / sum(len(t) for t, _b in states)
        ratios[blocks] = disk_bytes(slots) / (distinct([t for t, _b in states]) * per_token)
        assert len(states) == 6
        if blocks:
            assert not list(slots.glob("auto-*.bin")), "parked in blocks, not whole files"
            assert stats.block_saves == 6 and stats.blocks_deduplicated_bytes > 0
    assert ratios[True] <= 1.15, ratios
    assert ratios[False] > 3, ratios


async def test_a_turn_writes_about_its_new_tokens_bytes(auto_client, tmp_path):
    ratios: dict[bool, list[float]] = {}
    for blocks in (True, False):
        client = await auto_client(engine={"slot_save_path": str(tmp_path / f"slots-{blocks}"), "ctx_size": 8192},
                                   blocks=blocks, idle_save_s=0)
        stats = parking(client).stats
        convs = {"a": agent("a"), "b": agent("b")}
        last_tokens: dict[str, int] = {}
        ratios[blocks] = []
        for n in range(5):  # a, b, a, b, a: each request saves the other conversation
            name = "ab"[n % 2]
            other = "ab"[(n + 1) % 2]
            before = (stats.saves, stats.saved_tokens, stats.block_written_bytes, stats.saved_bytes)
            answer = await ask(client, convs[name], max_tokens=2)
            if n:
                assert stats.saves == before[0] + 1
                tokens = stats.saved_tokens - before[1]
                written = stats.block_written_bytes - before[2] if blocks else stats.saved_bytes - before[3]
                per_token = (stats.saved_bytes - before[3]) / tokens
                if other in last_tokens:
                    ratios[blocks].append(written / ((tokens - last_tokens[other]) * per_token))
                last_tokens[other] = tokens
            convs[name] = turn(convs[name], answer, f"Next step {n}: " + words(f"t{n}", 15))
        assert stats.block_saves == (4 if blocks else 0), "each save in blocks, or none"
        await client.close()
    assert len(ratios[True]) == 2 and max(ratios[True]) <= 1.5, ratios
    assert min(ratios[False]) > 3, ratios


#: Parked whole; in blocks joined at the restore (no state kept whole in memory); in
#: blocks with the newest states kept whole in memory (the default).
HOW_PARKED = {"whole": {"blocks": False}, "joined": {"blocks": True, "stage_keep_mb": 0},
              "kept": {"blocks": True}}


async def test_restored_from_blocks_it_answers_as_from_a_whole_file(auto_client, tmp_path, sharp_model):
    answers = {}
    for how, settings in HOW_PARKED.items():
        slots = tmp_path / f"slots-{how}"
        client = await auto_client(engine={"slot_save_path": str(slots), "model": str(sharp_model)}, idle_save_s=0,
                                   **settings)
        a, b = agent("alpha", 60), agent("beta")
        first = await ask(client, a, max_tokens=8, temperature=0)
        await ask(client, b, max_tokens=1)
        back = await ask(client, turn(a, first, "Go on."), max_tokens=8, temperature=0, n_probs=3)
        stats = parking(client).stats
        assert stats.restores == 1 and stats.restore_failures == 0 and stats.restores_refused_damaged == 0
        key = key_of(client, a)
        assert (slots / f"auto-{key}.bin").is_file() is (how == "whole")
        assert not list(slots.glob("tmp-auto-*")), "the joined file (or the link) is removed once restored"
        staging = parking(client).store.staging
        if how != "whole":
            assert staging is not None and stats.restores_kept_whole == (how == "kept"), "kept: read from memory"
        answers[how] = (back["choices"][0]["message"]["content"], back["timings"]["cache_n"],
                        back["timings"]["prompt_n"])
        await client.close()
        if staging is not None:
            assert not staging.directory.exists(), "the stage directory goes at the stop"
    assert answers["joined"] == answers["whole"] == answers["kept"]
    assert answers["whole"][1] > 1500, answers


@pytest.fixture(scope="module")
def sharp_model(tmp_path_factory):
    from tests.parked_state import sharp_demo_model

    return sharp_demo_model(tmp_path_factory.mktemp("sharp"))


async def test_a_refused_state_is_parked_whole_with_its_reason_counted(auto_client, caplog):
    client = await auto_client(engine={"extra_args": ["--context-shift"]}, blocks=True, idle_save_s=0)
    a, b = agent("a"), agent("b")
    for messages in (a, b, a, b):
        await ask(client, messages, max_tokens=1)
    stats = parking(client).stats
    directory = slot_dir(client)
    assert stats.saves == 3 and stats.block_saves == 0 and stats.blocks_refused_shifted == 3
    assert (directory / f"auto-{key_of(client, a)}.bin").is_file()
    assert stats.restores == 2
    said = [r.getMessage() for r in caplog.records if "not in blocks" in r.getMessage()]
    assert len(said) == 1 and "shifted" in said[0], said


async def test_an_earlier_versions_whole_file_restores_and_is_cut_at_its_next_save(auto_client):
    a, b = agent("old", 60), agent("new")
    before = await auto_client(blocks=False, idle_save_s=0)
    await ask(before, a, max_tokens=1)
    directory = slot_dir(before)
    key = key_of(before, a)
    await before.close()
    assert (directory / f"auto-{key}.bin").is_file()

    after = await auto_client(blocks=True, idle_save_s=0)
    reply = await ask(after, a, max_tokens=1)
    stats = parking(after).stats
    assert stats.restores == 1 and reply["timings"]["cache_n"] > 1500
    await ask(after, b, max_tokens=1)  # a is saved again: in blocks now
    assert not (directory / f"auto-{key}.bin").exists()
    blocks = parking(after).store.blocks
    assert blocks is not None and blocks.manifest(key, 0) is not None
    reply = await ask(after, a, max_tokens=1)
    assert stats.restores == 2 and reply["timings"]["cache_n"] > 1500


def held_objects(directory: Path) -> tuple[set[str], set[str]]:
    """The objects the manifests hold, and those on disk."""
    blocks = ParkedBlocks.existing(directory)
    assert blocks is not None
    held = {name for m in blocks.store.manifests() for name in m.objects()}
    return held, set(blocks.sizes())


async def test_pruning_never_removes_a_block_a_manifest_holds(auto_client):
    client = await auto_client(blocks=True, idle_save_s=0, keep=2)
    convs = [agent(f"p{n}") for n in range(5)]
    for messages in convs:
        await ask(client, messages, max_tokens=1)
    directory = slot_dir(client)
    store = parking(client).store
    assert len(store.sessions()) == 2  # the keep limit: the others' manifests are gone
    held, stored = held_objects(directory)
    assert held <= stored, "every block a manifest holds is there"
    assert stored == held, "a block no manifest holds is freed"
    # The kept ones restore whole, the shared opening included.
    reply = await ask(client, convs[3], max_tokens=1)
    assert parking(client).stats.restores == 1 and reply["timings"]["cache_n"] > 1500


def sessions(directory: Path, *args: str) -> tuple[int, str]:
    result = CliRunner().invoke(cli, ["sessions", "--slot-dir", str(directory), *args])
    return result.exit_code, result.output


async def test_rm_frees_the_blocks_no_other_conversation_holds(auto_client):
    client = await auto_client(blocks=True, idle_save_s=0)
    convs = [agent(f"r{n}") for n in range(3)]
    for messages in convs:
        await ask(client, messages, max_tokens=1)
    keys = [key_of(client, m) for m in convs]
    directory = slot_dir(client)
    await client.close()

    code, output = sessions(directory, "ls", "--json")
    assert code == 0, output
    rows = {row["key"]: row for row in map(json.loads, output.splitlines())}
    assert all(rows[k]["blocks"] and rows[k]["shared_bytes"] > rows[k]["own_bytes"] > 0 for k in keys), rows
    code, output = sessions(directory, "ls")
    assert code == 0 and "SHARED" in output and "counted once" in output, output
    code, output = sessions(directory, "inspect", keys[0])
    assert code == 0 and "in blocks under" in output and "intact: yes" in output, output
    code, output = sessions(directory, "ls", "--blocks", "--json")
    detail = json.loads(output)
    assert detail["manifests"] == 3 and detail["deduplicated_bytes"] > 0, detail

    blocks = ParkedBlocks.existing(directory)
    assert blocks is not None
    own = blocks.objects_of(keys[0], 0) - blocks.objects_of(keys[1], 0) - blocks.objects_of(keys[2], 0)
    shared = blocks.objects_of(keys[0], 0) & blocks.objects_of(keys[1], 0)
    assert own and shared
    code, output = sessions(directory, "rm", keys[0])
    assert code == 0, output
    held, stored = held_objects(directory)
    assert not own & stored, "its own blocks are freed"
    assert shared <= stored and held == stored, "the blocks others hold stay"
    assert blocks.manifest(keys[0], 0) is None
    assert all(blocks.intact(k, 0, rows[k]["tokens"]) for k in keys[1:])


async def test_in_blocks_a_conversation_moves_between_servers_through_the_shared_tier(auto_client, tmp_path,
                                                                                     shared_url):
    shared = {"url": shared_url, "retry_s": 0.5}
    one = await auto_client(engine={"slot_save_path": str(tmp_path / "one")}, idle_save_s=0, shared=shared,
                            blocks=True)
    two = await auto_client(engine={"slot_save_path": str(tmp_path / "two")}, idle_save_s=0, shared=shared,
                            blocks=True)
    a = agent("voyage")
    first = await ask(one, a, max_tokens=1)
    await ask(one, agent("other-one"), max_tokens=1)  # a is saved on one, in blocks, then uploaded
    await settled(one)
    key = key_of(one, a)
    name = parking(one).store.bin_name(key)
    saved = parking(one).store.sidecar(key)
    assert parking(one).stats.block_saves == 1 and not (tmp_path / "one" / name).exists()
    assert parking(one).stats.shared_uploads == 1 and (await shared_head(one, name)).generation == 1

    a2 = then(a, first, "And then?")
    second = await ask(two, a2, max_tokens=1)  # fetched, cut into two's blocks, joined and restored
    assert parking(two).stats.shared_fetches == 1 and parking(two).stats.restores == 1
    assert not (tmp_path / "two" / name).exists() and parking(two).store.blocks.manifest(key, 0) is not None
    assert second["timings"]["cache_n"] >= saved.tokens - 3, (second["timings"], saved.tokens)
    await ask(two, agent("other-two"), max_tokens=1)  # a's next turn saved on two: generation 2
    await settled(two)
    newer = await shared_head(two, name)
    assert newer.generation == 2 and newer.tokens > saved.tokens

    third = await ask(one, then(a2, second, "And after that?"), max_tokens=1)  # one's copy is older: fetched
    assert parking(one).stats.shared_fetches == 1 and parking(one).stats.restores == 1
    assert third["timings"]["cache_n"] >= newer.tokens - 3, (third["timings"], newer.tokens)


@pytest.mark.parametrize("fsync", ["background", "at_save"])
async def test_a_save_in_blocks_reaches_the_disk_with_its_new_blocks_and_manifest(auto_client, monkeypatch, fsync):
    """``fsync = "background"``: the new blocks and the manifest a save wrote are fsynced
    with its sidecar off the request's path, and their directories too, so a power cut
    after the sync leaves the conversation whole. ``at_save`` (the control of the paths):
    the block store fsyncs them itself as it writes them."""
    synced: list[Path] = []
    real = store_module._fsync
    monkeypatch.setattr(store_module, "_fsync", lambda path: (synced.append(Path(path)), real(path))[1])
    client = await auto_client(blocks=True, idle_save_s=0, ram_first=False, fsync=fsync)
    a = agent("durable-a")
    await ask(client, a)
    await ask(client, agent("durable-b"))  # A parked in blocks
    await parking(client).synced()
    blocks = parking(client).store.blocks
    key = key_of(client, a)
    manifest = blocks.store._manifest_path(f"{key}#0")
    objects = [blocks.store._object_path(name) for name in blocks.manifest(key, 0).objects()]
    assert objects and manifest.is_file()
    if fsync == "background":
        assert manifest in synced and all(path in synced for path in objects), synced
        assert manifest.parent in synced and all(path.parent in synced for path in objects)
    else:
        assert manifest not in synced and not any(path in synced for path in objects)


@pytest.mark.parametrize("staged", [True, False], ids=["staged", "on-disk"])
async def test_a_joined_state_is_made_in_memory_and_never_reaches_the_slot_directory(auto_client, tmp_path, staged):
    """The file a restore joins from blocks lives only until the engine has read it: with
    saves staged in memory it is made there, behind a link in the slot directory (its
    bytes never reach the disk); with staging off (the control), in the slot directory.
    Both restores: the conversation's own blocks, and another's found by tokens."""
    slots = tmp_path / "slots"
    client = await auto_client(engine={"slot_save_path": str(slots)}, idle_save_s=0, **HOW_PARKED["joined"])
    store = parking(client).store
    assert store.staging is not None and store.staging.on
    store.staging.on = staged
    engine = client.app[SERVICE].engine
    plain, read = engine.restore, []

    async def restore(filename, slot=0):
        path = slots / filename
        read.append((path.is_symlink(), path.resolve().parent == store.staging.directory.resolve()))
        return await plain(filename, slot)

    engine.restore = restore
    a = agent("alpha", 60)
    first = await ask(client, a, max_tokens=2)
    await ask(client, [{"role": "user", "content": "Unrelated: " + words("zz", 80)}], max_tokens=1)
    await ask(client, turn(a, first, "Go on."), max_tokens=1)  # its own blocks, joined
    await ask(client, [{"role": "user", "content": "Unrelated too: " + words("yy", 80)}], max_tokens=1)
    await ask(client, agent("beta", 60), max_tokens=1)  # "alpha"'s opening, found by tokens
    stats = parking(client).stats
    assert stats.restores == 2 and stats.restores_by_tokens == 1, stats
    assert read == [(staged, staged)] * 2, read
    assert not list(slots.glob("tmp-*")) and not list(store.staging.directory.glob("tmp-*"))
    await client.close()


async def test_a_join_in_memory_that_finds_no_room_is_made_in_the_slot_directory(auto_client, tmp_path, caplog):
    """tmpfs full (ENOSPC) while joining: the join is made again in the slot directory, and
    the restore goes on."""
    slots = tmp_path / "slots"
    client = await auto_client(engine={"slot_save_path": str(slots)}, idle_save_s=0, **HOW_PARKED["joined"])
    store = parking(client).store
    plain = store.blocks.join_into
    full = []

    def join_into(key, sibling, dest):
        if dest.parent == store.staging.directory:
            full.append(dest)
            dest.write_bytes(b"partial")
            raise OSError(errno.ENOSPC, "No space left on device")
        return plain(key, sibling, dest)

    store.blocks.join_into = join_into
    a = agent("alpha", 60)
    first = await ask(client, a, max_tokens=2)
    await ask(client, [{"role": "user", "content": "Unrelated: " + words("zz", 80)}], max_tokens=1)
    back = await ask(client, turn(a, first, "Go on."), max_tokens=1)
    stats = parking(client).stats
    assert len(full) == 1 and stats.restores == 1 and stats.restore_failures == 0, stats
    assert back["timings"]["cache_n"] >= first["timings"]["prompt_n"], back["timings"]
    assert any("a join in memory failed" in r.getMessage() and r.levelno == logging.INFO for r in caplog.records)
    assert not list(slots.glob("tmp-*")) and not list(store.staging.directory.glob("tmp-*")), "nothing left"
    await client.close()


async def test_a_save_cuts_its_state_off_the_event_loop(auto_client, tmp_path, monkeypatch):
    """A save's commit (cutting the state, writing its new blocks) runs in a thread: while
    it is under way the server answers other requests (here ``/health``). The block
    store's save is held until the health check was answered; run on the event loop, it
    would hold the loop itself, the check could not be answered, and the hold would end
    only at its 10 s deadline, unreleased. The save then completes as usual."""
    import threading

    client = await auto_client(engine={"slot_save_path": str(tmp_path / "slots")}, blocks=True, idle_save_s=0)
    blocks = parking(client).store.blocks
    entered, release, released = threading.Event(), threading.Event(), []
    real_save = blocks.save

    def held_save(*args, **kwargs):
        entered.set()
        released.append(release.wait(10))
        return real_save(*args, **kwargs)

    monkeypatch.setattr(blocks, "save", held_save)
    await ask(client, agent("a"), max_tokens=2)
    switch = asyncio.create_task(ask(client, agent("b"), max_tokens=2))  # "a" is saved on the way
    assert await asyncio.to_thread(entered.wait, 10), "the switch's save began"
    health = await client.get("/health")
    assert health.status == 200
    release.set()
    await switch
    assert released == [True], "the health check was answered while the save was held"
    stats = parking(client).stats
    assert stats.saves == 1 and stats.block_saves == 1 and stats.save_failures == 0, stats
    await client.close()
