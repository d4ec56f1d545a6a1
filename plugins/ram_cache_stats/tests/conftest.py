"""Fixtures for ram-cache-stats tests: a server with the plugin (and auto-sessions when asked)."""

from __future__ import annotations

import pytest

import strata_auto_sessions
import strata_ram_cache_stats

#: Conversations here are about 750 tokens: long enough for auto-sessions to park.
AUTO_SESSIONS_MIN_TOKENS = 100


@pytest.fixture
def stats_client(strata_client_factory, strata_settings_factory):
    """``await stats_client(auto_sessions=False, engine={...}, server={...}, **plugin_config)``;
    ``auto_sessions`` may be its settings (beside ``min_tokens``)."""

    async def make(*, auto_sessions: bool | dict = False, engine=None, server=None, **plugin_config):
        plugins = {"ram_cache_stats": plugin_config}
        modules = [strata_ram_cache_stats]
        if auto_sessions:
            extra = auto_sessions if isinstance(auto_sessions, dict) else {}
            plugins["auto_sessions"] = {"min_tokens": AUTO_SESSIONS_MIN_TOKENS, **extra}
            modules.insert(0, strata_auto_sessions)
        settings = strata_settings_factory(plugins=plugins, engine=engine or {}, server=server or {})
        return await strata_client_factory(*modules, settings=settings)

    return make
