"""Fixtures for auto-sessions tests: a server with the plugin, conversations long enough to park."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

import strata_auto_sessions

from .shared_fixtures import S3_ENV, make_tier, new_bucket

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
    for name, value in {**S3_ENV, "AWS_ENDPOINT_URL": s3_server}.items():
        monkeypatch.setenv(name, value)
    return s3_server


@pytest.fixture(params=["directory", "s3"])
async def shared_url(request: pytest.FixtureRequest, tmp_path, s3_env: str) -> str:
    """A shared tier's URL, once for each kind: a directory of the test's own, and a bucket
    of its own on the S3 server."""
    if request.param == "directory":
        (tmp_path / "shared").mkdir()
        return f"file://{tmp_path / 'shared'}"
    return f"s3://{await new_bucket(s3_env)}/strata"


@pytest.fixture(params=["directory", "s3"])
async def tier(request: pytest.FixtureRequest, tmp_path, s3_server: str, monkeypatch: pytest.MonkeyPatch):
    """A shared tier itself, once for each kind, closed after the test (a test module of
    replicas has a ``tier`` of its own)."""
    for name, value in S3_ENV.items():
        monkeypatch.setenv(name, value)
    made = await make_tier(request.param, tmp_path, s3_server)
    yield made
    await made.close()
