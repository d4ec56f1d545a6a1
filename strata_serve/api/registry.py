"""Every API the server speaks, each declared once (:class:`Api`), and the registry of them (:class:`Apis`).

A module per API declares its paths: :mod:`~strata_serve.api.openai` (chat, completions,
embeddings, the model list), :mod:`~strata_serve.api.responses`,
:mod:`~strata_serve.api.anthropic` (Messages), :mod:`~strata_serve.api.llama` (the
engine's own routes), gathered in :mod:`~strata_serve.api.builtin`; a plugin adds its own
through the ``register_apis`` hook. One server's registry is built there
(:func:`~strata_serve.api.builtin.server_apis`) and passed down: from it come the app's
routes (``api/app.py``), the API each request carries (``StrataRequest.api``), the error
shape of every path (``api/errors.py``) and ``/openapi.json`` (``api/openapi.py``).
"""

from __future__ import annotations

import functools
import logging
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from collections.abc import Awaitable, Callable, Iterable, Mapping

from pydantic import BaseModel

from strata_serve.api.checks import MediaReader, media_words
from strata_serve.api.conversation import Opening
from strata_serve.api.errors import OPENAI_ERRORS, ErrorShape
from strata_serve.api.formats import OPENAI, ApiFormat

if TYPE_CHECKING:
    from aiohttp import web

log = logging.getLogger("strata_serve.api")

Body = dict[str, Any]
#: A route name no API may take: the core's slot actions by hand (``/slots/{slot_id}``), no request's.
SLOTS_ROUTE = "slots"
#: The core's own paths, which no API may take.
CORE_PATHS = frozenset({"/health", "/slots", "/slots/{slot_id}", "/openapi.json"})
_ROUTE_NAME = re.compile(r"[a-z][a-z0-9_]{0,31}")


@dataclass(frozen=True, eq=False)
class Api:
    """One path of an API, declared once: everything the core needs to serve it.

    A request on a path with a ``route`` runs in a slot, through the FIFO, relayed to the
    engine's ``engine_path``; the plugins see it as a :class:`~strata_serve.StrataRequest`
    whose ``route`` is that name. A path without one touches no slot (it reads the
    model's vocabulary or settings) and is answered outside the FIFO.
    """

    #: Where clients send it (``/v1/chat/completions``).
    path: str
    #: What it does, in a few words (its summary in ``/openapi.json``).
    summary: str
    method: str = "POST"
    #: The pydantic model the body is validated against (None: no body). Its
    #: ``message_fields`` (a ClassVar) name the fields holding the conversation's messages
    #: or items: counted before validation, searched for media.
    schema: type[BaseModel] | None = None
    #: The name its requests carry (``StrataRequest.route``): lower-case letters, digits
    #: and ``_``. None: answered outside the FIFO.
    route: str | None = None
    #: False for requests that hold no conversation (embeddings): no keying plugin is asked.
    keyed: bool = True
    #: Where the engine's numbers are, how a stream ends, how an error is told (its
    #: :class:`~strata_serve.api.errors.ErrorShape`, on this path and unknown paths beneath it).
    format: ApiFormat = OPENAI
    #: The engine's path it is relayed to (default: ``path``); a backend serves it when its
    #: ``routes`` name it.
    engine_path: str = ""
    #: How its conversation opens (:func:`strata_serve.opening` reads it), from the body;
    #: None: it holds no conversation.
    opening: Callable[[Body], Opening | None] | None = None
    #: A key the body itself gives its conversation, which the built-in keying uses before
    #: reading the opening (the Responses API's ``prompt_cache_key``); None from it: none given.
    given_key: Callable[[Body], str | None] | None = None
    #: What its prompt is made of, in order (:func:`strata_serve.prompt_units`; auto-sessions
    #: digests them): a list of units (system prompt, messages), or a prompt's text.
    prompt_units: Callable[[Body], list[Any] | str] | None = None
    #: Its media parts, by ``type``: each gives the modality it needs and the URL or data it
    #: names (``api/checks.py`` refuses what the model cannot take or must not fetch).
    media: Mapping[str, MediaReader] = field(default_factory=dict)
    #: Turns the validated body into what the engine is sent (Anthropic's: billing lines out).
    prepare: Callable[[Body], Body] | None = None
    #: The body's fields that bound how many tokens the engine generates (the first is set
    #: when the body sets none); empty: its generation is not bounded by strata-serve. An API
    #: that declares them may run in the side slot (``strata_serve/side_lane.py``), which
    #: lowers each one set above the room there, and sets the first when none is.
    generation_limit: tuple[str, ...] = ()
    #: A check of the validated body that needs the engine (``/detokenize``'s token ids):
    #: ``await check(request, body)`` raises :class:`~strata_serve.APIError` to refuse it.
    check: Callable[[web.Request, Body], Awaitable[None]] | None = None

    def __post_init__(self) -> None:
        if not self.engine_path:
            object.__setattr__(self, "engine_path", self.path)
        object.__setattr__(self, "method", self.method.upper())

    @functools.cached_property
    def media_words(self) -> re.Pattern[bytes]:
        """What a body's bytes hold when they may hold one of its media parts."""
        return media_words(self.media)

    @property
    def message_fields(self) -> tuple[str, ...]:
        return getattr(self.schema, "message_fields", ())

    @property
    def errors(self) -> ErrorShape:
        return self.format.errors


