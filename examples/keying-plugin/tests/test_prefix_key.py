"""prefix_key in a real strata-serve, with the fixtures strata-serve ships.

Which key a request gets is the plugin's and the core's business, not the engine's: the
server runs on the in-memory engine (``strata_memory_client_factory``), in milliseconds.
The project's own suite checks end to end, on the real engine, that the installed plugin
changes the key (tests/test_keying.py).
"""

import importlib.metadata

import pytest

import strata_prefix_key
from strata_serve.config import ConfigError
from strata_serve.plugins import get_plugin_manager
from strata_serve.testing import chat_body, KeyRecorder


def agent_turn(listing):
    """An agent's first message: a fixed instruction, then a listing it re-renders each turn."""
    return "You are a careful coding agent. Fix the failing test.\nFiles: " + listing


async def test_a_re_rendered_opening_keeps_its_key(strata_memory_client_factory, strata_settings_factory):
    keys = KeyRecorder()
    settings = strata_settings_factory(plugins={"prefix_key": {"chars": 40}})
    client = await strata_memory_client_factory(strata_prefix_key, keys, settings=settings)
    for text in (agent_turn("a.py"), agent_turn("a.py b.py"), "Something else entirely, at length"):
        resp = await client.post("/v1/chat/completions", json=chat_body(text))
        assert resp.status == 200
    first, second, other = keys.seen
    assert first == second, "the instruction is the same: one conversation"
    assert other != first


async def test_short_messages_keep_the_built_in_key(strata_memory_client_factory):
    keys = KeyRecorder()
    client = await strata_memory_client_factory(keys)
    await client.post("/v1/chat/completions", json=chat_body("Hello"))
    client = await strata_memory_client_factory(strata_prefix_key, keys)
    await client.post("/v1/chat/completions", json=chat_body("Hello"))
    built_in, ours = keys.seen
    assert ours == built_in


async def test_a_misspelt_setting_stops_the_start(strata_settings_factory):
    settings = strata_settings_factory(plugins={"prefix_key": {"char": 40}})
    with pytest.raises(ConfigError, match="plugins.prefix_key.char: unknown key"):
        get_plugin_manager(settings, entrypoints=False, plugins=[strata_prefix_key])


def test_the_entry_point_names_the_plugin():
    (entry_point,) = importlib.metadata.entry_points(group="strata_serve", name="prefix_key")
    assert entry_point.load() is strata_prefix_key
