"""SessionStore on its own: names, temporaries, sidecars, pruning."""

import os
import time

import json

import pytest

from strata_auto_sessions.store import (
    SessionStore, Sidecar, engine_fingerprint, fingerprint, incompatibility, same_model,
)
from strata_serve import EngineInfo, StateLayout, StrataRequest


def make_file(store, key, size, age):
    path = store.bin_path(key)
    path.write_bytes(b"x" * size)
    then = time.time() - age
    os.utime(path, (then, then))
    store.write_sidecar(Sidecar(key=key, fingerprint={}, tokens=1, bytes=size, created=then, last_used=then,
                                digest=""))


def test_prepare_removes_only_temporaries(tmp_path):
    store = SessionStore(tmp_path / "slots")
    store.prepare()
    (store.directory / "tmp-auto-a-1234.bin").write_bytes(b"half")
    (store.directory / "tmp-auto-a-1234.json").write_text("{")
    (store.directory / "tmp-auto-a-1234.0a1b2c3d.blk").write_bytes(b"a block a killed fetch brought")
    (store.directory / "manual.bin").write_bytes(b"mine")
    (store.directory / "manual.0a1b2c3d.blk").write_bytes(b"mine too")
    make_file(store, "kept", 10, 0)
    assert store.prepare() == 3
    assert sorted(p.name for p in store.directory.iterdir()) == [
        "auto-.held.json", "auto-.server.json", "auto-kept.bin", "auto-kept.json", "manual.0a1b2c3d.blk",
        "manual.bin"]


def test_prune_by_count_newest_first_and_manual_files_untouched(tmp_path):
    store = SessionStore(tmp_path)
    for n, age in enumerate([50, 10, 30, 40]):
        make_file(store, f"k{n}", 100, age)
    (tmp_path / "manual.bin").write_bytes(b"m" * 1000)
    (tmp_path / "auto-notes.txt").write_text("not ours either")
    removed = store.prune(keep=2, max_bytes=10**9)
    assert sorted(k for k, _ in removed) == ["k0", "k3"]
    assert [k for k, *_ in store.files()] == ["k1", "k2"]
    assert (tmp_path / "manual.bin").exists() and (tmp_path / "auto-notes.txt").exists()
    assert not (tmp_path / "auto-k0.json").exists(), "sidecars go with their files"


def test_prune_by_size(tmp_path):
    store = SessionStore(tmp_path)
    make_file(store, "new", 600, 1)
    make_file(store, "mid", 600, 2)
    make_file(store, "old", 300, 3)
    removed = store.prune(keep=10, max_bytes=1000)
    assert [k for k, _ in removed] == ["mid"]
    assert store.usage() == (2, 900)


def test_sidecar_round_trip_and_unreadable(tmp_path):
    store = SessionStore(tmp_path)
    car = Sidecar(key="a", fingerprint={"n_ctx": 1}, tokens=5, bytes=9, created=1.0, last_used=2.0, digest="d")
    store.write_sidecar(car)
    assert store.sidecar("a") == car
    assert oct(store.sidecar_path("a").stat().st_mode & 0o777) == "0o600"
    store.sidecar_path("a").write_text("{broken")
    assert store.sidecar("a") is None


def _every_small_write(directory):
    """Each small file auto-sessions rewrites in a slot directory, as a call that writes it."""
    from strata_auto_sessions.blocks import BlockStore
    from strata_auto_sessions.blocks.objects import encode
    from strata_auto_sessions.shared.blocks import _write_checked
    from strata_auto_sessions.shared.ledger import Ledger
    from strata_serve import LlamaServer, StateBlock

    store = SessionStore(directory)
    make_file(store, "a", 10, 0)
    blocks = BlockStore(directory / "blocks", LlamaServer.state_format, fingerprint={"model": "m"},
                        block_tokens=8)
    ledger = Ledger(directory / "auto-.shared.json")
    fetched = encode(StateBlock(tuple(range(8)), b"\1" * 64 * 1024, 8))  # more than a page
    return {
        "sidecar": lambda: store.touch("a"),
        "ledger": lambda: ledger.write(1, '{"auto-a.bin": {"generation": 1}}'),
        "block generation": lambda: blocks.objects_changed(),
        "fetched block": lambda: _write_checked(directory / "tmp-auto-a-00000000.x.blk", fetched, "x" * 64),
    }


