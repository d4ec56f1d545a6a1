"""llama-server's slot file as a state format: blocks joined back into a file the engine
restores, and the flags under which no state is cut (see ``state_file.py`` for the layout,
read from llama.cpp's source, and the cut)."""

from __future__ import annotations

import array
import functools
import mmap
import os
import struct
import sys
from collections.abc import Mapping, Sequence
from itertools import chain
from pathlib import Path

from strata_serve.engine.llama_server.state_file import (BLOCKS_VERSION, STATE_MAGIC, STATE_VERSION, TOKENS_MARKER,
                                                         TOKENS_VERSION, _Layout, cut_bytes, read_tokens)
from strata_serve.engine.state_blocks import CutState, StateBlock, StateRefusal

__all__ = ["LlamaStateFormat", "join_bytes", "shifting_flag", "write_parts"]

#: Parts written in one call (within every system's IOV_MAX).
_WRITEV_PARTS = 1024


def _cell_records(layout: _Layout, blocks: Sequence[StateBlock], n: int, first: int = 0) -> bytes:
    """The cells' records of a joined cache: positions from ``first`` on, one sequence, the
    block's extras for the cell, seq id 0 (a single-sequence restore discards it)."""
    if not layout.ext:
        records = bytearray(12 * n)
        ints = memoryview(records).cast("i")
        ints[0::3] = array.array("i", range(first, first + n))
        ints[1::3] = array.array("i", [1]) * n
        if sys.byteorder != "little":
            swapped = array.array("i", records)
            swapped.byteswap()
            return swapped.tobytes()
        return bytes(records)
    head, seq_id = struct.Struct("<iI"), struct.pack("<i", 0)
    parts: list[bytes | memoryview] = []
    pos = first
    for block in blocks:
        view = memoryview(block.data)
        for i in range(block.cells):
            parts += (head.pack(pos, 1), view[i * layout.ext:(i + 1) * layout.ext], seq_id)
            pos += 1
    return b"".join(parts)


@functools.lru_cache(maxsize=64)
def _rows_of(size: int, n: int) -> struct.Struct:
    """Splits ``n`` rows of ``size`` bytes in one call."""
    return struct.Struct(f"{size}s" * n)


def _transposed(views: Sequence[memoryview], cells: Sequence[int], offsets: list[int], el: int,
                n_embd: int) -> bytes:
    """One layer's transposed V joined: for each of its ``n_embd`` rows, every block's
    elements of that row in turn. Each block's rows are split in one call and interleaved
    in one join, without a Python step per row."""
    rows = []
    for b, view in enumerate(views):
        size = cells[b] * el
        if size:
            rows.append(_rows_of(size, n_embd).unpack(view[offsets[b]:offsets[b] + size * n_embd]))
            offsets[b] += size * n_embd
    return b"".join(list(chain.from_iterable(zip(*rows, strict=True))))


def join_bytes(layout_record: bytes, blocks: Sequence[StateBlock], *, n_stream: int = 1,
               window: StateBlock | None = None) -> list[bytes | memoryview]:
    """The parts of the file ``blocks`` make, in order (written out by :meth:`LlamaStateFormat.join`):
    a few headers, each block's K and V rows as views of its data, each transposed layer
    of V in one piece; then, for a sliding-window model, its ``window`` cache, which must
    end where the blocks end (it was cut at that end)."""
    layout = _Layout.from_record(layout_record)
    if not 1 <= n_stream <= 256:
        raise ValueError(f"n_stream {n_stream}")
    _check_fit(layout, blocks)
    tokens = [t for block in blocks for t in block.tokens]
    n = sum(block.cells for block in blocks)
    if n == 0:
        raise ValueError("no cells to join")
    if (layout.window is None) != (window is None):
        raise ValueError("a sliding-window state joins with its window, and only it" if window is None
                         else "a window given for a state without one")
    packed = [TOKENS_MARKER, TOKENS_VERSION, len(tokens), *tokens, 0]
    out: list[bytes | memoryview] = [
        struct.pack("<III", STATE_MAGIC, STATE_VERSION, len(packed)),
        struct.pack(f"<{len(packed)}i", *packed),
        *_cache_parts(layout, blocks, n_stream),
    ]
    if window is not None and layout.window is not None:
        if window.cells > n or tuple(tokens[n - window.cells:n]) != tuple(window.tokens):
            raise ValueError(f"a window of {window.cells} cells cut at another end than these blocks' ({n} cells)")
        _check_fit(layout.window, [window])
        out += _cache_parts(layout.window, [window], n_stream, first=n - window.cells)
    return out


def _check_fit(layout: _Layout, blocks: Sequence[StateBlock]) -> None:
    per_cell = layout.cell_bytes
    for i, block in enumerate(blocks):
        if len(block.data) != block.cells * per_cell:
            raise ValueError(f"block {i}: {len(block.data)} bytes for {block.cells} cells of {per_cell} bytes")
        if i < len(blocks) - 1 and block.cells != len(block.tokens):
            raise ValueError(f"block {i} lacks cells for some of its tokens, and is not the last")


