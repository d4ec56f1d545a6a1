"""Plugin discovery, toggles, listing, configuration refusal and added routes."""

import logging
import subprocess
import sys

import pytest
from click.testing import CliRunner

import strata_serve
from strata_serve.cli import cli
from strata_serve.config import ConfigError, Settings
from strata_serve.plugins import first_result, get_plugin_manager
from strata_serve.testing import MemoryBackend, assert_openai_error
from tests.hook_scenarios import HOOKS, SCENARIOS, Env, client_factory_for, hook_plugin


@pytest.fixture(scope="module")
def probe_site(tmp_path_factory):
    """The test distribution, installed by pip into a directory of its own."""
    from pathlib import Path

    import shutil

    target = tmp_path_factory.mktemp("site")
    # Build from a copy: a build leaves files behind in its source directory.
    source = shutil.copytree(Path(__file__).parent / "plugin_dist", tmp_path_factory.mktemp("src") / "dist")
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
         "--target", str(target), str(source)],
        check=True,
    )
    return target


@pytest.fixture
def probe_installed(probe_site, monkeypatch):
    monkeypatch.syspath_prepend(str(probe_site))
    yield
    sys.modules.pop("strata_entrypoint_probe", None)


def names(pm):
    return {name for name, plugin in pm.list_name_plugin() if plugin is not None}


def test_entry_point_plugins_load_and_can_be_turned_off(probe_installed):
    assert "entrypoint_probe" in names(get_plugin_manager(Settings()))
    off_in_config = Settings(plugins={"entrypoint_probe": {"enabled": False}})
    assert "entrypoint_probe" not in names(get_plugin_manager(off_in_config))
    off_for_a_run = Settings(disable_plugins=["entrypoint_probe"])
    assert "entrypoint_probe" not in names(get_plugin_manager(off_for_a_run))


def test_the_default_key_plugin_is_an_ordinary_plugin():
    assert "opening_key" in names(get_plugin_manager(Settings(), entrypoints=False))
    off = Settings(disable_plugins=["opening_key"])
    assert "opening_key" not in names(get_plugin_manager(off, entrypoints=False))


def test_the_default_key_plugins_old_name_still_turns_it_off(caplog):
    caplog.set_level(logging.WARNING, logger="strata_serve.config")
    off = Settings(disable_plugins="conversation_key", server={"conversation_key_order": ["conversation_key"]})
    assert off.disable_plugins == ["opening_key"] and off.server.conversation_key_order == ["opening_key"]
    assert "opening_key" not in names(get_plugin_manager(off, entrypoints=False))
    assert any("now called 'opening_key'" in r.getMessage() for r in caplog.records)


def test_plugin_refuses_unknown_and_wrong_typed_keys(probe_installed):
    with pytest.raises(ConfigError, match=r"plugins\.entrypoint_probe\.greting: unknown key"):
        get_plugin_manager(Settings(plugins={"entrypoint_probe": {"greting": "hi"}}))
    with pytest.raises(ConfigError, match=r"plugins\.entrypoint_probe\.greeting"):
        get_plugin_manager(Settings(plugins={"entrypoint_probe": {"greeting": ["not", "a", "str"]}}))


def test_a_section_for_no_installed_plugin_is_refused():
    with pytest.raises(ConfigError, match=r"plugins\.nope: no plugin named 'nope'"):
        get_plugin_manager(Settings(plugins={"nope": {"x": 1}}), entrypoints=False)
    # ...unless it only turns that plugin off.
    get_plugin_manager(Settings(plugins={"nope": {"enabled": False}}), entrypoints=False)


def test_plugins_command_lists_name_distribution_version_hooks_enabled(probe_installed, monkeypatch):
    runner = CliRunner()
    result = runner.invoke(cli, ["plugins"])
    assert result.exit_code == 0, result.output
    line = next(l for l in result.output.splitlines() if l.startswith("entrypoint_probe"))
    assert "strata-entrypoint-probe" in line and "0.3.0" in line and "yes" in line
    assert "on_config" in line and "register_routes" in line

    result = runner.invoke(cli, ["plugins", "--disable-plugin", "entrypoint_probe"])
    line = next(l for l in result.output.splitlines() if l.startswith("entrypoint_probe"))
    assert " no " in line

    monkeypatch.setenv("STRATA_DISABLE_PLUGINS", "entrypoint_probe")
    result = runner.invoke(cli, ["plugins"])
    line = next(l for l in result.output.splitlines() if l.startswith("entrypoint_probe"))
    assert " no " in line


