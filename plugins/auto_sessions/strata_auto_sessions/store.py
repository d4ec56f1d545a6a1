"""The session files: ``auto-<key>.bin`` plus a JSON sidecar, written so nothing is half-done.

Only files made here are ever touched: ``auto-<name>.bin`` with an ``auto-<name>.json``
sidecar that names the same key, and ``tmp-auto-<name>-<8 hex>.bin|json`` temporaries,
where ``<name>`` is :func:`file_key` of the key. The core refuses ``/slots`` names that
begin with ``auto-`` or ``tmp-``, and a file without our sidecar is not ours, so a file
saved by hand (under any name, by this version or an older one) is never listed,
pruned or read.

``<name>`` is the key with each upper-case letter written ``+`` and its lower case
(``MyChat`` -> ``+my+chat``): two keys that differ only by case get two files on a
case-insensitive file system (macOS) too.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import functools
import hashlib
import json
import logging
import math
import os
import re
import struct
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, AsyncIterator, Callable, Iterator, Protocol

from strata_serve import PRIVATE_FILE_MODE, make_private_dir

log = logging.getLogger("strata_auto_sessions")

PREFIX = "auto-"
TEMP_PREFIX = "tmp-auto-"
#: A key as written in a file name: no upper case, ``+x`` for ``X``.
_FILE_KEY = r"(?:[a-z0-9_-]|\+[a-z])+"
SESSION_NAME = re.compile(rf"{PREFIX}(?P<key>{_FILE_KEY})\.(?P<ext>bin|json)")
TEMP_NAME = re.compile(rf"{TEMP_PREFIX}[a-z0-9_+-]+\.(?:bin|json)")
#: The store's own files, under names no key can take (a key has no ``.``): the sessions
#: removed by hand while a server may hold them, what the running engine is (for
#: ``strata-serve sessions ls``), the conversations the running server holds in its slots
#: (for ``strata-serve sessions rm``), and the lock the running server holds for its
#: lifetime (one server per directory).
REMOVED_NAME = f"{PREFIX}.removed.json"
ENGINE_NAME = f"{PREFIX}.engine.json"
HELD_NAME = f"{PREFIX}.held.json"
SERVER_LOCK_NAME = f"{PREFIX}.server.json"


class DirectoryInUse(Exception):
    """Another live server uses the slot directory (it holds :data:`SERVER_LOCK_NAME`)."""


def file_key(key: str) -> str:
    """``key`` as written in a file name, the same under case folding only for the same key.

    :raises ValueError: for a key strata-serve would never make (outside ``[A-Za-z0-9_-]``).
    """
    if not re.fullmatch(r"[A-Za-z0-9_-]+", key):
        raise ValueError(f"not a conversation key: {key!r}")
    return "".join(f"+{char.lower()}" if "A" <= char <= "Z" else char for char in key)


def _temp_name(key: str, suffix: str) -> str:
    return f"{TEMP_PREFIX}{file_key(key)}-{uuid.uuid4().hex[:8]}{suffix}"


def key_of_file(name: str) -> str:
    """The key :func:`file_key` wrote as ``name``."""
    return re.sub(r"\+([a-z])", lambda match: match.group(1).upper(), name)


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
    u64 = _U64.unpack_from

    def string(at: int) -> tuple[bytes, int]:
        (length,) = u64(head, at)
        if at + 8 + length > len(head):
            raise IndexError("past the chunk read")
        return head[at + 8:at + 8 + length], at + 8 + length

    def skip(kind: int, at: int) -> int:
        if kind == _GGUF_STRING:
            return string(at)[1]
        if kind == _GGUF_ARRAY:
            item, count = struct.unpack_from("<IQ", head, at)
            at += 12
            if count > len(head):  # more items than bytes: not a GGUF's metadata
                raise IndexError("past the chunk read")
            if item in _GGUF_SCALAR_BYTES:
                return at + count * _GGUF_SCALAR_BYTES[item]
            if item == _GGUF_STRING:  # a tokenizer's vocabulary: hundreds of thousands
                for _ in range(count):
                    at += 8 + u64(head, at)[0]
                return at
            for _ in range(count):
                at = skip(item, at)
            return at
        return at + _GGUF_SCALAR_BYTES[kind]

    for _ in range(n_kv):
        name, pos = string(pos)
        (kind,) = struct.unpack_from("<I", head, pos)
        if name == b"general.alignment" and kind == 4:
            alignment = struct.unpack_from("<I", head, pos + 4)[0] or 32
        pos = skip(kind, pos + 4)
    offsets = []
    for _ in range(n_tensors):
        _name, pos = string(pos)
        (n_dims,) = struct.unpack_from("<I", head, pos)
        pos += 4 + 8 * n_dims + 4
        offsets.append(struct.unpack_from("<Q", head, pos)[0])
        pos += 8
    if pos > len(head):
        raise IndexError("past the chunk read")
    return -(-pos // alignment) * alignment, offsets


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


#: Why a file is refused; each has its counter (``restores_refused_<reason>``).
REFUSAL_REASONS = ("other_model", "context", "cache_type", "flash_attn", "swa", "build", "unjudged")
#: The state layout fields a file must share with the engine, and the reason for each.
_LAYOUT_REASONS = {"cache_type_k": "cache_type", "cache_type_v": "cache_type", "flash_attn": "flash_attn",
                   "swa_full": "swa"}
#: The layout of an engine started without any of its layout flags.
_DEFAULT_LAYOUT = {"cache_type_k": "f16", "cache_type_v": "f16", "flash_attn": "auto", "swa_full": False}
#: Engine builds this far apart (llama.cpp's ``b<number>``) load each other's files: the
#: engine checks its state file's own format version and refuses another one cleanly.
BUILD_RANGE = 1000


@dataclass(frozen=True)
class Refusal:
    """Why a file cannot be restored into the running engine."""

    #: One of :data:`REFUSAL_REASONS`.
    reason: str
    #: For people: what differs, saved against now.
    detail: str


def _layout_flags(layout: dict[str, Any] | None) -> dict[str, Any] | None:
    if layout is None:
        return None
    return {field: layout.get(field, default) for field, default in _DEFAULT_LAYOUT.items()}


def _build_number(build: str) -> int | None:
    match = re.match(r"b(\d+)", build)
    number = int(match.group(1)) if match else 0
    return number or None  # b0: a build without a number (built outside llama.cpp's git)


def incompatibility(sidecar: Sidecar | None, current: dict[str, Any], *,
                    build_range: int = BUILD_RANGE) -> Refusal | None:
    """Whether the file a ``sidecar`` describes can be restored into the engine ``current``
    (an :func:`engine_fingerprint`) describes: None when it can, else why not.

    Refused: another model file; more saved tokens than the engine's context holds;
    another KV cache type (``-ctk``/``-ctv``), flash-attention setting or ``--swa-full``;
    an engine build more than ``build_range`` apart (or builds that cannot be told
    apart by number); any file, when the engine's model uses a sliding window and it
    runs without ``--swa-full`` (:func:`swa_unusable`). Harmless: another context size that still holds the tokens,
    GPU layers, a build within the range. A layout not known on one side (a file
    saved before the layout was recorded, or an engine strata-serve attached to) is
    judged equal to the engine's defaults; when the other side runs other flags, the
    file cannot be judged and is refused.
    """
    if sidecar is None:
        return Refusal("unjudged", "its sidecar is missing or unreadable")
    saved = sidecar.fingerprint
    if "weights" in current and "header_sha256" in saved and "weights" not in saved:
        return Refusal("unjudged", "it was saved by a version that fingerprinted the model's header only, "
                                   "not its weights")
    if not same_model(saved, current):
        return Refusal("other_model", f"it was saved for another model ({saved.get('model')})")
    n_ctx = current.get("n_ctx")
    if isinstance(n_ctx, int) and sidecar.tokens > n_ctx:
        return Refusal("context", f"it holds {sidecar.tokens:,} tokens, more than the engine's context "
                                  f"({n_ctx:,}, -c)")
    then, now = _layout_flags(saved.get("layout")), _layout_flags(current.get("layout"))
    if then is None or now is None:
        known = then if now is None else now
        if known is not None and known != _DEFAULT_LAYOUT:
            side = "the file's" if now is None else "the engine's"
            other = "this engine's" if now is None else "the file's"
            return Refusal("unjudged", f"{other} state layout is not known and {side} is not the default "
                                       f"({_describe(known)})")
    else:
        for field, reason in _LAYOUT_REASONS.items():
            if then[field] != now[field]:
                return Refusal(reason, f"{field} differs: saved with {then[field]}, the engine runs with "
                                       f"{now[field]}")
    built, running = saved.get("build"), current.get("build")
    if built and running and built != running:
        apart = None
        if _build_number(built) and _build_number(running):
            apart = abs(_build_number(built) - _build_number(running))  # type: ignore[operator]
        if apart is None or apart > build_range:
            how_far = "cannot tell how far apart" if apart is None else f"{apart} builds apart"
            return Refusal("build", f"it was saved by engine build {built}, the engine is {running} "
                                    f"({how_far}; at most {build_range} is taken as compatible)")
    unusable = swa_unusable(current)
    if unusable is not None:
        return Refusal("swa", unusable)
    return None


def swa_unusable(current: dict[str, Any]) -> str | None:
    """Why no state of the engine ``current`` (an :func:`engine_fingerprint`) describes is
    worth a file: its model uses a sliding window and it runs without ``--swa-full``.
    None when it is not so, or not known (the window, or an attached engine's flags)."""
    window, layout = current.get("sliding_window"), current.get("layout")
    if not window or layout is None or _layout_flags(layout)["swa_full"]:
        return None
    return (f"the model uses a sliding attention window ({window:,} tokens) and the engine runs without "
            f"--swa-full: it would load a saved state, then read the whole conversation again")


def _describe(layout: dict[str, Any]) -> str:
    return (f"-ctk {layout['cache_type_k']} -ctv {layout['cache_type_v']} -fa {layout['flash_attn']}"
            + (" --swa-full" if layout["swa_full"] else ""))


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
    #: What the saved state was made from: ``{"units": n, "digest": ...}`` of the last
    #: request's prompt (see :func:`strata_auto_sessions.prompts.prompt_signature`), with
    #: its ``chain`` of digests, one per message boundary, where recorded.
    prompt: dict[str, Any] | None = None
    #: The tenant whose conversation it is (None: no tenants, or saved before this was recorded).
    tenant: str | None = None
    #: The sidecar's format: 1 had no state layout in ``fingerprint``, 2 has it.
    version: int = 1

    @classmethod
    def read(cls, path: Path) -> Sidecar | None:
        """The sidecar at ``path``; None when it is missing, unreadable or damaged."""
        try:
            return cls.load(path)
        except (OSError, DamagedSidecar):
            return None

    @classmethod
    def load(cls, path: Path) -> Sidecar:
        """The sidecar at ``path``, every field of the type it is written with.

        :raises OSError: when it cannot be read (missing, among others).
        :raises DamagedSidecar: when it is not a sidecar: not JSON (or JSON with ``NaN``
            or ``Infinity``), not an object, a field missing or of another type, a
            number out of range.
        """
        try:
            data = json.loads(path.read_bytes(), parse_constant=_no_constant)
        except (ValueError, RecursionError) as exc:
            raise DamagedSidecar(f"not JSON: {exc}") from None
        if not isinstance(data, dict):
            raise DamagedSidecar(f"not a JSON object but {_json_type(data)}")
        for name, check in _SIDECAR_FIELDS.items():
            if name not in data:
                if name in _OPTIONAL:
                    continue
                raise DamagedSidecar(f"it has no {name!r}")
            problem = check(data[name])
            if problem:
                raise DamagedSidecar(f"{name!r} is {problem}")
        fields = {name: data[name] for name in cls.__dataclass_fields__ if name in data}
        return cls(**fields)


class DamagedSidecar(ValueError):
    """A file under a sidecar's name that is not one (see :meth:`Sidecar.load`)."""


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number JSON allows")


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "a list",
            dict: "an object"}.get(type(value), type(value).__name__)


