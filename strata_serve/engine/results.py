"""What an engine answered, in strata-serve's own words: what an answer cost, a failed call.

The lowest module of the core (docs/architecture.md): it imports nothing of strata-serve.
Engine backends return these (:mod:`strata_serve.engine.base`), and the hooks receive
them (:mod:`strata_serve.hook_types` gives them to plugins under the same names).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any
from collections.abc import Mapping


def token_count(value: Any) -> int | None:
    """``value`` if it is a count an engine could report (an int, not a bool, not negative)."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


@dataclass(frozen=True)
class Timings:
    """The work one answer cost, in the same terms whatever the backend.

    Each engine backend reads its own numbers into this (``Engine.read_timings``:
    llama-server's ``timings`` object has ``cache_n``, ``prompt_n``, ``predicted_n``,
    ``prompt_ms`` and ``predicted_ms``); where an API reports ``usage`` alone (Anthropic's
    Messages, the Responses API's plain answers), the token counts come from it and the
    milliseconds are None. ``raw`` keeps what the engine sent, for a plugin that knows
    the backend and wants more.
    """

    #: Prompt tokens the engine found already in the slot and did not read again.
    reused: int = 0
    #: Prompt tokens the engine read (prefilled) for this answer.
    prefilled: int = 0
    #: Tokens generated.
    generated: int = 0
    #: Milliseconds spent prefilling the ``prefilled`` tokens, when the engine said.
    prefill_ms: float | None = None
    #: Milliseconds spent generating, when the engine said.
    generate_ms: float | None = None
    raw: Mapping[str, Any] | None = field(default=None, compare=False, repr=False)

    @property
    def prompt_tokens(self) -> int:
        """The whole prompt: reused plus prefilled."""
        return self.reused + self.prefilled

    @property
    def context_tokens(self) -> int:
        """Tokens the slot holds after the answer: prompt plus generated."""
        return self.prompt_tokens + self.generated


@dataclass
class EngineError(Exception):
    """An engine call that failed: which operation, the HTTP status, and the message."""

    op: str
    message: str
    status: int | None = None
    body: Any = None

    def __str__(self) -> str:
        where = f"HTTP {self.status}" if self.status is not None else "no answer"
        return f"engine {self.op} failed ({where}): {self.message}"