def test_run_refuses_a_bad_plugin_key_with_a_message(probe_installed, tmp_path):
    config = tmp_path / "strata.toml"
    config.write_text("[plugins.entrypoint_probe]\ngreting = 'hi'\n")
    model = tmp_path / "model.gguf"
    model.write_bytes(b"GGUF")  # refused before any engine would read it
    result = CliRunner().invoke(cli, ["run", "--config", str(config), "--model", str(model)])
    assert result.exit_code != 0
    assert "plugins.entrypoint_probe.greting: unknown key" in result.output


async def test_routes_added_by_a_plugin_are_served_and_guarded(
    probe_installed, strata_client_factory, strata_settings_factory
):
    settings = strata_settings_factory(plugins={"entrypoint_probe": {"greeting": "ahoy"}},
                                       server={"api_key": "k"})
    # The core's routing and guard, not the engine's work: on the in-memory engine.
    client = await strata_client_factory(MemoryBackend(), settings=settings, entrypoints=True)
    resp = await client.get("/probe", headers={"Authorization": "Bearer k"})
    assert resp.status == 200 and (await resp.json()) == {"greeting": "ahoy"}
    refused = await client.get("/probe")
    assert_openai_error(await refused.json(), 401, refused.status)


def test_tracing_switch_logs_hook_calls(monkeypatch, caplog):
    import logging

    monkeypatch.setenv("STRATA_TRACE_PLUGINS", "1")

    class Traced:
        strata_name = "traced"

        @strata_serve.hookimpl
        def conversation_key(self, request):
            return "k"

    pm = get_plugin_manager(Settings(), entrypoints=False, plugins=[Traced()])
    with caplog.at_level(logging.INFO, logger="strata_serve.plugins"):
        assert first_result(pm, "conversation_key", request=None) == "k"
    assert any("conversation_key" in r.getMessage() and "traced" in r.getMessage() for r in caplog.records)


class HealthSquatter:
    """Tries to add routes under /health, which is open to anyone without a key."""

    strata_name = "health_squatter"

    def __init__(self):
        self.served = 0

    async def handle(self, request):
        from aiohttp import web

        self.served += 1
        return web.json_response({"engine": "secrets"})

    @strata_serve.hookimpl
    def register_routes(self):
        from aiohttp import web

        return [web.post("/health", self.handle), web.get("/health/detail", self.handle),
                web.get("/healthy", self.handle)]


async def test_no_plugin_route_is_added_under_health(strata_memory_client_factory, strata_settings_factory, caplog):
    import logging

    squatter = HealthSquatter()
    with caplog.at_level(logging.ERROR, logger="strata_serve.api"):
        client = await strata_memory_client_factory(squatter,
                                                    settings=strata_settings_factory(server={"api_key": "k"}))
    for method, path in [("POST", "/health"), ("GET", "/health/detail")]:
        assert any("health_squatter" in r.getMessage() and f"{method} {path} refused" in r.getMessage()
                   for r in caplog.records), caplog.text
        for headers in ({}, {"Authorization": "Bearer k"}):
            resp = await client.request(method, path, headers=headers)
            assert 400 <= resp.status < 500
            assert_openai_error(await resp.json())
    assert squatter.served == 0
    # A path that only begins with the same letters is the plugin's like any other, and guarded.
    assert (await client.get("/healthy")).status == 401
    assert (await client.get("/healthy", headers={"Authorization": "Bearer k"})).status == 200
    assert (await client.get("/health")).status == 200


@pytest.mark.parametrize("hook", sorted(HOOKS))
async def test_a_plugin_that_raises_in_any_hook_never_fails_the_request(
    hook, strata_client_factory, strata_memory_client_factory, strata_settings_factory, recorder, caplog
):
    import logging

    def boom(**arguments):
        raise RuntimeError(f"boom in {hook}")

    plugin = hook_plugin(hook, boom)
    env = Env(client_factory_for(hook, strata_client_factory, strata_memory_client_factory),
              strata_settings_factory, recorder)
    with caplog.at_level(logging.ERROR):
        await SCENARIOS[hook](env, plugin)
    assert plugin.calls, f"the scenario never reached {hook}"
    if hook in ("on_config", "adjust_settings"):  # the two hooks whose failure stops the start
        assert env.refused is not None and f"only_{hook}" in str(env.refused) and "boom" in str(env.refused)
        return
    failures = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert any(plugin.strata_name in m and hook in m for m in failures), failures
