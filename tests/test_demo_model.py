"""Tests for strata_serve.demo_model: read the written GGUF back and check it."""

from __future__ import annotations

import pathlib
from typing import Any

import gguf
import numpy as np
import pytest

from strata_serve.demo_model import SIZES, write_demo_model

# Written out here rather than imported so the test pins the standard ChatML text.
CHATML = (
    "{% for message in messages %}"
    "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return write_demo_model(tmp_path_factory.mktemp("model") / "tiny.gguf")


@pytest.fixture(scope="module")
def tiny(tiny_path: pathlib.Path) -> gguf.GGUFReader:
    return gguf.GGUFReader(tiny_path)


def field(reader: gguf.GGUFReader, key: str) -> Any:
    f = reader.get_field(key)
    assert f is not None, f"missing GGUF key {key}"
    return f.contents()


def test_returns_path_and_leaves_no_temp_file(tmp_path: pathlib.Path) -> None:
    target = tmp_path / "nested" / "dir" / "m.gguf"
    result = write_demo_model(str(target))
    assert result == target
    assert target.is_file()
    assert sorted(p.name for p in target.parent.iterdir()) == ["m.gguf"]


def test_architecture_is_llama(tiny: gguf.GGUFReader) -> None:
    assert field(tiny, "general.architecture") == "llama"
    assert field(tiny, "general.file_type") == gguf.LlamaFileType.MOSTLY_F16


def test_hparams_match_tiny_shape(tiny: gguf.GGUFReader) -> None:
    shape = SIZES["tiny"]
    assert field(tiny, "llama.context_length") == 4096
    assert field(tiny, "llama.embedding_length") == shape.n_embd == 64
    assert field(tiny, "llama.block_count") == shape.n_layer == 2
    assert field(tiny, "llama.feed_forward_length") == shape.n_ff
    assert field(tiny, "llama.attention.head_count") == shape.n_head == 4
    assert field(tiny, "llama.attention.head_count_kv") == shape.n_head_kv == 4
    assert field(tiny, "llama.rope.dimension_count") == shape.n_embd // shape.n_head
    assert field(tiny, "llama.attention.layer_norm_rms_epsilon") == pytest.approx(1e-5)


def test_chat_template_is_chatml(tiny: gguf.GGUFReader) -> None:
    assert field(tiny, "tokenizer.chat_template") == CHATML


def test_vocab_has_control_and_byte_tokens(tiny: gguf.GGUFReader) -> None:
    tokens = field(tiny, "tokenizer.ggml.tokens")
    types = field(tiny, "tokenizer.ggml.token_type")
    assert isinstance(tokens, list) and isinstance(types, list)
    assert len(tokens) == len(types) == len(field(tiny, "tokenizer.ggml.scores"))
    assert field(tiny, "tokenizer.ggml.model") == "llama"
    assert field(tiny, "llama.vocab_size") == len(tokens)
    assert len(set(tokens)) == len(tokens), "duplicate token strings"

    type_of = dict(zip(tokens, types, strict=True))
    for name in ["<s>", "</s>", "<|im_start|>", "<|im_end|>"]:
        assert type_of[name] == gguf.TokenType.CONTROL, name
    assert type_of["<unk>"] == gguf.TokenType.UNKNOWN

    byte_tokens = [t for t, ty in zip(tokens, types, strict=True) if ty == gguf.TokenType.BYTE]
    assert byte_tokens == [f"<0x{b:02X}>" for b in range(256)]

    for ch in "abcXYZ019!~{}\u2581":
        assert type_of[ch] == gguf.TokenType.NORMAL, ch

    assert tokens[field(tiny, "tokenizer.ggml.eos_token_id")] == "<|im_end|>"
    assert tokens[field(tiny, "tokenizer.ggml.bos_token_id")] == "<s>"
    assert tokens[field(tiny, "tokenizer.ggml.unknown_token_id")] == "<unk>"


def test_tensors_match_block_count(tiny: gguf.GGUFReader) -> None:
    shape = SIZES["tiny"]
    n_vocab = field(tiny, "llama.vocab_size")
    per_block = [
        "attn_norm",
        "attn_q",
        "attn_k",
        "attn_v",
        "attn_output",
        "ffn_norm",
        "ffn_gate",
        "ffn_up",
        "ffn_down",
    ]
    expected = {"token_embd.weight", "output_norm.weight", "output.weight"} | {
        f"blk.{b}.{n}.weight" for b in range(shape.n_layer) for n in per_block
    }
    tensors = {t.name: t for t in tiny.tensors}
    assert len(tiny.tensors) == 3 + len(per_block) * shape.n_layer
    assert set(tensors) == expected

    # GGUF stores shapes innermost-first: (n_embd, n_vocab) for the embedding.
    assert list(tensors["token_embd.weight"].shape) == [shape.n_embd, n_vocab]
    assert list(tensors["output.weight"].shape) == [shape.n_embd, n_vocab]
    assert list(tensors["blk.0.ffn_down.weight"].shape) == [shape.n_ff, shape.n_embd]
    assert list(tensors["blk.0.ffn_up.weight"].shape) == [shape.n_embd, shape.n_ff]
    for t in tiny.tensors:
        want = (
            gguf.GGMLQuantizationType.F32
            if t.name.endswith("norm.weight")
            else gguf.GGMLQuantizationType.F16
        )
        assert t.tensor_type == want, t.name


def test_weights_are_small_and_finite(tiny: gguf.GGUFReader) -> None:
    for t in tiny.tensors:
        data = np.asarray(t.data, dtype=np.float32)
        assert np.isfinite(data).all(), t.name
        if not t.name.endswith("norm.weight"):
            assert 0.01 < float(data.std()) < 0.04, t.name


def test_only_normal_tokens_can_win_greedy_decoding(tiny: gguf.GGUFReader) -> None:
    types = np.array(field(tiny, "tokenizer.ggml.token_type"))
    (output,) = [t for t in tiny.tensors if t.name == "output.weight"]
    rows = np.asarray(output.data, dtype=np.float32)
    assert rows.shape == (len(types), SIZES["tiny"].n_embd)
    normal = types == gguf.TokenType.NORMAL
    assert not rows[~normal].any()
    assert np.abs(rows[normal]).sum(axis=1).min() > 0


def test_tiny_file_size(tiny_path: pathlib.Path) -> None:
    assert 150_000 <= tiny_path.stat().st_size <= 600_000


def test_same_seed_gives_identical_bytes(tmp_path: pathlib.Path, tiny_path: pathlib.Path) -> None:
    again = write_demo_model(tmp_path / "again.gguf", seed=0)
    other = write_demo_model(tmp_path / "other.gguf", seed=1)
    assert again.read_bytes() == tiny_path.read_bytes()
    assert other.read_bytes() != tiny_path.read_bytes()
    assert other.stat().st_size == tiny_path.stat().st_size


def test_bench_size(tmp_path: pathlib.Path) -> None:
    path = write_demo_model(tmp_path / "bench.gguf", size="bench")
    reader = gguf.GGUFReader(path)
    assert field(reader, "llama.context_length") == 16384
    assert field(reader, "llama.block_count") == SIZES["bench"].n_layer
    assert 30_000_000 < path.stat().st_size < 60_000_000


def test_unknown_size_raises(tmp_path: pathlib.Path) -> None:
    target = tmp_path / "x.gguf"
    with pytest.raises(ValueError, match="huge"):
        write_demo_model(target, size="huge")
    assert not target.exists()
    assert not target.with_name("x.gguf.tmp").exists()
