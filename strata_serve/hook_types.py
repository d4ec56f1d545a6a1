"""The objects hooks receive: one request, its outcome, and an engine error.

These are plain dataclasses so plugin authors can build them in their own tests.
"""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal
from collections.abc import Mapping

from strata_serve.timing import Timeline

if TYPE_CHECKING:
    from strata_serve.api.registry import Api

_ids = itertools.count(1)


@dataclass
class StrataRequest:
    """One client request as the hooks see it.

    ``route`` names the API (:class:`strata_serve.Api`) it came through: ``chat``
    (``/v1/chat/completions``), ``completion`` (``/v1/completions``), ``messages``
    (Anthropic's ``/v1/messages``), ``responses`` (OpenAI's ``/v1/responses``),
    ``embeddings`` (``/v1/embeddings``, never keyed), ``infill`` (the engine's ``/infill``)
    or a plugin's API's own name (a slot action by hand is no request: see
    ``Service.slot_action``). ``api`` is that API's declaration; built without one, a
    request takes the built-in API its ``route`` names, and an unknown name is refused.
    ``body`` is the validated JSON body exactly as it will be sent to the engine;
    ``state`` is a scratch dict for plugins to pass data from ``pre_request`` to
    ``post_request`` (key it by your plugin's name).
    """

    route: str
    body: dict[str, Any]
    headers: Mapping[str, str] = field(default_factory=dict)
    stream: bool = False
    #: The conversation key chosen by the ``conversation_key`` hook, or None.
    conversation_key: str | None = None
    #: True when the key names one conversation because the client or the API said so
    #: (a session id the client sent, a Responses ``prompt_cache_key``, ``/infill``'s one
    #: conversation); False when it is a guess from the prompt (the opening's hash), which
    #: several conversations may share. Set by the keying plugin whose key it is, in its
    #: ``conversation_key`` hook; the core clears it when no key is taken.
    conversation_named: bool = False
    #: Name of the API-key holder that sent the request, when keys are configured.
    tenant: str | None = None
    id: int = field(default_factory=lambda: next(_ids))
    state: dict[str, Any] = field(default_factory=dict)
    #: The engine slot the request runs in.
    slot: int = 0
    #: False when the engine chooses the slot itself: on a multi-slot engine, a route
    #: the backend cannot place in a given slot (``Engine.pinned_routes``). The service
    #: then holds every slot for it, and learns from the engine afterwards which slot
    #: ran it (``slot`` is set to that one before ``post_request``).
    pinned: bool = True
    #: Tokens a plugin restored into the slot for this request (0: none).
    restored_tokens: int = 0
    #: True when the slot already held this request's conversation as it was sent.
    found_in_slot: bool = False
    #: Where its conversation's state came from, as the core decided it
    #: (:func:`strata_serve.state_source`): set as it is sent, and once the engine answered
    #: (``engine`` becomes ``ram`` or ``none``); None until it is sent. ``X-Strata-State``
    #: says it, and a stats plugin counts it.
    state_source: str | None = None
    #: The API the request came through: how its conversation opens, its prompt's units.
    api: Api | None = field(default=None, repr=False, compare=False)
    #: Where its time went outside the engine (:mod:`strata_serve.timing`): the core's spans
    #: and the plugins' (:func:`strata_serve.span`), sent back in ``Server-Timing``.
    timeline: Timeline = field(default_factory=Timeline, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.api is not None:
            if self.api.route != self.route:
                raise ValueError(f"route {self.route!r} is not the route of {self.api.path} ({self.api.route!r})")
            return
        from strata_serve.api.registry import builtin

        api = builtin().by_route.get(self.route)
        if api is None:
            raise ValueError(f"no API has the route {self.route!r} (the built-in ones: "
                             f"{', '.join(sorted(builtin().routes))}); give a plugin's API as api=")
        self.api = api


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
class Outcome:
    """How a request ended, handed to ``post_request``.

    ``status`` is ``"ok"`` when the engine answered with a 2xx, ``"error"`` when it
    answered otherwise or could not be reached, and ``"cancelled"`` when the client
    went away before the answer was complete.
    """

    status: Literal["ok", "error", "cancelled"]
    http_status: int | None = None
    #: What the answer cost (:class:`Timings`), read by the engine backend; None when
    #: the engine said nothing of it (an error, a cancel before the end).
    timings: Timings | None = None
    usage: dict[str, Any] | None = None
    error: str | None = None
    duration_ms: float = 0.0

    @property
    def prompt_tokens(self) -> int | None:
        """Prompt tokens of the request: reused plus prefilled (None: not known)."""
        return None if self.timings is None else self.timings.prompt_tokens

    @property
    def context_tokens(self) -> int | None:
        """Tokens the slot holds after this request: prompt plus generated."""
        return None if self.timings is None else self.timings.context_tokens


class KeyRefused(Exception):
    """Raised by a ``conversation_key`` implementation to refuse a request outright.

    For input the client controls and got wrong (a malformed session header, say):
    the core answers 400 in the OpenAI error shape, naming ``param``, and the
    request is never queued or keyed.
    """

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class Verdict(str, enum.Enum):
    """What an engine error means, as decided by a backend quirk plugin."""

    #: The held state had nothing durable (e.g. a cancelled request's provisional
    #: state the engine refuses to save): it is safe to restore over it.
    PROVISIONAL = "provisional"
    #: This engine cannot do the operation at all: stop trying and say so once.
    UNSUPPORTED = "unsupported"
    #: A passing failure: the same call may work if tried again.
    RETRY = "retry"
    #: The operation must not be attempted (e.g. saving an empty slot): skip it.
    SKIP = "skip"


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