#: Counts (tokens, bytes, a file's size) fit in 63 bits; anything larger is not one.
_MAX_COUNT = (1 << 63) - 1


def _count(value: Any) -> str | None:
    if type(value) is not int:
        return f"{_json_type(value)}, not an integer"
    return None if 0 <= value <= _MAX_COUNT else f"{value}, out of range"


def _seconds(value: Any) -> str | None:
    if type(value) not in (int, float):
        return f"{_json_type(value)}, not a number"
    return None if math.isfinite(value) and abs(value) < 1e15 else f"{value}, out of range"


def _text(value: Any) -> str | None:
    return None if isinstance(value, str) else f"{_json_type(value)}, not a string"


def _optional(check: Callable[[Any], str | None]) -> Callable[[Any], str | None]:
    return lambda value: None if value is None else check(value)


def _typed(fields: dict[str, Callable[[Any], str | None]]) -> Callable[[Any], str | None]:
    """An object whose known fields are of their types (others are let through: a newer
    version may record more)."""
    def check(value: Any) -> str | None:
        if not isinstance(value, dict):
            return f"{_json_type(value)}, not an object"
        for name, field_check in fields.items():
            problem = field_check(value[name]) if name in value else None
            if problem:
                return f"an object whose {name!r} is {problem}"
        return None
    return check


