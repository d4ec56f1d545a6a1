"""Settings from a file, the environment and CLI flags, and how bad keys are reported."""

import json

import pytest
from pydantic import BaseModel, ConfigDict

from strata_serve.config import ConfigError, Settings, load_settings


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    import os

    for name in list(os.environ):
        if name.startswith("STRATA_"):
            monkeypatch.delenv(name)


def test_defaults():
    settings = load_settings()
    assert settings.server.port == 8080
    assert settings.engine.parallel == 1
    assert settings.disable_plugins == []


def test_toml_file_then_env_then_overrides(tmp_path, monkeypatch):
    config = tmp_path / "strata.toml"
    config.write_text('[server]\nport = 9000\nhost = "0.0.0.0"\n[engine]\nctx_size = 1000\nparallel = 2\n')
    monkeypatch.setenv("STRATA_ENGINE__CTX_SIZE", "2000")
    settings = load_settings(config, server={"port": 9100})
    assert settings.server.host == "0.0.0.0"  # file
    assert settings.engine.parallel == 2  # file
    assert settings.engine.ctx_size == 2000  # env beats file
    assert settings.server.port == 9100  # CLI beats both


def test_json_file(tmp_path):
    config = tmp_path / "strata.json"
    config.write_text(json.dumps({"engine": {"url": "http://127.0.0.1:1234"}}))
    assert load_settings(config).engine.url == "http://127.0.0.1:1234"


@pytest.mark.parametrize(
    "text, named",
    [
        ("[engine]\nctx_sise = 1\n", "engine.ctx_sise: unknown key"),
        ("[server]\nport = 'many'\n", "server.port"),
        ("[surver]\nport = 1\n", "surver: unknown key"),
        ("not toml at all [", "is not valid"),
    ],
)
def test_bad_keys_are_named(tmp_path, text, named):
    config = tmp_path / "strata.toml"
    config.write_text(text)
    with pytest.raises(ConfigError, match=named.replace(".", r"\.")):
        load_settings(config)


def test_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_settings(tmp_path / "nope.toml")


def test_disable_plugins_from_env_is_comma_separated(monkeypatch):
    monkeypatch.setenv("STRATA_DISABLE_PLUGINS", "auto_sessions, ram_cache_stats")
    settings = load_settings()
    assert settings.disable_plugins == ["auto_sessions", "ram_cache_stats"]
    assert not settings.plugin_enabled("auto_sessions")
    assert settings.plugin_enabled("other")


def test_plugin_section_from_env_and_its_own_model(monkeypatch):
    class Mine(BaseModel):
        model_config = ConfigDict(extra="forbid")
        min_tokens: int = 5

    monkeypatch.setenv("STRATA_PLUGINS__MINE__MIN_TOKENS", "42")
    monkeypatch.setenv("STRATA_PLUGINS__MINE__ENABLED", "true")
    settings = load_settings()
    assert settings.plugin_config("mine", Mine).min_tokens == 42
    assert settings.plugin_enabled("mine")

    bad = Settings(plugins={"mine": {"min_tokns": 1, "enabled": "false"}})
    assert not bad.plugin_enabled("mine")
    with pytest.raises(ConfigError, match=r"plugins\.mine\.min_tokns: unknown key"):
        bad.plugin_config("mine", Mine)
    wrong_type = Settings(plugins={"mine": {"min_tokens": "lots"}})
    with pytest.raises(ConfigError, match=r"plugins\.mine\.min_tokens"):
        wrong_type.plugin_config("mine", Mine)


def test_tenant_names_must_be_plain():
    with pytest.raises(ConfigError, match="server.api_keys"):
        load_settings(server={"api_keys": {"../evil": "k"}})
    assert load_settings(server={"api_keys": {"team_a": "k"}}).server.api_keys["team_a"].get_secret_value() == "k"


@pytest.mark.parametrize("text, named", [
    ('[server]\napi_key = ""', "server.api_key: the key is empty, which would turn authentication off"),
    ('[server.api_keys]\nalice = "ka"\nbob = ""', "server.api_keys: the key of 'bob' is empty"),
    ('[server]\napi_key = "two words"', "server.api_key: the key must be printable ASCII without spaces"),
    ('[server]\napi_key = "kéy"', "server.api_key: the key must be printable ASCII"),
    ('[server.api_keys]\nalice = "same"\nbob = "same"', "server.api_keys.alice and server.api_keys.bob are the same"),
    ('[server]\napi_key = "same"\n[server.api_keys]\nalice = "same"', "server.api_keys.alice and server.api_key"),
    ('[server]\nallowed_origins = ["*"]', "server.allowed_origins: '*' is not an origin"),
    ('[server]\nallowed_origins = ["http://ui.example/app"]', "server.allowed_origins: 'http://ui.example/app'"),
])
def test_keys_that_would_open_or_confuse_authentication_stop_the_start(tmp_path, text, named):
    config = tmp_path / "strata.toml"
    config.write_text(text + "\n")
    with pytest.raises(ConfigError) as refused:
        load_settings(config)
    assert named in str(refused.value)


def test_an_empty_key_from_the_environment_stops_the_start_too(monkeypatch):
    monkeypatch.setenv("STRATA_SERVER__API_KEY", "")
    with pytest.raises(ConfigError, match="server.api_key: the key is empty"):
        load_settings()


def test_allowed_origins_from_the_environment_and_compared_in_lower_case(monkeypatch):
    monkeypatch.setenv("STRATA_SERVER__ALLOWED_ORIGINS", "http://UI.example:3000, https://[::1]:8443")
    assert load_settings().server.allowed_origins == ["http://ui.example:3000", "https://[::1]:8443"]


def test_the_default_engine_is_the_plain_one_slot_engine(tmp_path):
    """No side slot by default: its pool is shared, and what it holds slows the main
    conversation's every token (#39). ``side_slot_tokens`` turns it on."""
    from strata_serve.engine.llama_server import build_command

    settings = load_settings().engine
    settings.model, settings.ctx_size = tmp_path / "m.gguf", 8192
    assert settings.side_slot_tokens == 0 and not settings.side_lane and settings.engine_slots == 1
    command = build_command(settings, tmp_path / "llama-server", 1)
    assert command[command.index("-np") + 1] == "1" and command[command.index("-c") + 1] == "8192"
    assert "--kv-unified" not in command
    settings.side_slot_tokens = 2048
    assert settings.side_lane and "--kv-unified" in build_command(settings, tmp_path / "llama-server", 1)
