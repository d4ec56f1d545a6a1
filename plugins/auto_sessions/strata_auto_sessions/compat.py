"""llama.cpp's compatibility policy: whether a saved state can be restored into the
running engine, judged from the file's sidecar and the engine's fingerprint
(:func:`~strata_auto_sessions.fingerprint.engine_fingerprint`) before the engine sees it.

The engine checks only the architecture and its state file's own format version when
it loads a file: another model of the same shape, another KV cache type or
flash-attention setting would load and answer garbage, so they are refused here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from strata_auto_sessions.fingerprint import same_model

if TYPE_CHECKING:
    from strata_auto_sessions.sidecar import Sidecar

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


def incompatibility(sidecar: Sidecar | None, current: dict[str, Any], *,
                    build_range: int = BUILD_RANGE) -> Refusal | None:
    """Whether the file a ``sidecar`` describes can be restored into the engine ``current``
    (an :func:`~strata_auto_sessions.fingerprint.engine_fingerprint`) describes: None when
    it can, else why not.

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
    return (_other_model(saved, current) or _past_the_context(sidecar.tokens, current)
            or _other_layout(saved.get("layout"), current.get("layout"))
            or _other_build(saved.get("build"), current.get("build"), build_range)
            or _no_state_usable(current))


def swa_unusable(current: dict[str, Any]) -> str | None:
    """Why no state of the engine ``current`` (an
    :func:`~strata_auto_sessions.fingerprint.engine_fingerprint`) describes is worth a file:
    its model uses a sliding window and it runs without ``--swa-full``. None when it is
    not so, or not known (the window, or an attached engine's flags)."""
    window, layout = current.get("sliding_window"), current.get("layout")
    flags = _layout_flags(layout)
    if not window or flags is None or flags["swa_full"]:
        return None
    return (f"the model uses a sliding attention window ({window:,} tokens) and the engine runs without "
            f"--swa-full: it would load a saved state, then read the whole conversation again")


def _no_state_usable(current: dict[str, Any]) -> Refusal | None:
    unusable = swa_unusable(current)
    return None if unusable is None else Refusal("swa", unusable)


def _other_model(saved: dict[str, Any], current: dict[str, Any]) -> Refusal | None:
    if "weights" in current and "header_sha256" in saved and "weights" not in saved:
        return Refusal("unjudged", "it was saved by a version that fingerprinted the model's header only, "
                                   "not its weights")
    if not same_model(saved, current):
        return Refusal("other_model", f"it was saved for another model ({saved.get('model')})")
    return None


def _past_the_context(tokens: int, current: dict[str, Any]) -> Refusal | None:
    n_ctx = current.get("n_ctx")
    if isinstance(n_ctx, int) and tokens > n_ctx:
        return Refusal("context", f"it holds {tokens:,} tokens, more than the engine's context "
                                  f"({n_ctx:,}, -c)")
    return None


def _other_layout(saved: dict[str, Any] | None, running: dict[str, Any] | None) -> Refusal | None:
    then, now = _layout_flags(saved), _layout_flags(running)
    if then is None or now is None:
        known = then if now is None else now
        if known is not None and known != _DEFAULT_LAYOUT:
            side = "the file's" if now is None else "the engine's"
            other = "this engine's" if now is None else "the file's"
            return Refusal("unjudged", f"{other} state layout is not known and {side} is not the default "
                                       f"({_describe(known)})")
        return None
    for field, reason in _LAYOUT_REASONS.items():
        if then[field] != now[field]:
            return Refusal(reason, f"{field} differs: saved with {then[field]}, the engine runs with "
                                   f"{now[field]}")
    return None


def _other_build(built: str | None, running: str | None, build_range: int) -> Refusal | None:
    if not built or not running or built == running:
        return None
    apart = None
    if _build_number(built) and _build_number(running):
        apart = abs(_build_number(built) - _build_number(running))  # type: ignore[operator]
    if apart is None or apart > build_range:
        how_far = "cannot tell how far apart" if apart is None else f"{apart} builds apart"
        return Refusal("build", f"it was saved by engine build {built}, the engine is {running} "
                                f"({how_far}; at most {build_range} is taken as compatible)")
    return None


def _layout_flags(layout: dict[str, Any] | None) -> dict[str, Any] | None:
    if layout is None:
        return None
    return {field: layout.get(field, default) for field, default in _DEFAULT_LAYOUT.items()}


def _build_number(build: str) -> int | None:
    match = re.match(r"b(\d+)", build)
    number = int(match.group(1)) if match else 0
    return number or None  # b0: a build without a number (built outside llama.cpp's git)


def _describe(layout: dict[str, Any]) -> str:
    return (f"-ctk {layout['cache_type_k']} -ctv {layout['cache_type_v']} -fa {layout['flash_attn']}"
            + (" --swa-full" if layout["swa_full"] else ""))
