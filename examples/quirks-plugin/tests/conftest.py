"""A test double of the Strata Metal engine, and a server running auto-sessions on it.

No Metal machine exists here. The double is the real llama-server (every answer
is real) but for the one behaviour the plugin is about.
"""

from __future__ import annotations

import asyncio
import contextlib

import pytest

import strata_auto_sessions
from strata_serve import EngineError
from strata_serve.engine import LlamaServer

REFUSAL = "invalid checkpoint running-state payload"
#: Conversations of the tests are longer than this: they are parked.
MIN_TOKENS = 100


class StrataMetalBeforeFixDouble(LlamaServer):
    """Test double: the Strata Metal engine before its session-file fix.

    After a completion that was cancelled mid-answer, the slot holds that
    request's provisional state, and ``save()`` is refused with HTTP 500 the way
    that engine refuses it. Everything else is the real llama-server.
    """

    def __init__(self, settings):
        super().__init__(settings)
        self.cancelled_last = False
        self.refused_saves = 0

    async def request(self, method, path, json=None, **options):
        if options.get("op") == "completion":
            self.cancelled_last = False
        return await super().request(method, path, json, **options)

    @contextlib.asynccontextmanager
    async def stream(self, path, json):
        self.cancelled_last = False
        async with super().stream(path, json) as reply:
            try:
                yield reply
            except asyncio.CancelledError:  # the client went away mid-answer
                self.cancelled_last = True
                raise

    async def save(self, filename, slot=0):
        if self.cancelled_last:
            self.refused_saves += 1
            raise EngineError(op="save", status=500, message=REFUSAL,
                              body={"error": {"code": 500, "message": REFUSAL, "type": "server_error"}})
        return await super().save(filename, slot)


@pytest.fixture
def metal_client(strata_client_factory, strata_settings_factory):
    """``await metal_client(*quirk_plugins, **plugins_config)``: auto-sessions on the test double."""

    async def make(*plugins, **plugins_config):
        settings = strata_settings_factory(plugins={"auto_sessions": {"min_tokens": MIN_TOKENS}, **plugins_config})
        double = StrataMetalBeforeFixDouble(settings.engine)  # built like the real one, from the settings
        return await strata_client_factory(strata_auto_sessions, *plugins, settings=settings, engine=double)

    return make
