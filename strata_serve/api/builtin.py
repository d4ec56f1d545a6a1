"""The APIs every server speaks, and the factory of one server's registry of them.

The built-in declarations (:mod:`~strata_serve.api.openai`, :mod:`~strata_serve.api.responses`,
:mod:`~strata_serve.api.anthropic`, :mod:`~strata_serve.api.llama`) are gathered here;
:func:`server_apis` builds a server's registry from them and those its plugins add
(``register_apis``), and the app passes it down: to the routes, the error shapes, each
request (``StrataRequest.api``). Nothing below this module reads a registry it was not given.
"""

from __future__ import annotations

import functools
import logging
from typing import TYPE_CHECKING

from strata_serve.api import anthropic, llama, openai, responses
from strata_serve.api.registry import Api, Apis
from strata_serve.hook_calls import call_each_sync

if TYPE_CHECKING:
    import pluggy

    from strata_serve.config import Settings

log = logging.getLogger("strata_serve.api")

#: The built-in declarations, in the order their paths are mounted.
BUILTIN_APIS: tuple[Api, ...] = (*openai.APIS, *responses.APIS, *anthropic.APIS, *llama.APIS)

#: The engine's paths the built-in APIs are relayed to, each declared once by its API; a
#: backend declares in ``routes`` which of them it serves. (``/slots``, ``/health``,
#: ``/openapi.json`` and plugins' routes are the core's own, not relayed, so not listed.)
ENGINE_ROUTES: frozenset[str] = frozenset(api.engine_path for api in BUILTIN_APIS)


@functools.cache
def builtin() -> Apis:
    """The registry of the built-in APIs alone (a plugin's test, ``/openapi.json``'s shapes).
    Do not add to it: :func:`server_apis` copies it."""
    return Apis(BUILTIN_APIS)


def server_apis(pm: pluggy.PluginManager, settings: Settings) -> Apis:
    """One server's registry: the built-in APIs and those the plugins add (``register_apis``);
    an API that cannot be added is refused, logged with its plugin's name."""
    apis = Apis(BUILTIN_APIS)
    for name, added in call_each_sync(pm, "register_apis", settings=settings):
        for api in added or ():
            try:
                apis.add(api)
            except ValueError as exc:
                log.error("[strata] plugin %s: its API was refused: %s", name, exc)
    return apis

