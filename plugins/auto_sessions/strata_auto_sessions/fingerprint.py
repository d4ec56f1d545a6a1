"""Which model a state file belongs to: the model file's identity (its size, a hash of
its header, a digest of its weights, read from the GGUF's own layout), its sliding
window, and what else of the running engine a saved state depends on.

The weights digest is taken once per file (by device, inode, size and modification
time) and kept in a small cache, so a restart of the engine reads nothing again.
"""

from __future__ import annotations

import functools
import hashlib
import os
import struct
from dataclasses import asdict
from pathlib import Path
from typing import Any

#: Enough of the GGUF to cover its header and metadata on any model we serve.
FINGERPRINT_BYTES = 1 << 20
#: The weights' fingerprint reads, in blocks of this size, the first and last block of
#: every tensor and this many blocks spread evenly over the tensor data.
WEIGHT_BLOCK_BYTES = 4096
WEIGHT_SPREAD_BLOCKS = 1024
#: A model file this small is read whole for its weights' fingerprint.
WEIGHT_WHOLE_BYTES = 16 << 20
#: GGUF metadata value types: the size of each scalar; 8 is a string, 9 an array.
_GGUF_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_GGUF_STRING, _GGUF_ARRAY = 8, 9
_U64 = struct.Struct("<Q")


def fingerprint(model_path: str | None, n_ctx: int | None) -> dict[str, Any]:
    """Identify the model a state file belongs to: its size, a hash of its header and a
    digest of its weights (:func:`weights_digest`).

    The engine checks only the architecture when loading a state file, so a file
    from another model of the same shape would load and produce garbage; a model's
    weights start after its metadata (1.7 MB into SmolLM2), so the header alone does
    not tell a re-quantized or fine-tuned copy from the original.
    """
    result: dict[str, Any] = {"model": model_path, "n_ctx": n_ctx}
    if model_path and Path(model_path).is_file():
        with open(model_path, "rb") as handle:
            result["header_sha256"] = hashlib.sha256(handle.read(FINGERPRINT_BYTES)).hexdigest()
        result["size"] = Path(model_path).stat().st_size
        digest = weights_digest(model_path)
        if digest is not None:
            result["weights"] = digest
    return result


def weights_digest(model_path: str) -> str | None:
    """A digest of the model's tensor data: the first and last 4 KiB of every tensor and
    1,024 blocks of 4 KiB spread evenly over the tensor data (a file of 16 MiB or less:
    all of it); None when the file cannot be read.

    A re-quantization or a merged fine-tune changes every tensor it touches from its
    first block on, so it is caught; a change confined to the inside of tensors, between
    the sampled blocks, is not. Taken once per file (by device, inode, size and
    modification time) and at most a few MiB read however large the model.
    """
    try:
        stat = os.stat(model_path)
    except OSError:
        return None
    return _weights_digest(model_path, stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=8)
def _weights_digest(model_path: str, device: int, inode: int, size: int, mtime_ns: int) -> str | None:
    digest = hashlib.blake2b(str(size).encode(), digest_size=16)
    try:
        with open(model_path, "rb") as handle:
            fd = handle.fileno()
            if size <= WEIGHT_WHOLE_BYTES:
                digest.update(handle.read())
                return digest.hexdigest()
            layout = _tensor_layout(fd, size)
            data_start, offsets = layout if layout is not None else (0, [0])
            bounds = sorted({data_start + offset for offset in offsets if data_start + offset < size}) + [size]
            digest.update(str(len(bounds)).encode())
            for begin, end in zip(bounds, bounds[1:]):
                digest.update(os.pread(fd, min(WEIGHT_BLOCK_BYTES, end - begin), begin))
                if end - begin > WEIGHT_BLOCK_BYTES:
                    digest.update(os.pread(fd, WEIGHT_BLOCK_BYTES, end - WEIGHT_BLOCK_BYTES))
            step = (size - data_start) / WEIGHT_SPREAD_BLOCKS
            for index in range(WEIGHT_SPREAD_BLOCKS):
                digest.update(os.pread(fd, WEIGHT_BLOCK_BYTES, data_start + int(index * step)))
    except OSError:
        return None
    return digest.hexdigest()


def _tensor_layout(fd: int, size: int) -> tuple[int, list[int]] | None:
    """Where a GGUF file's tensor data starts and each tensor's offset in it; None for a
    file that is not a GGUF of version 2 or later (its metadata read in growing chunks)."""
    chunk = min(size, 2 << 20)
    while True:
        head = os.pread(fd, chunk, 0)
        try:
            return _parse_tensor_layout(head)
        except (KeyError, RecursionError):  # a value type GGUF has not, nesting no file has
            return None
        except (struct.error, IndexError):  # the metadata runs on past what was read
            if chunk >= size or chunk >= 256 << 20:
                return None
            chunk = min(size, chunk * 4)


