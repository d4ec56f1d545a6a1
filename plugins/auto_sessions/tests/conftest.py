"""Fixtures for auto-sessions tests: a server with the plugin, conversations long enough to park."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

import strata_auto_sessions

SHARED_S3_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}

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


@pytest.fixture(scope="session")
def s3_server() -> Iterator[str]:
    """A standalone S3 API server on 127.0.0.1 (moto's): its endpoint URL."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    try:
        yield f"http://{host}:{port}"
    finally:
        server.stop()


@pytest.fixture
def s3_env(monkeypatch: pytest.MonkeyPatch, s3_server: str) -> str:
    """The usual AWS variables pointing at the loopback server: its endpoint."""
    for name, value in {**SHARED_S3_ENV, "AWS_ENDPOINT_URL": s3_server}.items():
        monkeypatch.setenv(name, value)
    return s3_server
