"""The engine's saves staged in memory and the newest states kept there whole
(:mod:`strata_auto_sessions.staging`), without an engine: the engine's part (saving
through the link, restoring through one) is in test_block_parking.py."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from strata_auto_sessions.staging import Staging, staged_link
from strata_auto_sessions.store import SessionStore


@pytest.fixture
def dirs(tmp_path) -> tuple[Path, Path]:
    slots, memory = tmp_path / "slots", tmp_path / "memory"
    slots.mkdir()
    memory.mkdir()
    return slots, memory


def engine_save(temp: Path, size: int) -> None:
    """What the engine does: open the name in the slot directory and write its file."""
    with open(temp, "wb") as f:
        f.write(os.urandom(size))


def staged(staging: Staging, slots: Path, name: str, size: int) -> Path:
    temp = slots / name
    staging.link(temp)
    engine_save(temp, size)
    return temp


def test_a_save_lands_in_memory_and_is_kept_for_its_manifest_only(dirs):
    slots, memory = dirs
    staging = Staging.open(slots, memory, keep_bytes=10_000)
    assert staging is not None and staging.directory.parent == memory
    temp = staged(staging, slots, "tmp-auto-a.bin", 1000)
    assert temp.is_symlink() and (staging.directory / temp.name).stat().st_size == 1000
    data = temp.read_bytes()
    staging.keep(temp, "a", 0, ("manifest", 1))
    assert not temp.exists() and not temp.is_symlink()
    assert staging.kept_bytes == 1000

    assert not staging.link_kept("a", 1, ("manifest", 1), slots / "r0.bin"), "another sibling"
    assert staging.link_kept("a", 0, ("manifest", 1), slots / "r1.bin")
    assert (slots / "r1.bin").read_bytes() == data and staging.hits == 1
    staging.discard(slots / "r1.bin")  # the restore's link goes; the kept file stays
    (slots / "r1.bin").unlink()
    assert staging.link_kept("a", 0, ("manifest", 1), slots / "r2.bin")

    assert not staging.link_kept("a", 0, ("manifest", 2), slots / "r3.bin"), "the manifest changed since"
    assert staging.kept_bytes == 0 and not (slots / "r3.bin").exists()
    assert not staging.link_kept("a", 0, ("manifest", 1), slots / "r4.bin"), "forgotten once stale"


def test_the_least_recently_used_go_past_the_budget(dirs):
    slots, memory = dirs
    staging = Staging.open(slots, memory, keep_bytes=2500)
    assert staging is not None
    for key in "abc":
        staging.keep(staged(staging, slots, f"tmp-auto-{key}.bin", 1000), key, 0, (key,))
    assert staging.kept_bytes == 2000
    assert not staging.link_kept("a", 0, ("a",), slots / "ra.bin"), "the oldest went for the third"
    assert staging.link_kept("b", 0, ("b",), slots / "rb.bin")  # b now the newest use
    staging.keep(staged(staging, slots, "tmp-auto-d.bin", 1000), "d", 0, ("d",))
    assert staging.link_kept("b", 0, ("b",), slots / "rb2.bin")
    assert not staging.link_kept("c", 0, ("c",), slots / "rc.bin")
    staging.keep(staged(staging, slots, "tmp-auto-e.bin", 3000), "e", 0, ("e",))
    assert not staging.link_kept("e", 0, ("e",), slots / "re.bin"), "larger than the budget: not kept"
    assert len(list(staging.directory.iterdir())) == 2


def test_a_state_kept_whole_becomes_a_real_file_and_a_failed_save_leaves_nothing(dirs):
    slots, memory = dirs
    staging = Staging.open(slots, memory, keep_bytes=10_000)
    assert staging is not None
    temp = staged(staging, slots, "tmp-auto-a.bin", 500)
    data = temp.read_bytes()
    staging.make_real(temp)
    assert not temp.is_symlink() and temp.read_bytes() == data
    assert list(staging.directory.iterdir()) == []

    temp = staged(staging, slots, "tmp-auto-b.bin", 500)
    staging.failed(temp, OSError("no space left"))
    staging.discard(temp)
    temp.unlink()
    assert list(staging.directory.iterdir()) == [] and not staging.on
    staging.link(slots / "tmp-auto-c.bin")
    assert not (slots / "tmp-auto-c.bin").is_symlink(), "after a failure, saves go to the slot directory"


def test_a_directory_others_may_enter_is_never_used(dirs):
    slots, memory = dirs
    first = Staging.open(slots, memory, keep_bytes=1)
    assert first is not None
    first.directory.chmod(0o755)
    assert Staging.open(slots, memory, keep_bytes=1) is None
    first.directory.rmdir()
    first.directory.symlink_to(memory)
    assert Staging.open(slots, memory, keep_bytes=1) is None, "a link put in its place"


def test_a_start_clears_what_a_stopped_server_left(dirs):
    slots, memory = dirs
    staging = Staging.open(slots, memory, keep_bytes=10_000)
    assert staging is not None
    temp = staged(staging, slots, "tmp-auto-a.bin", 100)
    staging.keep(staged(staging, slots, "tmp-auto-b.bin", 100), "b", 0, ("b",))
    assert staged_link(temp)

    again = Staging.open(slots, memory, keep_bytes=10_000)
    assert again is not None and list(again.directory.iterdir()) == []
    store = SessionStore(slots)
    assert store.prepare() == 1 and not temp.is_symlink(), "the dangling link went"
    store.release()
    again.close()
    assert not again.directory.exists()