@pytest.mark.parametrize("write", ["sidecar", "ledger", "block generation", "fetched block"])
def test_a_small_write_on_a_full_disk_leaves_no_temporary(tmp_path, write):
    """The disk fills up to its last byte (a real tmpfs, a ballast file): each small write
    fails with ENOSPC and leaves the directory as it was (no temporary per failed write:
    a soak with a full disk found fourteen), once space is back too."""
    from tests.test_reliability import tmpfs

    with tmpfs(tmp_path / "full", "256k") as directory:
        call = _every_small_write(directory)[write]
        before = sorted(str(p.relative_to(directory)) for p in directory.rglob("*"))
        ballast = os.open(directory / "ballast", os.O_WRONLY | os.O_CREAT)
        try:
            with pytest.raises(OSError):
                while os.write(ballast, b"\0" * 4096):
                    pass
        finally:
            os.close(ballast)
        with pytest.raises(OSError):
            call()
        (directory / "ballast").unlink()
        assert sorted(str(p.relative_to(directory)) for p in directory.rglob("*")) == before


def test_the_shared_ledger_is_private(tmp_path):
    """The ledger names the conversations parked here: 0600 like every session file, even
    under umask 0."""
    from strata_auto_sessions.shared.ledger import Ledger

    old = os.umask(0)
    try:
        Ledger(tmp_path / "auto-.shared.json").write(1, "{}")
    finally:
        os.umask(old)
    assert oct((tmp_path / "auto-.shared.json").stat().st_mode & 0o777) == "0o600"


def test_fingerprint_tells_models_apart(tmp_path):
    one, two = tmp_path / "one.gguf", tmp_path / "two.gguf"
    one.write_bytes(b"GGUF" + b"\x01" * 100)
    two.write_bytes(b"GGUF" + b"\x02" * 100)
    assert same_model(fingerprint(str(one), 4096), fingerprint(str(one), 4096))
    assert not same_model(fingerprint(str(one), 4096), fingerprint(str(two), 4096))
    moved = tmp_path / "moved.gguf"
    moved.write_bytes(one.read_bytes())
    assert same_model(fingerprint(str(one), 4096), fingerprint(str(moved), 4096))


