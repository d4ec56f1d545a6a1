"""One block (or tail) as a file: its tokens, its cells and the engine's bytes, checked on read.

``SBLK``, u16 version, u16 compression (0 none, 1 zstd), u32 tokens, u32 cells, u64 bytes
of data as the engine wrote them, 32 bytes of SHA-256 over those bytes, the tokens (i32),
then the data (compressed or not). Written once under its name and never changed.

A store reads its blocks with :func:`load`: the file mapped, not copied, and its data
checked against its digest unless :class:`Verified` says this very file (same inode,
size, mtime and ctime) was checked, or written, by this process before.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import struct
from pathlib import Path

from strata_serve import PRIVATE_FILE_MODE, StateBlock

__all__ = ["CorruptBlock", "Verified", "decode", "encode", "encode_parts", "load", "publish"]

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
    return b"".join(encode_parts(block, compression))


def encode_parts(block: StateBlock, compression: str | None = None) -> list[bytes | memoryview]:
    """The block's file as two parts, its header (with its tokens) and its data (not copied
    when not compressed)."""
    if compression not in COMPRESSIONS:
        raise ValueError(f"unknown compression {compression!r}; expected one of {sorted(map(str, COMPRESSIONS))}")
    data = block.data
    if compression == "zstd":
        data = _zstd().ZstdCompressor(level=3).compress(block.data)  # type: ignore[attr-defined]
    header = _HEADER.pack(MAGIC, VERSION, COMPRESSIONS[compression], len(block.tokens), block.cells,
                          len(block.data), hashlib.sha256(block.data).digest())
    return [header + struct.pack(f"<{len(block.tokens)}i", *block.tokens), data]


class Verified:
    """The block files this process checked against their digest or wrote itself, by name
    and the file's identity (device, inode, size, mtime, ctime): a file changed or replaced
    since no longer matches and is checked again when read."""

    def __init__(self, limit: int = 1 << 16):
        self._files: dict[str, tuple[int, ...]] = {}
        self._limit = limit

    @staticmethod
    def _identity(st: os.stat_result) -> tuple[int, ...]:
        return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns

    def knows(self, name: str, st: os.stat_result) -> bool:
        return self._files.get(name) == self._identity(st)

    def add(self, name: str, st: os.stat_result) -> None:
        self._files.pop(name, None)
        if len(self._files) >= self._limit:  # the oldest forgotten: it is checked again when read
            del self._files[next(iter(self._files))]
        self._files[name] = self._identity(st)

    def forget(self, name: str) -> None:
        self._files.pop(name, None)


def load(path: Path, name: str, verified: Verified, *, mapped: bool = True) -> StateBlock:
    """The block stored at ``path``; its data a view of the file mapped read-only
    (``mapped``; else read into memory), checked against its digest unless ``verified``
    knows this file.

    :raises FileNotFoundError: no file at ``path``.
    :raises CorruptBlock: the file does not read back as a block, or its data does not
        match its digest.
    """
    fd = os.open(path, os.O_RDONLY)
    try:
        st = os.fstat(fd)
        if st.st_size < _HEADER.size:
            raise CorruptBlock("shorter than its header")
        raw: bytes | mmap.mmap
        if mapped:
            raw = mmap.mmap(fd, st.st_size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
                            prot=mmap.PROT_READ)
        else:
            with os.fdopen(os.dup(fd), "rb") as f:
                raw = f.read()
    finally:
        os.close(fd)
    known = verified.knows(name, st)
    block = decode(raw, check=not known)
    if not known:
        verified.add(name, st)
    return block


def decode(raw: bytes | mmap.mmap, *, check: bool = True) -> StateBlock:
    """The block ``raw`` holds (its data a view of ``raw`` when not compressed); ``check``:
    its data compared with its digest."""
    if len(raw) < _HEADER.size:
        raise CorruptBlock("shorter than its header")
    magic, version, compression, n_tokens, cells, size, digest = _HEADER.unpack_from(raw)
    if magic != MAGIC or version != VERSION:
        raise CorruptBlock(f"not a block of this version ({magic!r}, {version})")
    at = _HEADER.size + 4 * n_tokens
    if len(raw) < at:
        raise CorruptBlock("its tokens are cut short")
    tokens = struct.unpack_from(f"<{n_tokens}i", raw, _HEADER.size)
    data: bytes | memoryview = memoryview(raw)[at:]
    if compression == 1:
        data = _zstd().ZstdDecompressor().decompress(data, max_output_size=size)  # type: ignore[attr-defined]
    elif compression != 0:
        raise CorruptBlock(f"unknown compression {compression}")
    if len(data) != size or (check and hashlib.sha256(data).digest() != digest):
        raise CorruptBlock("its data does not match its digest")
    try:
        return StateBlock(tokens=tuple(tokens), data=data, cells=cells)
    except ValueError as e:
        raise CorruptBlock(str(e)) from None


def publish(path: Path, raw: bytes | list[bytes | memoryview], *, fsync: bool = False) -> bool:
    """Write ``raw`` (bytes, or parts written one after the other) at ``path`` unless a
    file is there already; True when this call wrote it.

    The bytes go to a private temporary file first, linked to ``path`` (which fails if
    ``path`` exists: a block is never overwritten, and a reader never sees half of one).
    """
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{os.urandom(4).hex()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, PRIVATE_FILE_MODE)
    try:
        with os.fdopen(fd, "wb") as f:
            for part in [raw] if isinstance(raw, bytes) else raw:
                f.write(part)  # a large part goes to the file as it is, not copied into a buffer
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
