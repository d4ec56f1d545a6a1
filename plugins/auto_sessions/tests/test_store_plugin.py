"""A second tier for parked sessions is a plugin: a store chosen through ``auto_sessions_store``.

The test plugin keeps a copy of every session file in a directory of its own (standing
in for another disk, or an object store several servers share) and brings a file back
into the engine's slot directory when a restore needs it. No core or auto-sessions edit.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

import strata_auto_sessions
import strata_serve
from strata_auto_sessions import SessionStore
from strata_serve.api import SERVICE
from strata_serve.config import ConfigError
from strata_serve.plugins import get_plugin_manager
from strata_serve.testing import conversation


class MirrorStore(SessionStore):
    """The slot directory, plus a copy of each file in ``mirror``."""

    def __init__(self, directory: Path, mirror: Path):
        super().__init__(directory)
        self.mirror = mirror
        self.fetched: list[str] = []

    def commit(self, temp_name, key, sidecar):
        committed = super().commit(temp_name, key, sidecar)
        for path in (self.bin_path(key, sidecar.sibling), self.sidecar_path(key, sidecar.sibling)):
            shutil.copy2(path, self.mirror / path.name)
        return committed

    def stage(self, key, sibling=0):
        if not self.restorable(key, sibling) and (self.mirror / self.bin_name(key, sibling)).is_file():
            for name in (self.bin_name(key, sibling), self.sidecar_path(key, sibling).name):
                shutil.copy2(self.mirror / name, self.directory / name)
            self.fetched.append(key)
        return super().stage(key, sibling)


class BlocksAwareStore(SessionStore):
    """A store plugin that says it parks blocks (it keeps nothing of its own here)."""

    parks_blocks = True


class MirrorPlugin:
    strata_name = "mirror_store"

    def __init__(self, mirror: Path, store: type[SessionStore] | None = None):
        self.mirror = mirror
        self.store = store

    @strata_serve.hookimpl
    def auto_sessions_store(self, directory):
        return MirrorStore(directory, self.mirror) if self.store is None else self.store(directory)


def body(messages):
    return {"messages": messages, "max_tokens": 4, "temperature": 0}


async def test_a_store_plugin_brings_back_a_file_the_slot_directory_lost(
        strata_client_factory, strata_settings_factory, tmp_path):
    mirror = tmp_path / "mirror"
    mirror.mkdir()
    settings = strata_settings_factory(plugins={"auto_sessions": {"min_tokens": 100}})
    client = await strata_client_factory(strata_auto_sessions, MirrorPlugin(mirror), settings=settings)
    parking = client.app[SERVICE].state["auto_sessions"]
    assert isinstance(parking.store, MirrorStore)
    a, b = conversation("tier-a"), conversation("tier-b")
    for messages in (a, b):
        assert (await client.post("/v1/chat/completions", json=body(messages))).status == 200
    name = parking.store.bin_name(client.app[SERVICE].conversation_key(_request(a)))
    assert (mirror / name).is_file(), "the store copied A out"
    (parking.store.directory / name).unlink()  # the slot directory lost it (a new machine, say)
    reply = await client.post("/v1/chat/completions", json=body(a))
    timings = (await reply.json())["timings"]
    assert parking.store.fetched and parking.stats.restores == 1
    assert timings["cache_n"] > 600, "A came back from the second tier"


def test_a_store_hook_without_auto_sessions_is_refused(strata_settings_factory, tmp_path):
    """The hook belongs to auto-sessions: without it, pluggy refuses the unknown hook."""
    from pluggy import PluginValidationError

    with pytest.raises(PluginValidationError, match="auto_sessions_store"):
        get_plugin_manager(strata_settings_factory(), entrypoints=False, plugins=[MirrorPlugin(tmp_path)])


def test_hook_wrappers_are_refused_at_start(strata_settings_factory):
    class Wrapper:
        strata_name = "wrapper"

        @strata_serve.hookimpl(wrapper=True)
        def pre_request(self, request):
            return (yield)

    with pytest.raises(ConfigError, match="wrapper: pre_request is a hook wrapper"):
        get_plugin_manager(strata_settings_factory(), entrypoints=False, plugins=[Wrapper()])


def _request(messages):
    from strata_serve.hook_types import StrataRequest

    return StrataRequest(route="chat", body={"messages": messages})


@pytest.mark.parametrize("store", [None, BlocksAwareStore], ids=["on-whole-files", "parks-blocks"])
async def test_a_store_plugin_parks_blocks_only_when_it_says_so(strata_client_factory, strata_settings_factory,
                                                                tmp_path, store):
    """With ``blocks = true``, a store plugin built on whole files (the mirror: it copies each
    ``bin_name`` file out) is still given whole files; one that sets ``parks_blocks`` parks
    in blocks. The latter is the control: the setting reaches a plugin's store."""
    mirror = tmp_path / "mirror"
    mirror.mkdir()
    settings = strata_settings_factory(plugins={"auto_sessions": {"min_tokens": 100, "blocks": True}})
    client = await strata_client_factory(strata_auto_sessions, MirrorPlugin(mirror, store), settings=settings)
    parking = client.app[SERVICE].state["auto_sessions"]
    a, b = conversation("aware-a"), conversation("aware-b")
    for messages in (a, b):
        assert (await client.post("/v1/chat/completions", json=body(messages))).status == 200
    key = client.app[SERVICE].conversation_key(_request(a))
    if store is None:
        assert parking.store.blocks is None and (mirror / parking.store.bin_name(key)).is_file()
        assert parking.store.restorable(key), "A parked as a whole file"
    else:
        assert parking.store.blocks is not None and parking.store.blocks.manifest(key, 0) is not None
        assert not parking.store.restorable(key), "A parked in blocks, no whole file"