def _parse_tensor_layout(head: bytes) -> tuple[int, list[int]] | None:
    if head[:4] != b"GGUF" or struct.unpack_from("<I", head, 4)[0] < 2:
        return None
    n_tensors, n_kv = struct.unpack_from("<QQ", head, 8)
    pos, alignment = 24, 32
    for _ in range(n_kv):
        name, pos = _gguf_string(head, pos)
        (kind,) = struct.unpack_from("<I", head, pos)
        if name == b"general.alignment" and kind == 4:
            alignment = struct.unpack_from("<I", head, pos + 4)[0] or 32
        pos = _skip_gguf_value(head, kind, pos + 4)
    offsets = []
    for _ in range(n_tensors):
        _name, pos = _gguf_string(head, pos)
        (n_dims,) = struct.unpack_from("<I", head, pos)
        pos += 4 + 8 * n_dims + 4
        offsets.append(struct.unpack_from("<Q", head, pos)[0])
        pos += 8
    if pos > len(head):
        raise IndexError("past the chunk read")
    return -(-pos // alignment) * alignment, offsets


def _gguf_string(head: bytes, at: int) -> tuple[bytes, int]:
    """The GGUF string at ``at`` and where what follows it starts."""
    (length,) = _U64.unpack_from(head, at)
    if at + 8 + length > len(head):
        raise IndexError("past the chunk read")
    return head[at + 8:at + 8 + length], at + 8 + length


def _skip_gguf_value(head: bytes, kind: int, at: int) -> int:
    """Where what follows the GGUF metadata value of type ``kind`` at ``at`` starts."""
    if kind == _GGUF_STRING:
        return _gguf_string(head, at)[1]
    if kind == _GGUF_ARRAY:
        item, count = struct.unpack_from("<IQ", head, at)
        at += 12
        if count > len(head):  # more items than bytes: not a GGUF's metadata
            raise IndexError("past the chunk read")
        if item in _GGUF_SCALAR_BYTES:
            return at + count * _GGUF_SCALAR_BYTES[item]
        if item == _GGUF_STRING:  # a tokenizer's vocabulary: hundreds of thousands
            u64 = _U64.unpack_from
            for _ in range(count):
                at += 8 + u64(head, at)[0]
            return at
        for _ in range(count):
            at = _skip_gguf_value(head, item, at)
        return at
    return at + _GGUF_SCALAR_BYTES[kind]


#: Architectures whose loader takes a sliding window when the file names none
#: (llama.cpp's ``src/models/<arch>.cpp``).
_WINDOW_BY_DEFAULT = {"gemma2": 4096, "llama4": 8192}
#: Architectures whose sliding window the engine ignores (Phi-3's is disabled there).
_WINDOW_IGNORED = frozenset({"phi3"})


@functools.lru_cache(maxsize=8)
def _sliding_window(model_path: str, size: int, mtime_ns: int) -> int | None:
    try:
        import gguf  # an optional extra: only needed to tell SWA models apart
    except ImportError:
        return None
    try:
        reader = gguf.GGUFReader(model_path)
        arch_field = reader.fields.get("general.architecture")
        if arch_field is None:
            return None
        arch = str(arch_field.contents())
        field = reader.fields.get(f"{arch}.attention.sliding_window")
        window = int(field.contents()) if field is not None else _WINDOW_BY_DEFAULT.get(arch, 0)
    except Exception:  # any file, read by another package: what it cannot read is not known
        return None
    return 0 if arch in _WINDOW_IGNORED else window


def sliding_window(model_path: str | None) -> int | None:
    """The model's sliding attention window in tokens, from its GGUF metadata
    (``<arch>.attention.sliding_window``, or the architecture's default): 0 when it has
    none; None when not known (no readable file, not a GGUF, or the optional ``gguf``
    package is not installed).

    Such a model's engine keeps only the window's last tokens for its sliding layers
    unless started with ``--swa-full``: a restored state then loads, yet the engine
    finds no checkpoint to resume from and reads the whole conversation again.
    """
    if not model_path:
        return None
    try:
        stat = os.stat(model_path)
    except OSError:
        return None
    return _sliding_window(model_path, stat.st_size, stat.st_mtime_ns)


def engine_fingerprint(info: Any) -> dict[str, Any]:
    """What a state file saved now depends on: the model (:func:`fingerprint`) and its
    sliding window (:func:`sliding_window`), its weight type and the engine's build
    (``/props``), and the state layout its start flags give (``info.layout``, None when
    not known: an engine strata-serve attached to)."""
    result = fingerprint(info.model_path, info.n_ctx)
    result["sliding_window"] = sliding_window(info.model_path)
    result["ftype"] = getattr(info, "model_ftype", None)
    result["build"] = getattr(info, "build", None)
    layout = getattr(info, "layout", None)
    result["layout"] = asdict(layout) if layout is not None else None
    return result


def same_model(recorded: dict[str, Any], current: dict[str, Any]) -> bool:
    """Whether two fingerprints name the same model file: its header, size and weights."""
    if "header_sha256" in recorded or "header_sha256" in current:
        keys: tuple[str, ...] = ("header_sha256", "size", "weights")
    else:  # the model file is not readable from here: the path must match
        keys = ("model",)
    return all(recorded.get(k) == current.get(k) for k in keys)
