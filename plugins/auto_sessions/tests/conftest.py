"""Fixtures for auto-sessions tests: a server with the plugin, conversations long enough to park."""

from __future__ import annotations

import pytest

import strata_auto_sessions

MIN_TOKENS = 100


@pytest.fixture
def auto_settings(strata_settings_factory):
    def make(engine=None, **plugin_config):
        config = {"min_tokens": MIN_TOKENS, **plugin_config}
        return strata_settings_factory(plugins={"auto_sessions": config}, engine=engine or {})

    return make


@pytest.fixture
def auto_client(strata_client_factory, auto_settings):
    """``await auto_client(*more_plugins, engine={...}, **plugin_config)``."""

    async def make(*plugins, engine=None, **plugin_config):
        return await strata_client_factory(strata_auto_sessions, *plugins,
                                           settings=auto_settings(engine, **plugin_config))

    return make
