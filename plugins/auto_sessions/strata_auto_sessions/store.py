"""The session files: ``auto-<key>.bin`` plus a JSON sidecar, written so nothing is half-done.

Only names made here are ever touched: ``auto-*.bin`` and their ``auto-*.json``
sidecars, and ``tmp-auto-*`` temporaries. A file saved by hand through ``/slots``
has another name and is never listed, pruned or read.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from strata_serve.files import PRIVATE_FILE_MODE, make_private_dir

log = logging.getLogger("strata_auto_sessions")

PREFIX = "auto-"
TEMP_PREFIX = "tmp-auto-"
#: Enough of the GGUF to cover its header and metadata on any model we serve.
FINGERPRINT_BYTES = 1 << 20


def fingerprint(model_path: str | None, n_ctx: int | None) -> dict[str, Any]:
    """Identify the model a state file belongs to: its size and a hash of its header.

    The engine checks only the architecture when loading a state file, so a file
    from another model of the same shape would load and produce garbage.
    """
    result: dict[str, Any] = {"model": model_path, "n_ctx": n_ctx}
    if model_path and Path(model_path).is_file():
        with open(model_path, "rb") as handle:
            result["header_sha256"] = hashlib.sha256(handle.read(FINGERPRINT_BYTES)).hexdigest()
        result["size"] = Path(model_path).stat().st_size
    return result


def same_model(recorded: dict[str, Any], current: dict[str, Any]) -> bool:
    if "header_sha256" in recorded or "header_sha256" in current:
        keys = ("header_sha256", "size", "n_ctx")
    else:  # the model file is not readable from here: the path must match
        keys = ("model", "n_ctx")
    return all(recorded.get(k) == current.get(k) for k in keys)


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


@dataclass
class Sidecar:
    key: str
    fingerprint: dict[str, Any]
    tokens: int
    bytes: int
    created: float
    last_used: float
    #: :func:`sample_digest` of the state file when it was saved.
    digest: str

    @classmethod
    def read(cls, path: Path) -> Sidecar | None:
        try:
            data = json.loads(path.read_text())
            return cls(**{name: data[name] for name in cls.__dataclass_fields__})
        except (OSError, ValueError, KeyError, TypeError):
            return None


class SessionStore:
    """The plugin's files in the slot directory."""

    def __init__(self, directory: Path):
        self.directory = directory

    def bin_name(self, key: str) -> str:
        return f"{PREFIX}{key}.bin"

    def bin_path(self, key: str) -> Path:
        return self.directory / self.bin_name(key)

    def restorable(self, key: str) -> bool:
        """A regular file of ours, not a symlink that could lead outside the directory."""
        path = self.bin_path(key)
        return path.is_file() and not path.is_symlink()

    def intact(self, key: str, sidecar: Sidecar) -> bool:
        """The file is the one that was saved: same size, same sampled digest."""
        path = self.bin_path(key)
        return path.stat().st_size == sidecar.bytes and sample_digest(path) == sidecar.digest

    def sidecar_path(self, key: str) -> Path:
        return self.directory / f"{PREFIX}{key}.json"

    def temp_name(self, key: str) -> str:
        return f"{TEMP_PREFIX}{key}-{uuid.uuid4().hex[:8]}.bin"

    def prepare(self) -> int:
        """Create the directory and remove temporaries a crash left behind; returns how many."""
        make_private_dir(self.directory)
        removed = 0
        for leftover in self.directory.glob(f"{TEMP_PREFIX}*"):
            leftover.unlink(missing_ok=True)
            removed += 1
        return removed

    def commit(self, temp_name: str, key: str, sidecar: Sidecar) -> None:
        """Move a finished save under its real name, private to this user, with its sidecar.

        :raises OSError: when the file on disk is not the size the engine reported
            (a full disk can leave a short file behind a reported success).
        """
        temp = self.directory / temp_name
        size = temp.stat().st_size
        if sidecar.bytes and size != sidecar.bytes:
            raise OSError(f"{temp_name} holds {size:,} bytes; the engine reported {sidecar.bytes:,}")
        os.chmod(temp, PRIVATE_FILE_MODE)
        sidecar.digest = sample_digest(temp)
        os.replace(temp, self.bin_path(key))
        self.write_sidecar(sidecar)

    def discard(self, temp_name: str) -> None:
        (self.directory / temp_name).unlink(missing_ok=True)

    def write_sidecar(self, sidecar: Sidecar) -> None:
        target = self.sidecar_path(sidecar.key)
        temp = self.directory / f"{TEMP_PREFIX}{sidecar.key}-{uuid.uuid4().hex[:8]}.json"
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, PRIVATE_FILE_MODE)
        os.fchmod(fd, PRIVATE_FILE_MODE)  # the mode given to open passes through the umask
        with os.fdopen(fd, "w") as handle:
            json.dump(asdict(sidecar), handle)
        os.replace(temp, target)

    def sidecar(self, key: str) -> Sidecar | None:
        return Sidecar.read(self.sidecar_path(key))

    def touch(self, key: str) -> None:
        sidecar = self.sidecar(key)
        if sidecar is not None:
            sidecar.last_used = time.time()
            self.write_sidecar(sidecar)

    def remove(self, key: str) -> None:
        self.bin_path(key).unlink(missing_ok=True)
        self.sidecar_path(key).unlink(missing_ok=True)

    def files(self) -> list[tuple[str, Path, int, float]]:
        """``(key, path, bytes, last used)`` of every session file, newest first."""
        found = []
        for path in self.directory.glob(f"{PREFIX}*.bin"):
            if path.is_symlink():
                continue  # never made here: not ours to read, count or delete
            key = path.name[len(PREFIX) : -len(".bin")]
            try:
                stat = path.stat()
            except FileNotFoundError:
                continue
            sidecar = self.sidecar(key)
            used = max(stat.st_mtime, sidecar.last_used) if sidecar else stat.st_mtime
            found.append((key, path, stat.st_size, used))
        return sorted(found, key=lambda item: item[3], reverse=True)

    def prune(self, keep: int, max_bytes: int) -> list[tuple[str, int]]:
        """Keep the newest ``keep`` files within ``max_bytes``; returns ``(key, bytes)`` removed."""
        removed = []
        total = 0
        for index, (key, _path, size, _used) in enumerate(self.files()):
            total += size
            if index >= keep or total > max_bytes:
                self.remove(key)
                removed.append((key, size))
                total -= size
        for orphan in self.directory.glob(f"{PREFIX}*.json"):
            if not orphan.with_suffix(".bin").exists():
                orphan.unlink(missing_ok=True)
        return removed

    def bytes_per_token(self, current: dict[str, Any]) -> float | None:
        """Engine state bytes per token, from the sidecars of files saved for this model."""
        for key, *_ in self.files():
            sidecar = self.sidecar(key)
            if sidecar is not None and sidecar.tokens > 0 and same_model(sidecar.fingerprint, current):
                return sidecar.bytes / sidecar.tokens
        return None

    def usage(self) -> tuple[int, int]:
        files = self.files()
        return len(files), sum(size for _key, _path, size, _used in files)
