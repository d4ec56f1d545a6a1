"""What a request's conversation is made of, read through its API: how it opens, its prompt's units.

Each API declares both (:class:`~strata_serve.api.registry.Api`: ``opening`` and
``prompt_units``); plugins ask here with the request and never need to know which API it
was. A request carries the API it came through (``request.api``, given by the relay); one
built without it (a plugin's test) is read as the built-in API its ``route`` names.
"""

from __future__ import annotations

from typing import Any

from strata_serve.api.builtin import builtin
from strata_serve.api.conversation import Opening
from strata_serve.api.registry import Api
from strata_serve.hook_types import StrataRequest


def api_of(request: StrataRequest) -> Api | None:
    """The API ``request`` came through: its own, else the built-in one its route names
    (None: no built-in API has that route)."""
    return request.api if request.api is not None else builtin().by_route.get(request.route)


def opening(request: StrataRequest | str, body: dict[str, Any] | None = None) -> Opening | None:
    """How a request's conversation opens; None for an API that holds no conversation.

    Pass the request: its API (a plugin's too) says how to read it. ``opening(route, body)``
    reads a body as the built-in API named ``route`` would.
    """
    if isinstance(request, str):
        api = builtin().by_route.get(request)
        given = body if body is not None else {}
    else:
        api, given = api_of(request), request.body
    if api is None or api.opening is None:
        return None
    return api.opening(given)


def prompt_units(request: StrataRequest) -> list[Any] | str:
    """What a request's prompt is made of, in order, as its API declares: its
    instructions or system prompt and its messages or items (a list), or a prompt's
    text (a string); empty for an API that declares none."""
    api = api_of(request)
    if api is None or api.prompt_units is None:
        return []
    return api.prompt_units(request.body)
