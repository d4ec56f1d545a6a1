"""SessionStore on its own: names, temporaries, sidecars, pruning."""

import os
import time

import json

import pytest

from strata_auto_sessions.store import (
    SessionStore, Sidecar, engine_fingerprint, fingerprint, incompatibility, same_model,
)
from strata_serve import EngineInfo, StateLayout


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
    (store.directory / "manual.bin").write_bytes(b"mine")
    make_file(store, "kept", 10, 0)
    assert store.prepare() == 2
    assert sorted(p.name for p in store.directory.iterdir()) == [
        "auto-.held.json", "auto-.server.json", "auto-kept.bin", "auto-kept.json", "manual.bin"]


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
    from strata_auto_sessions.parking import continues, prompt_signature

    cases = [
        ({"messages": [{"role": "user", "content": "a"}]},
         {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]},
         {"messages": [{"role": "user", "content": "edited"}]}),
        ({"system": "s", "messages": [{"role": "user", "content": "a"}]},
         {"system": "s", "messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "c"}]},
         {"system": "other", "messages": [{"role": "user", "content": "a"}]}),
        ({"instructions": "i", "input": [{"role": "user", "content": "a"}]},
         {"instructions": "i", "input": [{"role": "user", "content": "a"}, {"role": "user", "content": "c"}]},
         {"instructions": "i", "input": [{"role": "user", "content": "z"}]}),
        ({"prompt": "Once upon"}, {"prompt": "Once upon a time"}, {"prompt": "Twice"}),
    ]
    for saved, continued, changed in cases:
        signature = prompt_signature(saved)
        assert continues(signature, continued), saved
        assert not continues(signature, changed), changed


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