def _list_of(check: Callable[[Any], str | None]) -> Callable[[Any], str | None]:
    def check_all(value: Any) -> str | None:
        if not isinstance(value, list):
            return f"{_json_type(value)}, not a list"
        problems = (check(item) for item in value)
        return next((f"a list holding {problem}" for problem in problems if problem), None)
    return check_all


def _flag(value: Any) -> str | None:
    return None if isinstance(value, bool) else f"{_json_type(value)}, not a boolean"


#: What each sidecar field must be, and the fields of its objects that are read.
_SIDECAR_FIELDS: dict[str, Callable[[Any], str | None]] = {
    "key": _text,
    "fingerprint": _typed({
        "model": _optional(_text), "n_ctx": _optional(_count), "header_sha256": _text, "size": _count,
        "weights": _text, "sliding_window": _optional(_count), "ftype": _optional(_text),
        "build": _optional(_text),
        "layout": _optional(_typed({"cache_type_k": _text, "cache_type_v": _text, "flash_attn": _text,
                                    "swa_full": _flag, "n_gpu_layers": _optional(_text)})),
    }),
    "tokens": _count,
    "bytes": _count,
    "created": _seconds,
    "last_used": _seconds,
    "digest": _text,
    "prompt": _optional(_typed({"units": _count, "digest": _text, "chain": _list_of(_text),
                                "sizes": _list_of(_count)})),
    "tenant": _optional(_text),
    "version": _count,
}


