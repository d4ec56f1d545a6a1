"""A state file's digest: what a restore checks the file against before the engine reads it."""

from __future__ import annotations

import hashlib
from pathlib import Path

#: How a file is sampled for its digest: this many evenly spaced blocks of this size.
DIGEST_BLOCKS = 64
DIGEST_BLOCK_BYTES = 64 * 1024


def sample_digest(path: Path) -> str:
    """A digest of the file's size and 64 evenly spaced 64 KiB blocks (at most 4 MiB read).

    The engine has crashed on a truncated or damaged state file, so a file is
    checked before it is handed over. Reading a few MiB keeps a restore of a
    large file in milliseconds; it catches truncation, appended bytes and damage
    to any sampled block, not a flipped bit between samples.
    """
    size = path.stat().st_size
    digest = hashlib.blake2b(str(size).encode(), digest_size=16)
    with open(path, "rb") as handle:
        if size <= DIGEST_BLOCKS * DIGEST_BLOCK_BYTES:
            digest.update(handle.read())
        else:
            step = (size - DIGEST_BLOCK_BYTES) // (DIGEST_BLOCKS - 1)
            for index in range(DIGEST_BLOCKS):
                handle.seek(index * step)
                digest.update(handle.read(DIGEST_BLOCK_BYTES))
    return digest.hexdigest()
