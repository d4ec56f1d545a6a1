"""A state file's digest: what a restore checks the file against before the engine reads it."""

from __future__ import annotations

import hashlib
import mmap
import zlib
from collections.abc import Iterator
from pathlib import Path

#: How a file is sampled for its digest: this many evenly spaced blocks of this size.
DIGEST_BLOCKS = 64
DIGEST_BLOCK_BYTES = 64 * 1024


#: How a new digest is made, named in front of it (``crc32:<8 hex digits>``): zlib's CRC-32
#: of the size and the sampled blocks, at several GB/s, where BLAKE2b took 4.9 ms for 4 MiB
#: on a restore's path (1.3 ms for CRC-32). It guards against accidental damage (a short
#: file, bytes overwritten), as the whole check does; whoever can write the slot directory
#: can do worse than forge a digest. A digest with no scheme's name is BLAKE2b-128 of the
#: same bytes, as earlier versions wrote them: still checked as such.
SCHEME = "crc32"
#: The scheme of a digest with no name in front.
FIRST_SCHEME = "blake2b"


def sample_digest(path: Path, scheme: str = SCHEME) -> str:
    """A digest of the file's size and 64 evenly spaced 64 KiB blocks (at most 4 MiB read),
    in ``scheme`` (:data:`SCHEME` or :data:`FIRST_SCHEME`).

    The engine has crashed on a truncated or damaged state file, so a file is
    checked before it is handed over. Reading a few MiB keeps a restore of a
    large file in milliseconds; it catches truncation, appended bytes and damage
    to any sampled block, not a flipped bit between samples.
    """
    size = path.stat().st_size
    if scheme == FIRST_SCHEME:
        digest = hashlib.blake2b(str(size).encode(), digest_size=16)
        for block in _blocks(path, size):
            digest.update(block)
        return digest.hexdigest()
    if scheme != SCHEME:
        raise ValueError(f"no digest scheme {scheme!r}")
    crc = zlib.crc32(str(size).encode())
    for block in _blocks(path, size):
        crc = zlib.crc32(block, crc)
    return f"{SCHEME}:{crc:08x}"


def digest_matches(path: Path, expected: str) -> bool:
    """Whether the file's digest, in the scheme ``expected`` names, is ``expected``."""
    scheme, named, _ = expected.partition(":")
    scheme = scheme if named else FIRST_SCHEME
    if scheme not in (SCHEME, FIRST_SCHEME):
        return False  # a scheme this version does not know: not taken for the file's
    return sample_digest(path, scheme) == expected


def _blocks(path: Path, size: int) -> Iterator[bytes | mmap.mmap]:
    with open(path, "rb") as handle:
        if size <= DIGEST_BLOCKS * DIGEST_BLOCK_BYTES:
            try:
                # The whole file, mapped rather than copied (a fifth less time for 2.5 MB here).
                whole = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
            except (ValueError, OSError):  # empty, or a file system that maps nothing
                yield handle.read()
                return
            with whole:
                yield whole
            return
        step = (size - DIGEST_BLOCK_BYTES) // (DIGEST_BLOCKS - 1)
        for index in range(DIGEST_BLOCKS):
            handle.seek(index * step)
            yield handle.read(DIGEST_BLOCK_BYTES)