#: Sidecar fields an older sidecar may lack.
_OPTIONAL = ("prompt", "tenant", "version")
#: The format :class:`Sidecar` writes.
SIDECAR_VERSION = 2


class ParkingStore(Protocol):
    """What auto-sessions asks of the place where parked sessions rest.

    Names are file names in the engine's slot directory: the engine saves into
    ``temp_name(key)`` there and restores from ``bin_name(key)`` there. A store that
    keeps files elsewhere too copies them out in :meth:`commit` and back in :meth:`stage`.
    Choose one with the ``auto_sessions_store`` hook.
    """

    directory: Path

    def bin_name(self, key: str) -> str: ...

    def bin_path(self, key: str) -> Path: ...

    def stage(self, key: str) -> bool:
        """Make ``bin_name(key)`` available in the slot directory; False when there is no file."""
        ...

    def sidecar(self, key: str) -> Sidecar | None:
        """The file's sidecar; None when there is no file (never made, removed or pruned)."""
        ...

    def intact(self, key: str, sidecar: Sidecar) -> bool: ...

    def sidecar_problem(self, key: str) -> str | None:
        """Why the conversation's sidecar is refused (:class:`DamagedSidecar`); None when it
        reads or there is none."""
        ...

    def damaged(self) -> list[tuple[str, Path, str]]:
        """``(key, path, why)`` of every session file whose sidecar is refused."""
        ...

    def temp_name(self, key: str) -> str: ...

    def prepare(self) -> int: ...

    def lock(self) -> contextlib.AbstractContextManager[None]:
        """Held around every change of the files and every restore, by the server and by
        ``strata-serve sessions``, so neither sees the other's work half-done."""
        ...

    def lock_without_blocking(self, timeout_s: float) -> contextlib.AbstractAsyncContextManager[None]:
        """:meth:`lock` as the server takes it: never blocking the event loop, and given up
        after ``timeout_s`` (:class:`LockTimeout`); the calls made while it is held take
        :meth:`lock` without waiting."""
        ...

    def commit(self, temp_name: str, key: str, sidecar: Sidecar) -> bool | None:
        """Put a finished save under its name; False when the session was removed by hand
        (``strata-serve sessions rm``) since its state began (``sidecar.created``): the
        save is dropped."""
        ...

    def record_held(self, keys: list[str]) -> None:
        """Record the conversations the server holds in its slots or is running, saved or
        not, for ``strata-serve sessions rm`` (another process). A store without it still
        works; ``rm`` then sees only the parked files."""
        ...

    def describe_engine(self, fingerprint: dict[str, Any]) -> None:
        """Record what the running engine is, for ``strata-serve sessions ls``."""
        ...

    def discard(self, temp_name: str) -> None: ...

    def touch(self, key: str) -> None: ...

    def prune(self, keep: int, max_bytes: int, protect: frozenset[str] = frozenset()) -> list[tuple[str, int]]: ...

    def usage(self) -> tuple[int, int]: ...

    def sessions(self) -> list[tuple[str, Sidecar]]:
        """``(key, sidecar)`` of every parked conversation, newest first."""
        ...

    def bytes_per_token(self, current: dict[str, Any]) -> float | None: ...


