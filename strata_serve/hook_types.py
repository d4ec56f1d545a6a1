"""The objects hooks receive: one request, its outcome, a keying plugin's answer, and an engine error.

These are plain dataclasses so plugin authors can build them in their own tests. A
request is given the API it came through (``api=``, from the server's registry of APIs):
it looks nothing up itself. Built without one (a plugin's test), readers that need its
API take the built-in one its ``route`` names (:func:`strata_serve.api_of`).

Who writes what of a request, each field one writer: the relay builds it; the core's
keying step (:mod:`strata_serve.keying`, through ``Service.conversation_key``) sets
``conversation_key`` and ``conversation_named`` from the keying plugin's answer; the
service's request path (``service.py``) sets its placement, ``slot`` and ``pinned``,
and what its slot held (``found_in_slot``, ``state_source``); a restore made for it
(``Service.restore_slot``, ``slot_calls.py``) sets ``restored_tokens``; the prompt's tokens,
once asked, are kept by ``tokens_ahead.py`` (``Service.prompt_tokens`` reads them). Plugins
read them, and keep their own data in ``state``.
"""

from __future__ import annotations

import asyncio
import enum
import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal
from collections.abc import Mapping

from strata_serve.engine.results import EngineError, Timings, token_count
from strata_serve.timing import Timeline

if TYPE_CHECKING:
    from strata_serve.api.registry import Api

__all__ = ["ConversationKey", "EngineError", "KeyRefused", "Outcome", "StrataRequest", "Timings", "Verdict",
           "token_count"]

_ids = itertools.count(1)


@dataclass
class StrataRequest:
    """One client request as the hooks see it.

    ``route`` names the API (:class:`strata_serve.Api`) it came through: ``chat``
    (``/v1/chat/completions``), ``completion`` (``/v1/completions``), ``messages``
    (Anthropic's ``/v1/messages``), ``responses`` (OpenAI's ``/v1/responses``),
    ``embeddings`` (``/v1/embeddings``, never keyed), ``infill`` (the engine's ``/infill``)
    or a plugin's API's own name (a slot action by hand is no request: see
    ``Service.slot_action``). ``api`` is that API's declaration, given by whoever builds
    the request (the relay, from the server's registry); built without one, readers take
    the built-in API its ``route`` names (:func:`strata_serve.api_of`).
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
    #: several conversations may share. Recorded by the core from the keying plugin's
    #: answer (:class:`ConversationKey`); a plugin returns it, never sets it.
    conversation_named: bool = False
    #: Name of the API-key holder that sent the request, when keys are configured.
    tenant: str | None = None
    id: int = field(default_factory=lambda: next(_ids))
    state: dict[str, Any] = field(default_factory=dict)
    #: The engine slot the request runs in.
    slot: int = 0
    #: False when the engine chooses the slot itself: on a multi-slot engine, a route
    #: the backend cannot place in a given slot (``Engine.pinned_routes``). Set by the
    #: service from its claim (:func:`strata_serve.slot_choice.claim_for`); it then holds
    #: every slot for it, and learns from the engine afterwards which slot ran it (``slot``
    #: is set to that one before ``post_request``).
    pinned: bool = True
    #: True when the service sent it to the engine ahead of its turn (``may_go_ahead``):
    #: its ``pre_request`` runs while the engine may be answering it, and must leave the
    #: slot alone. Set by the service alone.
    sent_ahead: bool = False
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
    #: The engine's answer for its prompt's tokens, once asked (:mod:`strata_serve.tokens_ahead`:
    #: read it with ``Service.prompt_tokens``).
    _tokens: asyncio.Future[list[int] | None] | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.api is not None and self.api.route != self.route:
            raise ValueError(f"route {self.route!r} is not the route of {self.api.path} ({self.api.route!r})")


@dataclass(frozen=True)
class ConversationKey:
    """What a keying plugin answers (the ``conversation_key`` hook): a key, and whether it
    names one conversation.

    ``named``: True when the client or the API named the conversation (a session id the
    client sent), False when the key is a guess from the prompt that several conversations
    may share (auto-sessions then keeps a file for each conversation it finds under it).
    A plain ``str`` answered by the hook is a guess: ``ConversationKey(key)``.
    """

    key: str
    named: bool = False


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