def test_commit_checks_size_and_intact_detects_damage(tmp_path):
    import pytest

    store = SessionStore(tmp_path)
    data = bytes(range(256)) * 40_000  # 10 MB: sampled, not read whole
    (tmp_path / "tmp-auto-k-1.bin").write_bytes(data)
    car = Sidecar(key="k", fingerprint={}, tokens=3, bytes=len(data), created=0, last_used=0, digest="")
    store.commit("tmp-auto-k-1.bin", "k", car)
    assert store.intact("k", store.sidecar("k"))
    assert oct(store.bin_path("k").stat().st_mode & 0o777) == "0o600"

    damaged = bytearray(data)
    damaged[len(data) // 2 : len(data) // 2 + 100_000] = b"\0" * 100_000
    store.bin_path("k").write_bytes(bytes(damaged))
    assert not store.intact("k", store.sidecar("k"))
    store.bin_path("k").write_bytes(data[:-1])
    assert not store.intact("k", store.sidecar("k"))

    (tmp_path / "tmp-auto-j-1.bin").write_bytes(b"short")
    with pytest.raises(OSError, match="engine reported"):
        store.commit("tmp-auto-j-1.bin", "j", Sidecar(key="j", fingerprint={}, tokens=1, bytes=99,
                                                      created=0, last_used=0, digest=""))
    assert not store.bin_path("j").exists()


def test_symlinks_are_never_listed_or_restorable(tmp_path):
    store = SessionStore(tmp_path / "slots")
    store.prepare()
    outside = tmp_path / "outside.bin"
    outside.write_bytes(b"secret")
    store.bin_path("evil").symlink_to(outside)
    assert store.files() == [] and not store.restorable("evil")
    store.prune(keep=1, max_bytes=1)
    assert outside.read_bytes() == b"secret"


def test_a_continuation_is_recognised_in_every_format():
    from strata_auto_sessions.prompts import continues, prompt_signature

    cases = [
        ("chat", {"messages": [{"role": "user", "content": "a"}]},
         {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]},
         {"messages": [{"role": "user", "content": "edited"}]}),
        ("messages", {"system": "s", "messages": [{"role": "user", "content": "a"}]},
         {"system": "s", "messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "c"}]},
         {"system": "other", "messages": [{"role": "user", "content": "a"}]}),
        ("responses", {"instructions": "i", "input": [{"role": "user", "content": "a"}]},
         {"instructions": "i", "input": [{"role": "user", "content": "a"}, {"role": "user", "content": "c"}]},
         {"instructions": "i", "input": [{"role": "user", "content": "z"}]}),
        ("completion", {"prompt": "Once upon"}, {"prompt": "Once upon a time"}, {"prompt": "Twice"}),
    ]
    for route, saved, continued, changed in cases:
        signature = prompt_signature(StrataRequest(route=route, body=saved))
        assert continues(signature, StrataRequest(route=route, body=continued)), saved
        assert not continues(signature, StrataRequest(route=route, body=changed)), changed


def engine(model, n_ctx=4096, build="b5000-abc", **layout):
    info = EngineInfo(url="x", model_path=str(model), n_ctx=n_ctx, build=build, model_ftype="F16",
                      layout=StateLayout(**layout))
    return engine_fingerprint(info)


def saved(fp, tokens=100, **extra):
    return Sidecar(key="k", fingerprint=fp, tokens=tokens, bytes=1, created=0, last_used=0, digest="", **extra)


@pytest.fixture
def model(tmp_path):
    path = tmp_path / "m.gguf"
    path.write_bytes(b"GGUF" + b"\x01" * 100)
    return path


@pytest.mark.parametrize("now, reason", [
    ({"cache_type_k": "q8_0"}, "cache_type"),
    ({"cache_type_v": "q4_0"}, "cache_type"),
    ({"flash_attn": "on"}, "flash_attn"),
    ({"swa_full": True}, "swa"),
    ({"n_ctx": 99}, "context"),
    ({"build": "b7000-def"}, "build"),
    ({"build": "local-build"}, "build"),
])
def test_a_file_the_engine_cannot_use_is_refused_with_its_reason(model, now, reason):
    then = engine(model)
    refusal = incompatibility(saved(then), engine(model, **now))
    assert refusal is not None and refusal.reason == reason, refusal
    assert incompatibility(saved(then), then) is None


@pytest.mark.parametrize("now", [
    {"n_gpu_layers": "99"},            # moves work, not state
    {"n_ctx": 8192},                   # a larger context holds the same tokens
    {"n_ctx": 100},                    # a smaller one that still holds them
    {"build": "b5900-fff"},            # within build_range
])
def test_a_harmless_difference_is_not_refused(model, now):
    assert incompatibility(saved(engine(model, n_gpu_layers="0")), engine(model, **now)) is None


def test_the_build_range_is_a_setting(model):
    assert incompatibility(saved(engine(model)), engine(model, build="b5900-x"), build_range=10).reason == "build"


def test_an_older_sidecar_is_judged_on_what_it_recorded(tmp_path, model):
    """Files saved before the layout was recorded: restored on an engine started with the
    default layout, refused with a reason otherwise."""
    store = SessionStore(tmp_path)
    old = {"key": "k", "fingerprint": fingerprint(str(model), 4096), "tokens": 100, "bytes": 1,
           "created": 0, "last_used": 0, "digest": "d", "prompt": {"units": 1, "digest": "x"}}
    store.sidecar_path("k").write_text(json.dumps(old))
    car = store.sidecar("k")
    assert car is not None and car.version == 1 and car.tenant is None
    assert incompatibility(car, engine(model)) is None
    refusal = incompatibility(car, engine(model, cache_type_k="q8_0"))
    assert refusal.reason == "unjudged" and "-ctk q8_0" in refusal.detail
    assert incompatibility(car, engine(model, n_ctx=50)).reason == "context"
    assert incompatibility(None, engine(model)).reason == "unjudged"
    assert incompatibility(car, engine(tmp_path / "elsewhere.gguf")).reason == "other_model"


def test_the_layout_comes_from_the_flags_and_the_environment():
    from strata_serve.engine.llama_server import state_layout

    assert state_layout([], {}) == StateLayout()
    assert state_layout(["-ctk", "q8_0", "--cache-type-v=Q4_0", "-fa", "--swa-full", "-ngl", "99"], {}) == \
        StateLayout(cache_type_k="q8_0", cache_type_v="q4_0", flash_attn="on", swa_full=True, n_gpu_layers="99")
    assert state_layout(["--flash-attn", "off"], {"LLAMA_ARG_FLASH_ATTN": "on"}).flash_attn == "off"
    assert state_layout([], {"LLAMA_ARG_CACHE_TYPE_K": "q8_0", "LLAMA_ARG_SWA_FULL": "1"}) == \
        StateLayout(cache_type_k="q8_0", swa_full=True)
    assert state_layout(["-ctk", "q8_0", "-ctk", "f32"], {}).cache_type_k == "f32", "the last flag wins"


def test_a_sidecar_without_the_weights_is_unjudged_not_taken_for_the_same_model(tmp_path):
    """Saved by a version that fingerprinted the header only: nothing says the weights are the same."""
    big = tmp_path / "m.gguf"
    big.write_bytes(b"GGUF" + bytes(range(256)) * 100_000)  # 25 MB: sampled, not read whole
    now = fingerprint(str(big), 4096)
    older = {k: v for k, v in now.items() if k != "weights"}
    assert "weights" in now and incompatibility(saved(older), now).reason == "unjudged"
    assert incompatibility(saved(now), now) is None


def test_the_weights_digest_reads_no_gguf_it_cannot_parse(tmp_path):
    """Counts that no file could hold (a damaged header) end the parse, they never run it."""
    import struct

    from strata_auto_sessions.fingerprint import _tensor_layout, weights_digest

    odd = tmp_path / "odd.gguf"
    header = b"GGUF" + struct.pack("<IQQ", 3, 1, 1) + struct.pack("<Q", 3) + b"key"
    odd.write_bytes(header + struct.pack("<IIQ", 9, 8, 1 << 60) + b"\0" * (20 << 20))
    began = time.monotonic()
    with open(odd, "rb") as handle:
        assert _tensor_layout(handle.fileno(), odd.stat().st_size) is None
    assert weights_digest(str(odd)) is not None and time.monotonic() - began < 5


# -- sidecars of every odd shape --------------------------------------------------

def good_sidecar(key="k") -> dict:
    return {"key": key, "fingerprint": {"model": "m", "n_ctx": 4096, "header_sha256": "h", "size": 1,
                                        "layout": {"cache_type_k": "f16", "swa_full": False}},
            "tokens": 10, "bytes": 5, "created": 1.0, "last_used": 2.0, "digest": "d",
            "prompt": {"units": 1, "digest": "x", "chain": ["ab"], "sizes": [3]}, "tenant": None, "version": 2}


ODD_SIDECARS = {
    "last_used a string": lambda d: d.update(last_used="1"),
    "tokens a string": lambda d: d.update(tokens="10"),
    "tokens a boolean": lambda d: d.update(tokens=True),
    "tokens null": lambda d: d.update(tokens=None),
    "tokens huge": lambda d: d.update(tokens=10**30),
    "tokens negative": lambda d: d.update(tokens=-1),
    "created NaN": lambda d: d.update(created=float("nan")),
    "created huge": lambda d: d.update(created=1e300),
    "key a number": lambda d: d.update(key=1),
    "digest missing": lambda d: d.pop("digest"),
    "fingerprint a list": lambda d: d.update(fingerprint=[]),
    "layout a string": lambda d: d["fingerprint"].update(layout="f16"),
    "build a number": lambda d: d["fingerprint"].update(build=5000),
    "swa_full a string": lambda d: d["fingerprint"]["layout"].update(swa_full="no"),
    "prompt a string": lambda d: d.update(prompt="x"),
    "chain of numbers": lambda d: d["prompt"].update(chain=[1, 2]),
    "tenant a list": lambda d: d.update(tenant=["alice"]),
}


@pytest.mark.parametrize("damage", list(ODD_SIDECARS))
def test_a_sidecar_with_a_field_of_another_type_is_refused_and_the_others_still_work(tmp_path, damage):
    store = SessionStore(tmp_path)
    make_file(store, "good", 10, 5)
    store.bin_path("odd").write_bytes(b"x" * 10)
    data = good_sidecar("odd")
    ODD_SIDECARS[damage](data)
    store.sidecar_path("odd").write_text(json.dumps(data))  # NaN written as NaN, as Python would
    assert store.sidecar("odd") is None
    assert [key for key, *_ in store.files()] == ["good"] and [k for k, _ in store.sessions()] == ["good"]
    assert store.prune(keep=1, max_bytes=10**9) == [] and store.bin_path("odd").exists(), "never removed"
    assert store.usage() == (1, 10)
    assert store.sidecar_problem("odd") and store.sidecar_problem("good") is None
    assert [(key, why) for key, _path, why in store.damaged()] == [("odd", store.sidecar_problem("odd"))]


@pytest.mark.parametrize("text", ["[1, 2]", "null", "7", '"a string"', "{", "NaN", '{"key": "odd", "tokens": NaN}',
                                  "[" * 100_000, "\xff\xfe"],
                         ids=["list", "null", "number", "string", "cut", "NaN", "NaN-field", "deep", "not-utf8"])
def test_a_sidecar_that_is_not_a_json_object_is_refused(tmp_path, text):
    store = SessionStore(tmp_path)
    store.bin_path("odd").write_bytes(b"x")
    store.sidecar_path("odd").write_bytes(text.encode("latin-1"))
    assert store.sidecar("odd") is None and store.sidecar_problem("odd")
    assert store.files() == [] and [key for key, *_ in store.damaged()] == ["odd"]


def test_a_good_sidecar_still_reads_with_every_field(tmp_path):
    store = SessionStore(tmp_path)
    store.sidecar_path("k").write_text(json.dumps(good_sidecar()))
    car = store.sidecar("k")
    assert car is not None and car.tokens == 10 and car.prompt["chain"] == ["ab"] and car.version == 2
    data = good_sidecar()
    data["fingerprint"]["added_later"] = {"any": "thing"}  # a newer version may record more
    store.sidecar_path("k").write_text(json.dumps(data))
    assert store.sidecar("k") is not None


# -- times stamped ahead of the clock -----------------------------------------------

YEAR = 365 * 86400


def test_files_stamped_ahead_of_the_clock_are_the_first_pruned(tmp_path):
    """A run with its clock a year ahead left two files; with keep = 3 they would have pushed
    out the working set, and never been pruned."""
    store = SessionStore(tmp_path)
    for n, age in enumerate([30, 20, 10]):
        make_file(store, f"work{n}", 100, age)
    make_file(store, "ahead0", 100, -YEAR)
    make_file(store, "ahead1", 100, -YEAR - 60)
    make_file(store, "skewed", 100, -60)  # a clock corrected by a minute since: taken as now
    assert [key for key, *_ in store.files()][:1] == ["skewed"]
    removed = store.prune(keep=3, max_bytes=10**9)
    assert sorted(key for key, _ in removed) == ["ahead0", "ahead1", "work0"]
    assert sorted(key for key, *_ in store.files()) == ["skewed", "work1", "work2"]
    assert all(used <= time.time() for *_, used in store.files())


def test_a_file_stamped_ahead_is_current_again_once_used(tmp_path):
    store = SessionStore(tmp_path)
    make_file(store, "old", 100, 100)
    make_file(store, "ahead", 100, -YEAR)
    assert [key for key, *_ in store.files()] == ["old", "ahead"]
    store.touch("ahead")  # a restore touches it: its sidecar says now
    assert [key for key, *_ in store.files()] == ["ahead", "old"]


def test_sessions_ls_shows_no_age_for_a_file_stamped_ahead(tmp_path):
    from click.testing import CliRunner

    from strata_serve.cli import cli

    store = SessionStore(tmp_path)
    make_file(store, "ahead", 100, -YEAR)
    make_file(store, "now", 100, 5)
    result = CliRunner().invoke(cli, ["sessions", "--slot-dir", str(tmp_path), "ls", "--json"])
    assert result.exit_code == 0, result.output
    rows = {row["key"]: row for row in map(json.loads, result.output.splitlines())}
    assert rows["ahead"]["last_used_s"] is None and rows["ahead"]["age_s"] is None and rows["ahead"]["stamped_ahead"]
    assert 4 < rows["now"]["last_used_s"] < 60 and not rows["now"]["stamped_ahead"]
    table = CliRunner().invoke(cli, ["sessions", "--slot-dir", str(tmp_path), "ls"]).output
    (line,) = [line for line in table.splitlines() if line.startswith("ahead")]
    assert "stamped ahead of the clock" in line and " s ago" not in line, line


def make_sibling(store, key, sibling, size, age):
    path = store.bin_path(key, sibling)
    path.write_bytes(b"x" * size)
    then = time.time() - age
    os.utime(path, (then, then))
    store.write_sidecar(Sidecar(key=key, fingerprint={}, tokens=1, bytes=size, created=then, last_used=then,
                                digest="", sibling=sibling))


def test_siblings_have_files_of_their_own_and_prune_across_keys_file_by_file(tmp_path):
    store = SessionStore(tmp_path)
    for sibling, age in ((0, 40), (1, 10), (2, 30)):
        make_sibling(store, "k", sibling, 100, age)
    make_sibling(store, "other", 0, 100, 20)
    assert sorted(p.name for p in tmp_path.glob("auto-k*.bin")) == ["auto-k.1.bin", "auto-k.2.bin", "auto-k.bin"]
    assert [s.sibling for s in store.siblings("k")] == [1, 2, 0], "newest first"
    assert [(k, s.sibling) for k, s in store.sessions()] == [("k", 1), ("other", 0), ("k", 2), ("k", 0)]
    # A sidecar under a sibling's name that names another sibling is not that file's.
    (tmp_path / "auto-k.2.json").write_text((tmp_path / "auto-k.1.json").read_text())
    assert store.sidecar_problem("k", 2) == "it names another sibling (1)"
    assert [s.sibling for s in store.siblings("k")] == [1, 0]
    make_sibling(store, "k", 2, 100, 30)
    assert store.prune(keep=2, max_bytes=10**9) == [("k", 100), ("k", 100)]
    assert sorted(p.name for p in tmp_path.glob("auto-*.bin")) == ["auto-k.1.bin", "auto-other.bin"]
    assert not (tmp_path / "auto-k.2.json").exists() and not (tmp_path / "auto-k.json").exists()
    # protect spares every sibling of a key.
    make_sibling(store, "k", 0, 100, 50)
    assert store.prune(keep=1, max_bytes=10**9, protect=frozenset({"k"})) == [("other", 100)]


def test_prune_siblings_keeps_the_most_recently_used_and_those_spared(tmp_path):
    store = SessionStore(tmp_path)
    for sibling, age in ((0, 40), (1, 10), (2, 30), (3, 20)):
        make_sibling(store, "k", sibling, 100, age)
    make_sibling(store, "other", 0, 100, 60)
    assert sorted(store.prune_siblings("k", 2, spare=frozenset({0}))) == [(2, 100), (3, 100)]
    assert sorted(s.sibling for s in store.siblings("k")) == [0, 1]
    assert store.bin_path("other").exists(), "another key's file is not its sibling"
    store.remove("k")
    assert not list(tmp_path.glob("auto-k*")), "remove(key) takes every sibling"


def test_a_background_commit_replaces_without_freeing_and_its_sync_frees_the_old_file(tmp_path, monkeypatch):
    """With ``sync_later`` (``fsync = "background"``) a commit over an earlier file moves
    that file to a temporary's name, so the new file's rename frees nothing and takes a
    free name (a rename over a file makes ext4 write the new data out on the request's
    path); :meth:`SessionStore.sync_written` removes the old one after syncing, and a start
    removes one a crash left."""
    store = SessionStore(tmp_path)
    store.prepare()
    store.sync_later = True
    over_a_file = []
    real_replace = os.replace

    def replace(source, target):
        if str(target).endswith(".bin"):
            over_a_file.append(os.path.lexists(target))
        real_replace(source, target)

    monkeypatch.setattr(os, "replace", replace)

    def commit(data: bytes) -> None:
        (tmp_path / "tmp-auto-k-1.bin").write_bytes(data)
        store.commit("tmp-auto-k-1.bin", "k", Sidecar(key="k", fingerprint={}, tokens=3, bytes=len(data),
                                                      created=0, last_used=0, digest=""))

    commit(b"old" * 1000)
    assert not list(tmp_path.glob("tmp-auto-*"))  # nothing replaced: nothing retired
    commit(b"new" * 2000)
    assert store.bin_path("k").read_bytes() == b"new" * 2000 and store.intact("k", store.sidecar("k"))
    retired = list(tmp_path.glob("tmp-auto-*.bin"))
    assert [p.read_bytes() for p in retired] == [b"old" * 1000], retired
    assert store.unsynced == 5  # the file and its sidecar, twice, and the old file
    assert over_a_file == [False, False], "each new file's rename took a free name"
    assert store.sync_written() == 2 and store.unsynced == 0
    assert not list(tmp_path.glob("tmp-auto-*")) and store.bin_path("k").read_bytes() == b"new" * 2000

    commit(b"newer" * 100)
    assert list(tmp_path.glob("tmp-auto-*.bin"))  # a crash now leaves it...
    store.release()
    again = SessionStore(tmp_path)
    again.prepare()  # ...and the next start removes it
    assert not list(tmp_path.glob("tmp-auto-*")) and again.intact("k", again.sidecar("k"))


def test_digests_of_either_scheme_check_the_file_and_new_ones_are_crc32(tmp_path):
    """New sidecars carry ``crc32:...`` (the check on a restore's path reads 4 MiB at
    several GB/s); a sidecar an earlier version wrote (BLAKE2b, no scheme named) still
    checks its file, and damage fails both; an unknown scheme is never taken for a match."""
    from strata_auto_sessions.digests import FIRST_SCHEME, digest_matches, sample_digest

    for size in (300_000, 10_000_000):  # read whole; sampled
        path = tmp_path / f"state-{size}.bin"
        data = bytes(range(256)) * (size // 256)
        path.write_bytes(data)
        new, old = sample_digest(path), sample_digest(path, FIRST_SCHEME)
        assert new.startswith("crc32:") and len(new) == len("crc32:") + 8 and ":" not in old
        assert digest_matches(path, new) and digest_matches(path, old)
        assert not digest_matches(path, "sha9:" + old) and not digest_matches(path, "")
        damaged = bytearray(data)
        damaged[size // 2: size // 2 + 100_000] = b"\0" * 100_000
        path.write_bytes(bytes(damaged))
        assert not digest_matches(path, new) and not digest_matches(path, old)


def test_a_file_digested_since_it_changed_is_not_read_again_and_any_change_is_seen(tmp_path, monkeypatch):
    """A restore right after the save does not read the file again for its digest; a file
    changed since (in place with its times set back, or replaced by a rename) is read and
    refused. The same for sidecars: one rewritten by another process is read anew."""
    import strata_auto_sessions.store as store_module

    store = SessionStore(tmp_path)
    data = bytes(range(256)) * 4_000
    (tmp_path / "tmp-auto-k-1.bin").write_bytes(data)
    store.commit("tmp-auto-k-1.bin", "k", Sidecar(key="k", fingerprint={}, tokens=3, bytes=len(data),
                                                  created=0, last_used=0, digest=""))
    reads = []
    real = store_module.digest_matches
    monkeypatch.setattr(store_module, "digest_matches", lambda path, digest: reads.append(path) or real(path, digest))
    assert store.intact("k", store.sidecar("k")) and store.intact("k", store.sidecar("k"))
    assert reads == [], "the digest the commit computed stands for the file it put in place"

    path = store.bin_path("k")
    before = path.stat()
    with open(path, "r+b") as handle:  # same size, one byte changed, the times set back
        handle.seek(len(data) // 3)
        handle.write(b"\xff")
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert not store.intact("k", store.sidecar("k")) and reads == [path]
    (tmp_path / "other.bin").write_bytes(data)
    os.replace(tmp_path / "other.bin", path)  # the saved bytes again, under another inode: read, then known
    assert store.intact("k", store.sidecar("k")) and store.intact("k", store.sidecar("k")) and len(reads) == 2

    sidecar_path = store.sidecar_path("k")
    stamp = sidecar_path.stat()
    text = sidecar_path.read_text()
    sidecar_path.write_text(text.replace('"tokens": 3', '"tokens": 4'))  # same length: another process's
    os.utime(sidecar_path, ns=(stamp.st_atime_ns, stamp.st_mtime_ns))
    assert store.sidecar("k").tokens == 4
    sidecar_path.write_text(text.replace('"tokens": 3', '"tokens": "3"'))
    assert store.sidecar("k") is None and "'tokens' is a string" in store.sidecar_problem("k")
    mine = store.sidecar
    got = SessionStore(tmp_path).sidecar  # a caller may change what it is given: never the memory
    sidecar_path.write_text(text)
    first = mine("k")
    first.tokens = 99
    assert mine("k").tokens == 3 and got("k").tokens == 3


def test_the_held_record_is_renamed_onto_a_free_name_and_read_through_its_replacement(tmp_path, monkeypatch):
    """Written at every switch, the record of the conversations the server holds never
    replaces a file by its rename (ext4 would write it out on the switch's path); ``rm``,
    reading it while it is being replaced, finds it on a next try rather than nothing."""
    import pathlib

    store = SessionStore(tmp_path)
    store.prepare()
    renamed_over = []
    real_replace = os.replace

    def replace(source, target):
        renamed_over.append((os.path.basename(target), os.path.lexists(target)))
        real_replace(source, target)

    monkeypatch.setattr(os, "replace", replace)
    store.record_held(["a"])
    store.record_held(["a", "b"])
    assert renamed_over == [("auto-.held.json", False)] * 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["auto-.held.json", "auto-.server.json"]

    missing = iter([True, True])
    real_read = pathlib.Path.read_text

    def read_text(path, *args, **kwargs):
        if path.name == "auto-.held.json" and next(missing, False):
            raise FileNotFoundError(path)  # between the two renames
        return real_read(path, *args, **kwargs)

    monkeypatch.setattr(pathlib.Path, "read_text", read_text)
    assert store.held_by_server() == ["a", "b"]


def test_a_background_commit_whose_rename_fails_leaves_the_earlier_file_under_its_name(tmp_path, monkeypatch):
    """The earlier file is moved away before the new one's rename; when that rename fails,
    the earlier file goes back under its name rather than leaving none."""
    store = SessionStore(tmp_path)
    store.prepare()
    store.sync_later = True
    (tmp_path / "tmp-auto-k-1.bin").write_bytes(b"old" * 1000)
    store.commit("tmp-auto-k-1.bin", "k", Sidecar(key="k", fingerprint={}, tokens=3, bytes=3000,
                                                  created=0, last_used=0, digest=""))
    real_replace = os.replace

    def failing(source, target):
        if str(target).endswith("auto-k.bin"):
            raise OSError(5, "Input/output error")
        real_replace(source, target)

    monkeypatch.setattr(os, "replace", failing)
    (tmp_path / "tmp-auto-k-2.bin").write_bytes(b"new" * 2000)
    with pytest.raises(OSError, match="Input/output"):
        store.commit("tmp-auto-k-2.bin", "k", Sidecar(key="k", fingerprint={}, tokens=3, bytes=6000,
                                                      created=0, last_used=0, digest=""))
    assert store.bin_path("k").read_bytes() == b"old" * 1000


@pytest.mark.parametrize("blocks", [True, False], ids=["blocks", "whole-file"])
def test_a_prune_beside_a_commit_in_a_thread_leaves_the_conversation_being_put_in_place(tmp_path, monkeypatch,
                                                                                        blocks):
    """A commit runs in a thread (the event loop's task holding the directory's lock for
    it) and writes its parts one after the other: in blocks the manifest, then the
    sidecar; a whole file its sidecar, then the file under its name. A prune in between
    (another slot's save finished meanwhile) must not take the part already there for what
    a crash left (a manifest without a sidecar, a sidecar without its file): the
    conversation would be lost. Here the commit is held at that point until a prune ran."""
    import threading

    from strata_auto_sessions.parked_blocks import ParkedBlocks
    from strata_serve import LlamaServer
    from tests.state_files import state_file

    store = SessionStore(tmp_path)
    if blocks:
        store.blocks = ParkedBlocks.open(tmp_path, LlamaServer.state_format, fingerprint={"model": "m"},
                                         block_tokens=8, fsync=False)
    data = state_file(list(range(300, 337)))  # 4 blocks of 8 and a tail
    (tmp_path / "tmp-auto-a.bin").write_bytes(data)
    car = Sidecar(key="a", fingerprint={"model": "m"}, tokens=37, bytes=len(data), created=1.0, last_used=2.0,
                  digest="")
    entered, release, done = threading.Event(), threading.Event(), []
    real_write = Sidecar.write

    def held_write(self, path, **kwargs):
        if not blocks:
            real_write(self, path, **kwargs)  # a whole file: held with its sidecar written, the file not yet
        entered.set()
        release.wait(10)
        if blocks:
            real_write(self, path, **kwargs)  # in blocks: held with the manifest written, the sidecar not yet

    monkeypatch.setattr(Sidecar, "write", held_write)
    committing = threading.Thread(target=lambda: done.append(store.commit("tmp-auto-a.bin", "a", car)))
    with store.lock():  # as the saving step holds it on the event loop while its thread commits
        committing.start()
        assert entered.wait(10), "the commit reached its sidecar"
        store.prune(keep=10, max_bytes=1 << 40)
        release.set()
        committing.join(10)
    assert done == [True]
    assert store.sidecar("a") is not None, "its sidecar is there"
    if blocks:
        assert store.blocks.intact("a", 0, 37), "its manifest and blocks are there"
    else:
        assert store.bin_path("a").read_bytes() == data
    assert [key for key, _ in store.sessions()] == ["a"]