class LockTimeout(TimeoutError):
    """The slot directory's lock was held elsewhere for longer than the server waits."""


class SessionStore:
    """The plugin's files in the slot directory: the default :class:`ParkingStore`."""

    def __init__(self, directory: Path):
        self.directory = directory
        self._lock_depth = 0
        self._lock_fd: int | None = None
        #: The server lock (:meth:`claim`), while this process holds it.
        self._claim_fd: int | None = None

    @contextlib.contextmanager
    def lock(self) -> Iterator[None]:
        """An exclusive ``flock`` on the slot directory itself (reentrant in this process),
        waited for as long as it takes: for ``strata-serve sessions``, never on the event
        loop (the server takes it with :meth:`lock_without_blocking`)."""
        if self._lock_depth == 0:
            fd = os.open(self.directory, os.O_RDONLY | os.O_DIRECTORY)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
            except BaseException:
                os.close(fd)
                raise
            self._lock_fd = fd
        self._lock_depth += 1
        try:
            yield
        finally:
            self._unlock()

    @contextlib.asynccontextmanager
    async def lock_without_blocking(self, timeout_s: float) -> AsyncIterator[None]:
        """The same lock, taken without blocking the event loop: tried (``LOCK_NB``) until
        it is free, sleeping in between, for at most ``timeout_s``. A task of this process
        that holds it already shares it (as :meth:`lock` does).

        :raises LockTimeout: when another process (a server whose engine hangs in a
            restore, a ``strata-serve sessions`` command) held it all that time.
        """
        if self._lock_depth == 0:
            fd = os.open(self.directory, os.O_RDONLY | os.O_DIRECTORY)
            try:
                taken = await self._take_lock(fd, timeout_s)
            except BaseException:
                os.close(fd)
                raise
            if taken:
                self._lock_fd = fd
            else:
                os.close(fd)  # another task of this process took it meanwhile: shared
        self._lock_depth += 1
        try:
            yield
        finally:
            self._unlock()

    async def _take_lock(self, fd: int, timeout_s: float) -> bool:
        """True once ``fd`` holds the lock; False when a task of this process took it meanwhile."""
        deadline = time.monotonic() + timeout_s
        pause = 0.005
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return True
            except BlockingIOError:
                if self._lock_depth:
                    return False
            if time.monotonic() >= deadline:
                raise LockTimeout(f"the lock on {self.directory} was held elsewhere (another server, or "
                                   f"strata-serve sessions) for more than {timeout_s:g} s")
            await asyncio.sleep(pause)
            pause = min(pause * 2, 0.05)

    def _unlock(self) -> None:
        self._lock_depth -= 1
        if self._lock_depth == 0 and self._lock_fd is not None:
            fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
            os.close(self._lock_fd)
            self._lock_fd = None

    def bin_name(self, key: str) -> str:
        return f"{PREFIX}{file_key(key)}.bin"

    def bin_path(self, key: str) -> Path:
        return self.directory / self.bin_name(key)

    def restorable(self, key: str) -> bool:
        """A regular file of ours, not a symlink that could lead outside the directory."""
        path = self.bin_path(key)
        return path.is_file() and not path.is_symlink()

    def stage(self, key: str) -> bool:
        """The file is in the slot directory already (or not at all)."""
        return self.restorable(key)

    def intact(self, key: str, sidecar: Sidecar) -> bool:
        """The file is the one that was saved: same size, same sampled digest."""
        path = self.bin_path(key)
        return path.stat().st_size == sidecar.bytes and sample_digest(path) == sidecar.digest

    def sidecar_path(self, key: str) -> Path:
        return self.directory / f"{PREFIX}{file_key(key)}.json"

    def temp_name(self, key: str) -> str:
        return _temp_name(key, ".bin")

    def prepare(self) -> int:
        """Create the directory, claim it for this server (:meth:`claim`), and remove
        temporaries a crash left behind; returns how many.

        :raises DirectoryInUse: when another live server uses the directory.
        """
        make_private_dir(self.directory)
        self.claim()
        removed = 0
        with self.lock():
            for leftover in self.directory.iterdir():
                if TEMP_NAME.fullmatch(leftover.name) and not leftover.is_symlink():
                    leftover.unlink(missing_ok=True)
                    removed += 1
            # A new engine holds nothing a removal by hand was about.
            (self.directory / REMOVED_NAME).unlink(missing_ok=True)
            self.record_held([])
        return removed

    def claim(self) -> None:
        """Hold the directory for this server's lifetime: an exclusive ``flock`` on
        :data:`SERVER_LOCK_NAME`, kept until :meth:`release` or the process ends (the
        kernel lets go of a killed server's, so a stale file never blocks a start).

        A second server would undo the first one's pending removals and save over its
        files; sharing a directory between servers is not supported yet.

        :raises DirectoryInUse: when another live server holds it.
        """
        if self._claim_fd is not None:
            return
        path = self.directory / SERVER_LOCK_NAME
        # Held open read-only: a file open for writing would keep the directory's file
        # system from being remounted read-only while the server runs.
        fd = os.open(path, os.O_RDONLY | os.O_CREAT | os.O_NOFOLLOW, PRIVATE_FILE_MODE)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            try:
                holder = json.loads(os.pread(fd, 256, 0))["pid"]
            except (ValueError, KeyError, TypeError):
                holder = "unknown"
            os.close(fd)
            raise DirectoryInUse(
                f"another strata-serve server (pid {holder}) uses the slot directory {self.directory}; "
                "two servers on one directory would undo each other's removals and save over each "
                "other's files: give this one its own directory (engine.slot_save_path)") from None
        except BaseException:
            os.close(fd)
            raise
        self._claim_fd = fd
        os.fchmod(fd, PRIVATE_FILE_MODE)  # the mode given to open passes through the umask
        with open(path, "w") as handle:  # who holds it, for the next one's message
            json.dump({"pid": os.getpid(), "since": time.time()}, handle)

    def release(self) -> None:
        """Let go of the directory (:meth:`claim`): the server stops."""
        if self._claim_fd is not None:
            os.close(self._claim_fd)  # closing the last descriptor releases the flock
            self._claim_fd = None

    def server_running(self) -> bool:
        """Whether a live server holds the directory (:meth:`claim`), this process's included."""
        try:
            fd = os.open(self.directory / SERVER_LOCK_NAME, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        finally:
            os.close(fd)
        return False

    def record_held(self, keys: list[str]) -> None:
        _write_private_json(self.directory / HELD_NAME, {"keys": sorted(keys), "pid": os.getpid()})

    def held_by_server(self) -> list[str]:
        """The conversations a live server holds in its slots or is running (recorded by
        :meth:`record_held`); none when no server runs."""
        if not self.server_running():
            return []  # what a killed server recorded is held by no one
        try:
            data = json.loads((self.directory / HELD_NAME).read_text())
        except (OSError, ValueError):
            return []
        keys = data.get("keys") if isinstance(data, dict) else None
        return [key for key in keys if isinstance(key, str)] if isinstance(keys, list) else []

    def describe_engine(self, fingerprint: dict[str, Any]) -> None:
        _write_private_json(self.directory / ENGINE_NAME, {"fingerprint": fingerprint, "since": time.time()})

    def engine_description(self) -> dict[str, Any] | None:
        """What :meth:`describe_engine` recorded last, or None."""
        try:
            data = json.loads((self.directory / ENGINE_NAME).read_text())
            return data if isinstance(data, dict) and isinstance(data.get("fingerprint"), dict) else None
        except (OSError, ValueError):
            return None

    def removed_by_hand(self) -> dict[str, float]:
        """Keys removed by hand while a server may have held them, and when."""
        try:
            data = json.loads((self.directory / REMOVED_NAME).read_text())
        except (OSError, ValueError):
            return {}
        return {k: v for k, v in data.items() if isinstance(k, str) and isinstance(v, (int, float))} \
            if isinstance(data, dict) else {}

    def remove_by_hand(self, keys: list[str]) -> list[tuple[str, int]]:
        """Remove these sessions now, and drop a save of any of them that a running server
        has under way or makes next (it may hold one in its slot). Returns ``(key, bytes)``
        of the files removed."""
        removed = []
        with self.lock():
            pending = self.removed_by_hand()
            for key in keys:
                path = self.bin_path(key)
                size = path.stat().st_size if path.is_file() and not path.is_symlink() else 0
                if self.sidecar(key) is not None or size:
                    removed.append((key, size))
                self.remove(key)
                pending[key] = time.time()
            _write_private_json(self.directory / REMOVED_NAME, pending)
        return removed

    def _own(self, ext: str) -> list[tuple[str, Path, Sidecar]]:
        """``(key, path, sidecar)`` of each ``auto-<name>.<ext>`` whose sidecar names its key.

        A name alone proves nothing (an older version let ``/slots`` write any name):
        only a file with our sidecar is ours. Symlinks are never ours.
        """
        found = []
        for path in self.directory.iterdir():
            match = SESSION_NAME.fullmatch(path.name)
            if match is None or match["ext"] != ext or path.is_symlink():
                continue
            key = key_of_file(match["key"])
            sidecar = self.sidecar(key)
            if sidecar is not None and sidecar.key == key:
                found.append((key, path, sidecar))
        return found

    def commit(self, temp_name: str, key: str, sidecar: Sidecar) -> bool:
        """Move a finished save under its real name, private to this user, with its sidecar.

        :returns: False when the session was removed by hand (``strata-serve sessions
            rm``) at or after ``sidecar.created``, when the saved state began: the save is
            dropped (each time: an erase that failed leaves the same state to be saved
            again). A state begun after the removal (the conversation started anew) is
            kept, and the removal is done with.
        :raises OSError: when the file on disk is not the size the engine reported
            (a full disk can leave a short file behind a reported success).
        """
        with self.lock():
            pending = self.removed_by_hand()
            if key in pending:
                if pending[key] >= sidecar.created:
                    self.discard(temp_name)
                    return False
                del pending[key]
                _write_private_json(self.directory / REMOVED_NAME, pending)
            self._commit(temp_name, key, sidecar)
            return True

    def _commit(self, temp_name: str, key: str, sidecar: Sidecar) -> None:
        temp = self.directory / temp_name
        size = temp.stat().st_size
        if sidecar.bytes and size != sidecar.bytes:
            raise OSError(f"{temp_name} holds {size:,} bytes; the engine reported {sidecar.bytes:,}")
        os.chmod(temp, PRIVATE_FILE_MODE)
        sidecar.digest = sample_digest(temp)
        _fsync(temp)  # the data is on disk before the name says it is there
        # The sidecar first: a file is ours only with it, so a crash between the two
        # leaves a sidecar without its file (swept by prune), never a file nobody owns.
        self.write_sidecar(sidecar)
        os.replace(temp, self.bin_path(key))
        _fsync(self.directory)

    def discard(self, temp_name: str) -> None:
        (self.directory / temp_name).unlink(missing_ok=True)

    def write_sidecar(self, sidecar: Sidecar) -> None:
        target = self.sidecar_path(sidecar.key)
        temp = self.directory / _temp_name(sidecar.key, ".json")
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, PRIVATE_FILE_MODE)
        try:
            os.fchmod(fd, PRIVATE_FILE_MODE)  # the mode given to open passes through the umask
            with os.fdopen(fd, "w") as handle:
                json.dump(asdict(sidecar), handle)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(temp, target)
        except BaseException:
            # A full disk fails the write: the temporary would stay until the next start.
            temp.unlink(missing_ok=True)
            raise

    def sidecar(self, key: str) -> Sidecar | None:
        return Sidecar.read(self.sidecar_path(key))

    def sidecar_problem(self, key: str) -> str | None:
        try:
            sidecar = Sidecar.load(self.sidecar_path(key))
        except FileNotFoundError:
            return None
        except (OSError, DamagedSidecar) as exc:
            return str(exc)
        return None if sidecar.key == key else f"it names another conversation ({sidecar.key!r})"

    def damaged(self) -> list[tuple[str, Path, str]]:
        """``(key, path, why)`` of each ``auto-<name>.bin`` beside a sidecar that is refused:
        never restored, pruned or removed (without a sidecar that reads, nothing says the
        file is ours), listed as damaged by ``strata-serve sessions ls``."""
        found = []
        for path in self.directory.iterdir():
            match = SESSION_NAME.fullmatch(path.name)
            if match is None or match["ext"] != "bin" or path.is_symlink():
                continue
            key = key_of_file(match["key"])
            why = self.sidecar_problem(key)
            if why is not None:
                found.append((key, path, why))
        return found

    def touch(self, key: str) -> None:
        sidecar = self.sidecar(key)
        if sidecar is not None:
            sidecar.last_used = time.time()
            self.write_sidecar(sidecar)

    def remove(self, key: str) -> None:
        self.bin_path(key).unlink(missing_ok=True)
        self.sidecar_path(key).unlink(missing_ok=True)

    def files(self) -> list[tuple[str, Path, int, float]]:
        """``(key, path, bytes, last used)`` of every session file, newest first; a file
        whose every time is stamped ahead of the clock (:func:`last_use`) counts as used at
        0, the oldest."""
        found = []
        now = time.time()
        for key, path, sidecar in self._own("bin"):
            try:
                stat = path.stat()
            except FileNotFoundError:
                continue
            used = last_use(stat.st_mtime, sidecar.last_used, now=now)
            found.append((key, path, stat.st_size, 0.0 if used is None else used))
        return sorted(found, key=lambda item: item[3], reverse=True)

    def sessions(self) -> list[tuple[str, Sidecar]]:
        by_key = {key: sidecar for key, _path, sidecar in self._own("bin")}
        return [(key, by_key[key]) for key, *_ in self.files() if key in by_key]

    def prune(self, keep: int, max_bytes: int, protect: frozenset[str] = frozenset()) -> list[tuple[str, int]]:
        """Keep the newest ``keep`` files within ``max_bytes``; returns ``(key, bytes)`` removed.

        ``protect`` names files never removed (the conversation just saved, the one about
        to be restored): they count against the limits, the others make way.
        """
        with self.lock():
            return self._prune(keep, max_bytes, protect)

    def _prune(self, keep: int, max_bytes: int, protect: frozenset[str]) -> list[tuple[str, int]]:
        removed = []
        files = self.files()
        total = sum(size for key, _p, size, _u in files if key in protect)
        kept = sum(1 for key, *_ in files if key in protect)
        for key, _path, size, _used in files:
            if key in protect:
                continue
            total += size
            kept += 1
            if kept > keep or total > max_bytes:
                self.remove(key)
                removed.append((key, size))
                total -= size
                kept -= 1
        for key, sidecar_path, _sidecar in self._own("json"):
            if not self.bin_path(key).exists():
                sidecar_path.unlink(missing_ok=True)
        return removed

    def bytes_per_token(self, current: dict[str, Any]) -> float | None:
        """Engine state bytes per token, from the sidecars of files saved for this model."""
        for key, *_ in self.files():
            sidecar = self.sidecar(key)
            if (sidecar is not None and sidecar.tokens > 0 and same_model(sidecar.fingerprint, current)
                    and sidecar.fingerprint.get("layout") == current.get("layout")):
                return sidecar.bytes / sidecar.tokens
        return None

    def usage(self) -> tuple[int, int]:
        files = self.files()
        return len(files), sum(size for _key, _path, size, _used in files)


