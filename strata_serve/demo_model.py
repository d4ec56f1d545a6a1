"""Write a tiny random-weight GGUF model for tests and demos.

The weights are random: the text this model produces is meaningless. It
exists so that tests and demos can start and exercise the real llama.cpp
engine (loading, chat templating, sampling, slot save/restore, timings)
without downloading gigabytes of weights. Real use takes a real model.

The model is a llama-architecture transformer in float16 with a small
SentencePiece-style ("llama") vocabulary: a few control tokens, 256 byte
fallback tokens and the printable ASCII characters, so text tokenizes to
one token per character. The chat template is standard ChatML and
``<|im_end|>`` is the end-of-sequence token, as in a real chat model. The
output layer is shaped so that greedy (temperature 0) replies are printable
ASCII and never end early: they always run to ``max_tokens``.

With ``sliding_window`` it is a Gemma-2-architecture model instead, whose
every other layer attends to that many last tokens only (sliding-window
attention, SWA), with the same vocabulary and template.
"""

from __future__ import annotations

import os
import pathlib
from dataclasses import dataclass

import gguf
import numpy as np

__all__ = ["CHAT_TEMPLATE", "SIZES", "ModelShape", "write_demo_model"]


@dataclass(frozen=True)
class ModelShape:
    """Hyperparameters of a demo model."""

    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    n_ff: int
    n_ctx: int
    #: Standard deviation of the random weights. Small keeps activations far from
    #: float16 overflow, but makes attention near-uniform: the answer then hardly
    #: depends on the context, so a wrong KV state would go unnoticed.
    weight_scale: float = 0.02


SIZES: dict[str, ModelShape] = {
    # Loads in well under a second; for unit and integration tests.
    "tiny": ModelShape(n_embd=64, n_layer=2, n_head=4, n_head_kv=4, n_ff=128, n_ctx=4096),
    # Big enough that prompt processing takes measurable time, for benchmarks.
    "bench": ModelShape(n_embd=512, n_layer=8, n_head=16, n_head_kv=16, n_ff=1024, n_ctx=16384),
    # For quantizing with llama-quantize: rows a multiple of 256 (the k-quant block; the
    # Q4/Q8 blocks are 32), and weights large enough that attention is sharp, so the
    # answer depends on the context held in the KV state.
    "quant": ModelShape(n_embd=256, n_layer=2, n_head=4, n_head_kv=4, n_ff=512, n_ctx=4096, weight_scale=0.1),
}

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    r"{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}"
    r"{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
#: Fill-in-the-middle markers (``fim=True``), for the engine's ``/infill``.
_FIM_TOKENS = {"pre": "<|fim_prefix|>", "suf": "<|fim_suffix|>", "mid": "<|fim_middle|>"}


def _vocab(fim: bool = False) -> tuple[list[str], list[int]]:
    """Return the token strings and their gguf.TokenType values."""
    tokens = list(_SPECIAL_TOKENS)
    # A real SentencePiece vocab marks <unk> UNKNOWN rather than CONTROL:
    # llama.cpp renders an UNKNOWN token as a visible placeholder, where a
    # CONTROL token would silently vanish from the output.
    types = [gguf.TokenType.UNKNOWN] + [gguf.TokenType.CONTROL] * (len(_SPECIAL_TOKENS) - 1)
    # llama.cpp's SPM tokenizer falls back to these exact "<0xXX>" spellings
    # for any character that is not in the vocabulary (e.g. "\n", non-ASCII).
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [gguf.TokenType.BYTE] * 256
    # SentencePiece spells a space as U+2581, so a literal " " would be
    # unreachable; "▁" takes its place.
    tokens += [chr(c) for c in range(0x21, 0x7F)] + ["\u2581"]
    types += [gguf.TokenType.NORMAL] * (0x7F - 0x21 + 1)
    if fim:  # appended, so every other token keeps its id
        tokens += list(_FIM_TOKENS.values())
        types += [gguf.TokenType.CONTROL] * len(_FIM_TOKENS)
    return tokens, [int(t) for t in types]


def _tensor_name(tensor: gguf.MODEL_TENSOR, bid: int | None = None) -> str:
    return gguf.TENSOR_NAMES[tensor].format(bid=bid) + ".weight"


def write_demo_model(
    path: str | os.PathLike[str], size: str = "tiny", seed: int = 0, *, fim: bool = False,
    sliding_window: int | None = None,
) -> pathlib.Path:
    """Write a random-weight llama GGUF model to ``path`` and return its path.

    ``fim`` adds fill-in-the-middle tokens, so the engine serves ``/infill`` with it.
    ``sliding_window`` makes it a Gemma-2 model whose sliding layers see that many tokens.

    The output is byte-for-byte deterministic for a given ``size`` and
    ``seed``. The file appears atomically: a reader never sees a partial model.
    """
    try:
        shape = SIZES[size]
    except KeyError:
        raise ValueError(
            f"unknown demo model size {size!r}; expected one of {sorted(SIZES)}"
        ) from None

    out = pathlib.Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")

    tokens, token_types = _vocab(fim)
    swa = sliding_window is not None
    arch = gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.GEMMA2 if swa else gguf.MODEL_ARCH.LLAMA]
    writer = gguf.GGUFWriter(tmp, arch)
    writer.add_name(f"strata-serve demo ({size}, random weights)")
    _add_metadata(writer, shape, tokens, token_types, fim=fim, sliding_window=sliding_window)
    _add_tensors(writer, shape, token_types, np.random.default_rng(seed), n_vocab=len(tokens), swa=swa)

    try:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        os.replace(tmp, out)
    except BaseException:
        writer.close()  # idempotent; the file must be closed before unlinking
        tmp.unlink(missing_ok=True)
        raise
    return out


