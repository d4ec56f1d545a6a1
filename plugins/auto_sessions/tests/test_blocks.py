"""The block store (strata_auto_sessions/blocks): each block written once, found by tokens.

Unit tests on slot files written by hand (tests/state_files.py, in llama-server's layout),
cut by the llama-server backend's format; then one round trip through the real engine.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from strata_auto_sessions.blocks import BlockStore, CorruptBlock
from strata_auto_sessions.blocks.objects import publish
from strata_serve import LlamaServer, tenant_key
from tests.state_files import kv_cache, state_file

FORMAT = LlamaServer.state_format
assert FORMAT is not None
B = 8
OPENING = list(range(1000, 1024))  # three whole blocks
FINGERPRINT = {"model": "crafted", "size": 1}


def store_at(root: Path, **kw) -> BlockStore:
    kw.setdefault("grace_s", 0)
    return BlockStore(root, FORMAT, fingerprint=kw.pop("fingerprint", FINGERPRINT), block_tokens=B, **kw)


def staged(tmp_path: Path, tokens: list[int], name: str = "staged.bin", **shape) -> Path:
    path = tmp_path / name
    path.write_bytes(state_file(tokens, **shape))
    return path


def conversation(n: int, length: int = 20) -> list[int]:
    return OPENING + [2000 + 100 * n + i for i in range(length)]


def object_files(root: Path) -> list[Path]:
    return [p for p in (root / "objects").rglob("*") if p.is_file()]


def test_conversations_sharing_an_opening_store_it_once(tmp_path):
    store = store_at(tmp_path / "store")
    first = store.save("a", staged(tmp_path, conversation(1)))
    second = store.save("b", staged(tmp_path, conversation(2)))
    assert (first.blocks, first.blocks_written) == (5, 5)
    # b's opening is a's: only its own two blocks (and its tail) reach the disk
    assert (second.blocks, second.blocks_written) == (5, 2)
    assert second.bytes_written < first.bytes_written
    blocks_of = {key: store.manifest(key).chain for key in ("a", "b")}
    assert blocks_of["a"][:3] == blocks_of["b"][:3] and blocks_of["a"][3:] != blocks_of["b"][3:]
    assert store.usage().objects == 5 + 2 + 2  # blocks, once each, and the two tails


def test_a_turn_added_writes_only_its_new_blocks(tmp_path):
    store = store_at(tmp_path / "store")
    store.save("a", staged(tmp_path, conversation(1, 20)))
    again = store.save("a", staged(tmp_path, conversation(1, 20)))
    assert again.blocks_written == 0 and again.bytes_written < 1000  # the manifest alone
    longer = store.save("a", staged(tmp_path, conversation(1, 40)))
    assert (longer.blocks, longer.blocks_written) == (8, 3)
    per_cell = len(FORMAT.cut(staged(tmp_path, conversation(1, 40)), B).blocks[0].data) // B  # type: ignore[union-attr]
    new_tokens = 40 - 20
    assert longer.bytes_written < 1.5 * new_tokens * per_cell + 2000


def test_a_save_copies_out_of_the_engines_file_only_the_blocks_the_store_lacks(tmp_path, monkeypatch):
    from strata_serve.engine.llama_server import state_file as llama_file

    gathered = []
    real = llama_file._block_data
    monkeypatch.setattr(llama_file, "_block_data", lambda buf, cache, a, b: gathered.append((a, b)) or
                        real(buf, cache, a, b))
    store = store_at(tmp_path / "store")
    store.save("a", staged(tmp_path, conversation(1, 20)))  # 44 tokens: 5 blocks and a tail of 4
    assert len(gathered) == 6
    gathered.clear()
    longer = store.save("a", staged(tmp_path, conversation(1, 40)))  # 64 tokens: 8 blocks, no tail
    assert longer.blocks_written == 3 and sorted(gathered) == [(40, 48), (48, 56), (56, 64), (64, 64)]
    store.materialize(store.chain_of("a"), tmp_path / "a.bin")
    assert (tmp_path / "a.bin").read_bytes() == state_file(conversation(1, 40))


def test_a_prompt_finds_the_longest_chain_from_any_of_its_tenants_conversations(tmp_path):
    store = store_at(tmp_path / "store")
    store.save("a", staged(tmp_path, conversation(1)))
    prompt = OPENING + [7, 7, 7, 7, 7, 7, 7, 7, 7]  # a's opening, then something new
    chain = store.longest_prefix(None, prompt)
    assert chain is not None and chain.tokens == 24 and len(chain.names) == 3 and chain.tail is None
    store.materialize(chain, tmp_path / "prefix.bin")
    assert (tmp_path / "prefix.bin").read_bytes() == state_file(OPENING)
    assert store.longest_prefix(None, [5] * 30) is None


def test_a_prompt_that_continues_a_whole_conversation_gets_its_tail_too(tmp_path):
    store = store_at(tmp_path / "store")
    tokens = conversation(1)  # 44 tokens: 5 blocks and a tail of 4
    store.save("a", staged(tmp_path, tokens))
    chain = store.longest_prefix(None, tokens + [1, 2, 3])
    assert chain is not None and chain.tokens == len(tokens) and chain.tail is not None and chain.source == "a"
    store.materialize(chain, tmp_path / "whole.bin")
    assert (tmp_path / "whole.bin").read_bytes() == state_file(tokens)
    # a prompt that leaves the tail's tokens gets the blocks alone
    shorter = store.longest_prefix(None, tokens[:41] + [9, 9, 9])
    assert shorter is not None and shorter.tokens == 40 and shorter.tail is None


def windowed(tmp_path: Path, tokens: list[int], name: str = "staged.bin", window: int = 12) -> Path:
    """A sliding-window model's slot file: the base cache, then the last ``window`` cells' window cache."""
    n = len(tokens)
    memory = kv_cache(n) + kv_cache(min(window, n), positions=range(max(n - window, 0), n), n_layer=1, salt="w")
    path = tmp_path / name
    path.write_bytes(state_file(tokens, memory=memory))
    return path


def test_a_sliding_window_state_shares_its_blocks_and_restores_only_whole(tmp_path):
    """Its window cache belongs to the state's end: kept with its manifest, found by a prompt
    only where the whole state prefixes it, never as a shorter chain of its blocks."""
    store = store_at(tmp_path / "store")
    a, b = conversation(1), conversation(2)
    store.save("a", windowed(tmp_path, a))
    second = store.save("b", windowed(tmp_path, b))
    assert second.blocks_written == 2, "the opening's blocks are a's"
    ma = store.manifest("a")
    assert ma is not None and ma.window is not None and ma.window in ma.objects()
    store.materialize(store.chain_of("a"), tmp_path / "a.bin")
    assert (tmp_path / "a.bin").read_bytes() == windowed(tmp_path, a, "again.bin").read_bytes()
    grown = store.longest_prefix(None, a + [7, 7, 7])
    assert grown is not None and grown.tokens == len(a) and grown.window == ma.window and grown.source == "a"
    assert store.longest_prefix(None, OPENING + [7] * 9) is None, "a's opening alone has no window"
    assert store.matched("a", a + [7]) == len(a) and store.matched("a", a[:30]) == 24  # the caller judges


def test_two_tenants_never_share_a_block(tmp_path):
    store = store_at(tmp_path / "store")
    store.save(tenant_key("acme", "a"), staged(tmp_path, conversation(1)))
    other = store.save(tenant_key("globex", "a"), staged(tmp_path, conversation(1)))
    assert other.blocks_written == other.blocks == 5
    assert store.longest_prefix("globex", conversation(1)) is not None
    assert store.longest_prefix("initech", conversation(1)) is None
    assert store.longest_prefix(None, conversation(1)) is None


def test_another_model_or_layout_never_shares_a_block(tmp_path):
    root = tmp_path / "store"
    store_at(root).save("a", staged(tmp_path, conversation(1)))
    assert store_at(root, fingerprint={"model": "another"}).longest_prefix(None, conversation(1)) is None
    assert store_at(root, fingerprint={"model": "another"}).save("b", staged(tmp_path, conversation(1))).blocks_written == 5
    transposed = store_at(root).save("c", staged(tmp_path, conversation(1), v_trans=True))
    assert transposed.blocks_written == 5


def test_blocks_are_private_and_never_overwritten(tmp_path):
    store = store_at(tmp_path / "store")
    store.save("a", staged(tmp_path, conversation(1)))
    files = object_files(tmp_path / "store")
    assert files and all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in files)
    manifest = next((tmp_path / "store" / "manifests").glob("*.json"))
    assert stat.S_IMODE(manifest.stat().st_mode) == 0o600
    before = files[0].read_bytes()
    assert publish(files[0], b"something else") is False
    assert files[0].read_bytes() == before
    assert not [p for p in (tmp_path / "store").rglob("*.tmp")]


def test_a_state_the_format_refuses_is_reported_and_nothing_is_written(tmp_path):
    store = store_at(tmp_path / "store")
    report = store.save("a", staged(tmp_path, conversation(1), n_stream=2, streams_with_cells=(0, 1)))
    assert report.refused is not None and report.refused.reason == "streams"
    assert store.manifest("a") is None and object_files(tmp_path / "store") == []


def test_pruning_frees_a_block_only_when_no_manifest_holds_it(tmp_path):
    store = store_at(tmp_path / "store")
    store.save("a", staged(tmp_path, conversation(1)))
    store.save("b", staged(tmp_path, conversation(2)))
    os.utime(store._manifest_path("a"), (1, 1))  # a is the least recently used
    report = store.prune(keep=1)
    assert report.manifests_removed == ["a"]
    assert report.objects_removed == 3  # a's own two blocks and its tail; the opening is b's too
    chain = store.longest_prefix(None, conversation(2))
    assert chain is not None and chain.tokens == len(conversation(2))
    store.materialize(chain, tmp_path / "b.bin")
    assert (tmp_path / "b.bin").read_bytes() == state_file(conversation(2))


def test_pruning_to_a_size_removes_the_least_recently_used_first(tmp_path):
    store = store_at(tmp_path / "store")
    for n, key in enumerate(("a", "b", "c")):
        store.save(key, staged(tmp_path, conversation(n)))
        os.utime(store._manifest_path(key), (100 + n, 100 + n))
    store.materialize(store.chain_of("a"), tmp_path / "a.bin")  # a is used again: now the newest
    sizes = {p.name: p.stat().st_size for p in object_files(tmp_path / "store")}
    a_bytes = sum(sizes[name] for name in store.manifest("a").objects())
    report = store.prune(max_bytes=a_bytes)
    assert report.manifests_removed == ["b", "c"] and [m.key for m in store.manifests()] == ["a"]
    assert store.usage().bytes == a_bytes


def test_a_removed_conversation_keeps_the_blocks_another_holds(tmp_path):
    store = store_at(tmp_path / "store")
    store.save("a", staged(tmp_path, conversation(1)))
    store.save("b", staged(tmp_path, conversation(2)))
    assert store.remove("a") and not store.remove("a")
    store.prune()
    assert store.longest_prefix(None, OPENING) is not None
    store.remove("b")
    store.prune()
    assert store.usage().objects == 0 and store.longest_prefix(None, OPENING) is None


def test_the_objects_sizes_follow_this_stores_changes_and_another_processs(tmp_path, monkeypatch):
    store = store_at(tmp_path / "store")
    store.save("a", staged(tmp_path, conversation(1)))
    assert store.object_sizes() == {p.name: p.stat().st_size for p in object_files(tmp_path / "store")}
    listed = []
    real = BlockStore._object_files
    monkeypatch.setattr(BlockStore, "_object_files", lambda self: listed.append(1) or real(self))
    store.save("b", staged(tmp_path, conversation(2)))
    store.remove("a")
    store.prune()
    assert store.object_sizes() == {p.name: p.stat().st_size for p in object_files(tmp_path / "store")}
    assert len(listed) == 1, "listed by the prune alone; the sizes followed the save and the prune"
    # Another process (sessions rm) removes b: this store lists the objects again.
    other = store_at(tmp_path / "store")
    other.remove("b")
    other.prune()
    assert store.object_sizes() == {} and store.usage().bytes == 0


def test_young_objects_outlive_a_prune(tmp_path):
    """A save under way elsewhere has written blocks before its manifest: they are kept."""
    store = store_at(tmp_path / "store", grace_s=3600)
    store.save("a", staged(tmp_path, conversation(1)))
    store.remove("a")
    assert store.prune().objects_removed == 0


def test_a_damaged_block_is_not_joined(tmp_path):
    store = store_at(tmp_path / "store")
    store.save("a", staged(tmp_path, conversation(1)))
    chain = store.chain_of("a")
    target = store._object_path(chain.names[1])
    damage_in_place(target)
    with pytest.raises(CorruptBlock, match="digest"):
        store.materialize(chain, tmp_path / "out.bin")
    assert not (tmp_path / "out.bin").exists()
    # the damaged block is gone: the next save of a conversation holding it writes it anew
    with pytest.raises(CorruptBlock, match="missing"):
        store.materialize(chain, tmp_path / "out.bin")
    assert store.save("b", staged(tmp_path, conversation(1))).blocks_written == 1
    store.materialize(store.chain_of("a"), tmp_path / "out.bin")
    assert (tmp_path / "out.bin").read_bytes() == state_file(conversation(1))


def damage_in_place(block: Path) -> None:
    """One byte of ``block``'s data flipped in place (same inode, same size), its mtime a
    second past the one it had: a write later than the file system's clock step shows
    (one within the step shows no change to a ``stat``)."""
    before = block.stat()
    raw = bytearray(block.read_bytes())
    raw[-1] ^= 0xFF
    block.chmod(0o600)
    block.write_bytes(bytes(raw))
    os.utime(block, ns=(before.st_atime_ns, before.st_mtime_ns + 10**9))


class CountedDigests:
    """Counts the SHA-256 digests the block objects take (of data read back or written)."""

    def __init__(self, monkeypatch):
        import hashlib
        import types

        from strata_auto_sessions.blocks import objects

        self.calls = 0

        def sha256(data=b""):
            self.calls += 1
            return hashlib.sha256(data)

        monkeypatch.setattr(objects, "hashlib", types.SimpleNamespace(sha256=sha256))


def test_a_block_read_back_intact_is_not_digested_again_while_its_file_is_unchanged(tmp_path, monkeypatch):
    digests = CountedDigests(monkeypatch)
    store = store_at(tmp_path / "store")
    store.save("a", staged(tmp_path, conversation(1)))  # 5 blocks and a tail, digested as written
    chain = store.chain_of("a")
    assert digests.calls == 6
    for _ in range(2):
        store.materialize(chain, tmp_path / "out.bin")
        assert (tmp_path / "out.bin").read_bytes() == state_file(conversation(1))
    assert digests.calls == 6  # the writer knows them
    other = store_at(tmp_path / "store")  # another process: each object checked on its first read only
    for _ in range(2):
        other.materialize(chain, tmp_path / "out.bin")
        assert (tmp_path / "out.bin").read_bytes() == state_file(conversation(1))
    assert digests.calls == 12


@pytest.mark.parametrize("change", ["in place", "replaced"])
def test_a_block_changed_after_it_was_read_intact_is_refused(tmp_path, change):
    store = store_at(tmp_path / "store")
    store.save("a", staged(tmp_path, conversation(1)))
    chain = store.chain_of("a")
    reader = store_at(tmp_path / "store")
    reader.materialize(chain, tmp_path / "out.bin")  # read back intact: known from now on
    target = store._object_path(chain.names[2])
    if change == "in place":
        damage_in_place(target)
    else:  # another file (another inode) under its name, of the same size
        raw = bytearray(target.read_bytes())
        raw[-1] ^= 0xFF
        replacement = target.with_name("replacement")
        replacement.write_bytes(bytes(raw))
        os.replace(replacement, target)
    for each in (store, reader):  # neither the writer nor a reader takes it on trust
        with pytest.raises(CorruptBlock, match="digest|missing"):
            each.materialize(chain, tmp_path / "out.bin")
    assert not target.exists()


def test_a_temporary_a_killed_save_left_is_pruned(tmp_path):
    store = store_at(tmp_path / "store")
    store.save("a", staged(tmp_path, conversation(1)))
    block = store._object_path(store.chain_of("a").names[0])
    left = block.with_name(f".{block.name}.1234.abcd.tmp")
    left.write_bytes(b"half a block")
    os.utime(left, (1, 1))
    store.prune()
    assert not left.exists() and block.exists()


def test_compressed_blocks_join_into_the_same_file(tmp_path):
    store = store_at(tmp_path / "store", compression="zstd")
    store.save("a", staged(tmp_path, conversation(1)))
    store.materialize(store.chain_of("a"), tmp_path / "a.bin")
    assert (tmp_path / "a.bin").read_bytes() == state_file(conversation(1))


# -- one round trip through the real engine ---------------------------------------------------

async def test_the_engines_state_stored_in_blocks_restores_by_tokens(llama_server_factory, tmp_path):
    server = await llama_server_factory()
    prompt = "The opening every session shares. " * 12 + "Then this session's own question?"
    body = {"prompt": prompt, "n_predict": 4, "temperature": 0, "cache_prompt": True, "id_slot": 0}
    status, first = await server.request("POST", "/completion", json=body)
    assert status == 200
    await server.save("staged.bin", 0)
    slot_dir = server.info.slot_save_path
    store = BlockStore(tmp_path / "store", server.state_format, fingerprint={"model": "tiny"}, block_tokens=64,
                       grace_s=0)
    report = store.save("a", slot_dir / "staged.bin")
    assert report.refused is None and report.blocks == report.tokens // 64
    status, tokenized = await server.request("POST", "/tokenize", json={"content": prompt, "add_special": True})
    tokens = tokenized["tokens"]
    chain = store.longest_prefix(None, tokens)
    assert chain is not None and chain.tokens == len(tokens) // 64 * 64
    store.materialize(chain, slot_dir / "joined.bin")
    await server.erase(0)
    restored = await server.restore("joined.bin", 0)
    assert restored.tokens == chain.tokens
    status, again = await server.request("POST", "/completion", json=body)
    assert again["timings"]["cache_n"] == chain.tokens
    assert again["content"] == first["content"]