#: A time at most this far ahead of the clock is taken as now (a clock corrected by a
#: few seconds since); farther ahead, as written by a clock set wrong.
CLOCK_SLACK_S = 300.0


def as_of(stamp: float, now: float) -> float | None:
    """A time a run wrote (a sidecar's, a file's modification time) as this run takes it:
    never later than ``now``; None when more than :data:`CLOCK_SLACK_S` ahead of it."""
    return None if stamp > now + CLOCK_SLACK_S else min(stamp, now)


def last_use(*stamps: float, now: float) -> float | None:
    """When a file was last used, from its times (its modification time, its sidecar's
    ``last_used``): the latest not stamped ahead (:func:`as_of`); None when all are.

    A run with its clock ahead (a year, say) leaves files that would otherwise stay the
    newest, never pruned, until the clock caught up: they count as the oldest instead,
    and a later use (a restore touches the sidecar) makes them current again.
    """
    taken = [value for value in (as_of(stamp, now) for stamp in stamps) if value is not None]
    return max(taken) if taken else None


def _write_private_json(target: Path, data: Any) -> None:
    temp = target.with_name(f"{TEMP_PREFIX}{uuid.uuid4().hex[:8]}.json")
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, PRIVATE_FILE_MODE)
    try:
        os.fchmod(fd, PRIVATE_FILE_MODE)
        with os.fdopen(fd, "w") as handle:
            json.dump(data, handle)
        os.replace(temp, target)
    except BaseException:
        temp.unlink(missing_ok=True)  # a full disk must not leave one temporary per write
        raise


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
