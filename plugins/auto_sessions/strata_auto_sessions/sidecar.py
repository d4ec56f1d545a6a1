"""The sidecar: what auto-sessions knows of a session file (``auto-<name>.json``), how
it is written (all or nothing), and how it is read: every field of the type it is
written with, or refused as damaged (:class:`DamagedSidecar`).

A session file is ours only with its sidecar (:mod:`strata_auto_sessions.naming`), so
a file beside a damaged one is never restored, pruned or removed.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any
from collections.abc import Callable

from strata_serve import PRIVATE_FILE_MODE

from strata_auto_sessions.naming import fresh_temp_name

#: The format :class:`Sidecar` writes.
SIDECAR_VERSION = 2


@dataclass
class Sidecar:
    key: str
    fingerprint: dict[str, Any]
    tokens: int
    bytes: int
    created: float
    last_used: float
    #: :func:`~strata_auto_sessions.digests.sample_digest` of the state file when it was saved.
    digest: str
    #: What the saved state was made from: ``{"units": n, "digest": ...}`` of the last
    #: request's prompt (see :func:`strata_auto_sessions.prompts.prompt_signature`), with
    #: its ``chain`` of digests, one per message boundary, where recorded.
    prompt: dict[str, Any] | None = None
    #: The tenant whose conversation it is (None: no tenants, or saved before this was recorded).
    tenant: str | None = None
    #: The sidecar's format: 1 had no state layout in ``fingerprint``, 2 has it.
    version: int = 1
    #: Which of the conversations under ``key`` it is (``auto-<name>.<sibling>.bin``; 0, the
    #: plain name, for the first and for every sidecar written before there were siblings).
    sibling: int = 0

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

    def write(self, path: Path, *, sync: bool = True) -> None:
        """Write it at ``path``, private to this user, whole or not at all: through a
        temporary beside it, synced (unless ``sync`` is False: the caller syncs it later),
        then renamed over the old one."""
        # One C call for the text; json.dump writes piece by piece.
        write_private(path, path.with_name(fresh_temp_name(self.key, ".json")), json.dumps(asdict(self)).encode(),
                      sync=sync)


def write_private(path: Path, temp: Path, raw: bytes, *, sync: bool = False) -> None:
    """``raw`` at ``path``, private to this user whatever the umask, whole or not at all:
    written to ``temp`` (a new file), synced when ``sync``, then renamed over ``path``.
    A failed write (a full disk) removes ``temp``: no temporary is left per write."""
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, PRIVATE_FILE_MODE)
    try:
        with os.fdopen(fd, "wb") as handle:
            os.fchmod(handle.fileno(), PRIVATE_FILE_MODE)  # the mode given to open passes through the umask
            handle.write(raw)
            handle.flush()
            if sync:
                os.fsync(handle.fileno())
        os.replace(temp, path)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise


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
    "sibling": _count,
}


#: Sidecar fields an older sidecar may lack.
_OPTIONAL = ("prompt", "tenant", "version", "sibling")
