"""One block (or tail) as a file: its tokens, its cells and the engine's bytes, checked on read.

``SBLK``, u16 version, u16 compression (0 none, 1 zstd), u32 tokens, u32 cells, u64 bytes
of data as the engine wrote them, 32 bytes of SHA-256 over those bytes, the tokens (i32),
then the data (compressed or not). Written once under its name and never changed.
"""

from __future__ import annotations

import hashlib
import os
import struct
from pathlib import Path

from strata_serve import PRIVATE_FILE_MODE, StateBlock

__all__ = ["CorruptBlock", "decode", "encode", "publish"]

MAGIC = b"SBLK"
VERSION = 1
_HEADER = struct.Struct("<4sHHIIQ32s")
COMPRESSIONS = {None: 0, "zstd": 1}


class CorruptBlock(Exception):
    """A stored block that does not read back as it was written."""


def _zstd() -> object:
    try:
        import zstandard
    except ImportError:
        raise ValueError("compression 'zstd' needs the zstandard package (pip install zstandard)") from None
    return zstandard


def encode(block: StateBlock, compression: str | None = None) -> bytes:
    if compression not in COMPRESSIONS:
        raise ValueError(f"unknown compression {compression!r}; expected one of {sorted(map(str, COMPRESSIONS))}")
    data = block.data
    if compression == "zstd":
        data = _zstd().ZstdCompressor(level=3).compress(block.data)  # type: ignore[attr-defined]
    header = _HEADER.pack(MAGIC, VERSION, COMPRESSIONS[compression], len(block.tokens), block.cells,
                          len(block.data), hashlib.sha256(block.data).digest())
    return header + struct.pack(f"<{len(block.tokens)}i", *block.tokens) + data


def decode(raw: bytes) -> StateBlock:
    if len(raw) < _HEADER.size:
        raise CorruptBlock("shorter than its header")
    magic, version, compression, n_tokens, cells, size, digest = _HEADER.unpack_from(raw)
    if magic != MAGIC or version != VERSION:
        raise CorruptBlock(f"not a block of this version ({magic!r}, {version})")
    at = _HEADER.size + 4 * n_tokens
    if len(raw) < at:
        raise CorruptBlock("its tokens are cut short")
    tokens = struct.unpack_from(f"<{n_tokens}i", raw, _HEADER.size)
    data = raw[at:]
    if compression == 1:
        data = _zstd().ZstdDecompressor().decompress(data, max_output_size=size)  # type: ignore[attr-defined]
    elif compression != 0:
        raise CorruptBlock(f"unknown compression {compression}")
    if len(data) != size or hashlib.sha256(data).digest() != digest:
        raise CorruptBlock("its data does not match its digest")
    try:
        return StateBlock(tokens=tuple(tokens), data=data, cells=cells)
    except ValueError as e:
        raise CorruptBlock(str(e)) from None


def publish(path: Path, raw: bytes, *, fsync: bool = False) -> bool:
    """Write ``raw`` at ``path`` unless a file is there already; True when this call wrote it.

    The bytes go to a private temporary file first, linked to ``path`` (which fails if
    ``path`` exists: a block is never overwritten, and a reader never sees half of one).
    """
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{os.urandom(4).hex()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, PRIVATE_FILE_MODE)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(raw)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        try:
            os.link(tmp, path)
        except FileExistsError:
            return False
        return True
    finally:
        tmp.unlink(missing_ok=True)