def _cache_parts(layout: _Layout, blocks: Sequence[StateBlock], n_stream: int,
                 first: int = 0) -> list[bytes | memoryview]:
    """One KV cache's ``state_write`` for the cells of ``blocks``, in the first stream, at
    positions from ``first`` on."""
    n = sum(block.cells for block in blocks)
    out: list[bytes | memoryview] = [
        struct.pack("<II", n_stream, n),
        _cell_records(layout, blocks, n, first),
        struct.pack("<IIII", layout.v_trans, layout.n_layer, layout.n_rot_k, layout.n_rot_v),
    ]
    # where each block's K and V sections start within its data
    offsets = [layout.ext * block.cells for block in blocks]
    views = [memoryview(block.data) for block in blocks]
    cells = [block.cells for block in blocks]
    rows: list[tuple[int, ...]] = [*layout.k, *([] if layout.v_trans else layout.v)]
    for k_type, row in rows:
        out.append(struct.pack("<iQ", k_type, row))
        for b, view in enumerate(views):
            size = cells[b] * row
            out.append(view[offsets[b]:offsets[b] + size])
            offsets[b] += size
    if layout.v_trans:
        for v_type, el, n_embd in layout.v:
            out.append(struct.pack("<iII", v_type, el, n_embd))
            out.append(_transposed(views, cells, offsets, el, n_embd))
    out.append(struct.pack(f"<{n_stream - 1}I", *([0] * (n_stream - 1))))
    return out


def write_parts(fd: int, parts: Sequence[bytes | memoryview]) -> int:
    """Write ``parts`` at ``fd``'s position, a batch of them in each call (``os.writev``);
    returns the bytes written."""
    written = 0
    for at in range(0, len(parts), _WRITEV_PARTS):
        batch = [p for p in parts[at:at + _WRITEV_PARTS] if len(p)]
        want = sum(len(p) for p in batch)
        done = os.writev(fd, batch) if batch else 0
        if done < want:  # a short write (rare on a file): the rest one part at a time
            for part in batch:
                view = memoryview(part)
                skip = min(done, len(view))
                done -= skip
                view = view[skip:]
                while len(view):
                    view = view[os.write(fd, view):]
        written += want
    return written


def _mapped(path: Path) -> mmap.mmap | bytes | StateRefusal:
    """The file at ``path``, mapped, not read: only what is looked at is read from it."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            return mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ) if size else b""
    except (OSError, ValueError) as e:
        return StateRefusal("unreadable", f"{path}: {getattr(e, 'strerror', None) or e}")


def shifting_flag(args: Sequence[str], env: Mapping[str, str]) -> str | None:
    """The flag (or variable) of ``args``/``env`` by which llama-server moves cells to other
    positions, if any: ``--context-shift`` (drops tokens from the middle and renumbers the
    rest) or ``--cache-reuse N`` (moves reused chunks of a cache). The cells then sit at
    positions 0..n-1 of the slot's tokens again, yet their rows were computed beside other
    tokens: the state is no longer a function of its tokens, and no file shows it.
    As llama-server reads them: a variable is the default, the last flag wins."""
    found: str | None = None
    if env.get("LLAMA_ARG_CONTEXT_SHIFT", "").lower() in ("1", "true", "on", "enabled"):
        found = "LLAMA_ARG_CONTEXT_SHIFT"
    reuse = env.get("LLAMA_ARG_CACHE_REUSE", "")
    if reuse.isdigit() and int(reuse) > 0:
        found = "LLAMA_ARG_CACHE_REUSE"
    for index, arg in enumerate(args):
        name, _, inline = arg.partition("=")
        if name == "--context-shift":
            found = name
        elif name == "--no-context-shift" and found in ("--context-shift", "LLAMA_ARG_CONTEXT_SHIFT"):
            found = None
        elif name == "--cache-reuse":
            value = inline or (args[index + 1] if index + 1 < len(args) else "0")
            found = name if value.isdigit() and int(value) > 0 else None
    return found


class LlamaStateFormat:
    """llama-server's slot file (state version 4, packed server tokens version 1), in blocks.

    ``shifting``: the flag by which the engine moves cells (:func:`shifting_flag`); every
    state is then refused (``shifted``), its bytes not being those of its tokens alone.
    """

    version = f"llama-ggsq-{STATE_VERSION}.server-tokens-{TOKENS_VERSION}.blocks-{BLOCKS_VERSION}"

    def __init__(self, shifting: str | None = None):
        self.shifting = shifting

    def cut(self, path: Path, block_tokens: int) -> CutState | StateRefusal:
        if self.shifting:
            return StateRefusal("shifted", f"the engine runs with {self.shifting}: a state's cells may have been "
                                "moved beside other tokens, which no file shows")
        data = _mapped(path)
        return data if isinstance(data, StateRefusal) else cut_bytes(data, block_tokens)

    def tokens(self, path: Path) -> tuple[int, ...] | StateRefusal:
        data = _mapped(path)
        return data if isinstance(data, StateRefusal) else read_tokens(data)

    def join(self, layout: bytes, blocks: Sequence[StateBlock], dest: Path, *, n_stream: int = 1,
             window: StateBlock | None = None) -> int:
        parts = join_bytes(layout, blocks, n_stream=n_stream, window=window)
        fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            return write_parts(fd, parts)
        finally:
            os.close(fd)
