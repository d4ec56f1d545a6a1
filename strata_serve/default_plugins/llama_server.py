"""The default engine backend: llama.cpp's llama-server, started and supervised, or attached.

A plugin for another engine implements ``engine_backend`` too and answers first; this
one answers last.
"""

from __future__ import annotations

import strata_serve
from strata_serve.config import Settings
from strata_serve.engine.llama_server import LlamaServer


@strata_serve.hookimpl(trylast=True)
def engine_backend(settings: Settings) -> LlamaServer:
    # The server binds its port once the engine is up: the engine, left to pick its own, must
    # not take that one meanwhile.
    return LlamaServer(settings.engine, avoid_ports=frozenset({settings.server.port}) - {0})