def _add_metadata(writer: gguf.GGUFWriter, shape: ModelShape, tokens: list[str], token_types: list[int], *,
                  fim: bool, sliding_window: int | None) -> None:
    """The model's shape, its tokenizer and its chat template."""
    head_dim = shape.n_embd // shape.n_head
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    writer.add_vocab_size(len(tokens))
    writer.add_context_length(shape.n_ctx)
    writer.add_embedding_length(shape.n_embd)
    writer.add_block_count(shape.n_layer)
    writer.add_feed_forward_length(shape.n_ff)
    writer.add_head_count(shape.n_head)
    writer.add_head_count_kv(shape.n_head_kv)
    if sliding_window is not None:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
        writer.add_sliding_window(sliding_window)
    else:
        writer.add_rope_dimension_count(head_dim)
    writer.add_layer_norm_rms_eps(1e-5)

    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_types(token_types)
    # Every piece is a single character, so there is nothing for the
    # SentencePiece merge scores to rank.
    writer.add_token_scores([0.0] * len(tokens))
    writer.add_unk_token_id(tokens.index("<unk>"))
    writer.add_bos_token_id(tokens.index("<s>"))
    # ChatML turns end with <|im_end|>, so it (not </s>) is what must stop
    # generation at the end of a chat reply.
    writer.add_eos_token_id(tokens.index("<|im_end|>"))
    # The ChatML prompt carries its own markers, and without an implicit
    # leading space the token count of a prompt is exactly predictable.
    writer.add_add_bos_token(False)
    writer.add_add_eos_token(False)
    writer.add_add_space_prefix(False)
    writer.add_chat_template(CHAT_TEMPLATE)
    if fim:
        for kind, token in _FIM_TOKENS.items():
            writer.add_uint32(getattr(gguf.Keys.Tokenizer, f"FIM_{kind.upper()}_ID"), tokens.index(token))


def _add_tensors(writer: gguf.GGUFWriter, shape: ModelShape, token_types: list[int], rng: np.random.Generator, *,
                 n_vocab: int, swa: bool) -> None:
    """Random weights, drawn from ``rng`` in one fixed order (the file is deterministic)."""
    head_dim = shape.n_embd // shape.n_head

    def weight(*dims: int) -> np.ndarray:
        # numpy shapes are the reverse of ggml's: (rows=out, cols=in).
        return (rng.standard_normal(dims, dtype=np.float32) * shape.weight_scale).astype(np.float16)

    def norm() -> np.ndarray:
        return np.ones(shape.n_embd, dtype=np.float32)

    q_dim = shape.n_head * head_dim
    kv_dim = shape.n_head_kv * head_dim
    T = gguf.MODEL_TENSOR
    embedding = weight(n_vocab, shape.n_embd)
    # Random logits would mostly pick byte tokens (256 of the ~350), which
    # decode to control characters and invalid UTF-8. Zero rows pin every
    # non-NORMAL token's logit at 0, below the best of ~95 random printable
    # ones, so greedy decoding emits only printable text and never <|im_end|>.
    printable_only = np.array(token_types) != gguf.TokenType.NORMAL
    if swa:  # Gemma 2's output layer is its embedding
        embedding[printable_only] = 0
    writer.add_tensor(_tensor_name(T.TOKEN_EMBD), embedding)
    for bid in range(shape.n_layer):
        writer.add_tensor(_tensor_name(T.ATTN_NORM, bid), norm())
        writer.add_tensor(_tensor_name(T.ATTN_Q, bid), weight(q_dim, shape.n_embd))
        writer.add_tensor(_tensor_name(T.ATTN_K, bid), weight(kv_dim, shape.n_embd))
        writer.add_tensor(_tensor_name(T.ATTN_V, bid), weight(kv_dim, shape.n_embd))
        writer.add_tensor(_tensor_name(T.ATTN_OUT, bid), weight(shape.n_embd, q_dim))
        writer.add_tensor(_tensor_name(T.FFN_NORM, bid), norm())
        writer.add_tensor(_tensor_name(T.FFN_GATE, bid), weight(shape.n_ff, shape.n_embd))
        writer.add_tensor(_tensor_name(T.FFN_UP, bid), weight(shape.n_ff, shape.n_embd))
        writer.add_tensor(_tensor_name(T.FFN_DOWN, bid), weight(shape.n_embd, shape.n_ff))
        if swa:
            writer.add_tensor(_tensor_name(T.ATTN_POST_NORM, bid), norm())
            writer.add_tensor(_tensor_name(T.FFN_POST_NORM, bid), norm())
    writer.add_tensor(_tensor_name(T.OUTPUT_NORM), norm())
    if not swa:
        output = weight(n_vocab, shape.n_embd)
        output[printable_only] = 0
        writer.add_tensor(_tensor_name(T.OUTPUT), output)