class Apis:
    """The APIs one server speaks: the built-in ones, then those its plugins add."""

    def __init__(self, apis: Iterable[Api] = ()) -> None:
        self.all: list[Api] = []
        self.by_route: dict[str, Api] = {}
        self._paths: set[tuple[str, str]] = set()
        self._exact: dict[str, ErrorShape] = {}
        self._beneath: list[tuple[str, ErrorShape]] = []
        for api in apis:
            self.add(api)

    def add(self, api: Api) -> None:
        """Add one API.

        :raises ValueError: its path is the core's own or another API's, or its route name
            is not a name or is taken.
        """
        if not isinstance(api, Api):
            raise ValueError(f"{api!r} is not a strata_serve.Api")
        if not api.path.startswith("/") or api.path in CORE_PATHS or api.path.startswith("/health/"):
            raise ValueError(f"{api.path!r} is not a path an API may take")
        if (api.method, api.path) in self._paths:
            raise ValueError(f"{api.method} {api.path} is another API's")
        if api.route is not None:
            if not _ROUTE_NAME.fullmatch(api.route) or api.route == SLOTS_ROUTE:
                raise ValueError(f"route name {api.route!r}: 1 to 32 of a-z, 0-9 and _, starting with a letter, "
                                 f"not {SLOTS_ROUTE!r}")
            if api.route in self.by_route:
                raise ValueError(f"route name {api.route!r} is {self.by_route[api.route].path}'s")
        self.all.append(api)
        self._paths.add((api.method, api.path))
        if api.route is not None:
            self.by_route[api.route] = api
        self._exact.setdefault(api.path, api.errors)
        if api.errors is not OPENAI_ERRORS:
            self._beneath.append((api.path + "/", api.errors))
            self._beneath.sort(key=lambda pair: -len(pair[0]))

    def __iter__(self):
        return iter(self.all)

    @property
    def routes(self) -> frozenset[str]:
        """The route names a request may carry: every API's."""
        return frozenset(self.by_route)

    def errors_at(self, path: str) -> ErrorShape:
        """The error shape of the API at ``path``, or of the one whose path ``path`` is beneath
        (an unknown path under ``/v1/messages`` answers as Anthropic's); OpenAI's elsewhere."""
        shape = self._exact.get(path)
        if shape is not None:
            return shape
        for prefix, shape in self._beneath:
            if path.startswith(prefix):
                return shape
        return OPENAI_ERRORS
