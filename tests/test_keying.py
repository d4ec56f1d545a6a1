"""Keying plugins together: which one wins, refusals, tenants, and a stranger's plugin."""

from __future__ import annotations

import importlib.metadata
import logging
import re
import tomllib
from pathlib import Path

import strata_auto_sessions
import strata_prefix_key
import strata_serve
import strata_session_header
import strata_system_prompt_key
from strata_serve.api import SERVICE
from strata_serve.config import Settings
from strata_serve.plugins import ENTRY_POINT_GROUP
from strata_serve.testing import assert_openai_error, chat_body, conversation
from strata_auto_sessions.testing import all_parked_names

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE_DIR = ROOT / "examples" / "keying-plugin"
KEYING_PLUGINS = (strata_session_header, strata_system_prompt_key)


def guide_toml(section: str) -> list[dict]:
    """The TOML examples under one ``## section`` of docs/writing-plugins.md."""
    guide = (ROOT / "docs" / "writing-plugins.md").read_text()
    text = guide.split(f"\n## {section}\n", 1)[1].split("\n## ", 1)[0]
    return [tomllib.loads(block) for block in re.findall(r"```toml\n(.*?)```", text, re.S)]


def is_within(part: dict, whole: dict) -> bool:
    return all(
        key in whole and (is_within(value, whole[key]) if isinstance(value, dict) else value == whole[key])
        for key, value in part.items()
    )


def with_system(text: str = "Hello there", system: str = "You are terse.") -> dict:
    body = chat_body(text)
    body["messages"].insert(0, {"role": "system", "content": system})
    return body


def test_the_guides_configuration_examples_are_valid_settings():
    examples = guide_toml("Conversation keys")
    assert examples, "the guide shows the settings"
    for example in examples:
        Settings(**example)


def test_the_guides_pyproject_excerpt_is_the_examples():
    pyproject = tomllib.loads((EXAMPLE_DIR / "pyproject.toml").read_text())
    (excerpt,) = guide_toml("A plugin of your own, packaged")
    assert is_within(excerpt, pyproject)


async def test_the_configured_order_decides_which_keying_plugin_wins(
    strata_memory_client_factory, strata_settings_factory, recorder
):
    (order,) = [e["server"]["conversation_key_order"] for e in guide_toml("Conversation keys")
                if "conversation_key_order" in e.get("server", {})]
    assert order == ["session_header", "system_prompt_key"], "the guide's example is the order tested here"
    settings = strata_settings_factory(server={"conversation_key_order": order})
    client = await strata_memory_client_factory(*KEYING_PLUGINS, recorder, settings=settings)
    await client.post("/v1/chat/completions", json=with_system(), headers={"X-Session-Id": "s1"})
    await client.post("/v1/chat/completions", json=with_system())
    await client.post("/v1/chat/completions", json=chat_body())
    header, system_prompt, built_in = recorder.keys
    assert header == "s1"
    assert len(system_prompt) == 16, "no header: the next plugin in the order answers"
    assert len(built_in) == 16 and built_in != system_prompt, "neither answers: the built-in default"

    settings = strata_settings_factory(server={"conversation_key_order": order[::-1]})
    client = await strata_memory_client_factory(*KEYING_PLUGINS, recorder, settings=settings)
    await client.post("/v1/chat/completions", json=with_system(), headers={"X-Session-Id": "s1"})
    assert recorder.keys[-1] == system_prompt
    # The winner answered first, so the header was never read, let alone refused.
    resp = await client.post("/v1/chat/completions", json=with_system(), headers={"X-Session-Id": "a b"})
    assert resp.status == 200 and recorder.keys[-1] == system_prompt


async def test_a_refused_header_is_answered_400_and_nothing_is_keyed(
    strata_memory_client_factory, strata_settings_factory, recorder
):
    settings = strata_settings_factory(plugins={"auto_sessions": {"min_tokens": 100}})
    client = await strata_memory_client_factory(strata_auto_sessions, strata_session_header, recorder,
                                                settings=settings)
    held = {"messages": conversation("held"), "max_tokens": 8, "temperature": 0}
    assert (await client.post("/v1/chat/completions", json=held)).status == 200
    for bad in ("x" * 65, "../escape", "naïve"):
        resp = await client.post("/v1/chat/completions", json=chat_body("other"),
                                 headers={"X-Session-Id": bad})
        body = await resp.json()
        assert_openai_error(body, 400, resp.status)
        assert body["error"]["param"] == "X-Session-Id"
        assert body["error"]["code"] == "invalid_conversation_key"
    assert len(recorder.keys) == 1, "refused requests never reached pre_request"
    stats = client.app[SERVICE].state["auto_sessions"].stats
    assert stats.saves == 0, "no switch happened: the held conversation was not parked"


async def test_two_tenants_with_the_same_opening_never_touch_each_others_file(
    strata_client_factory, strata_settings_factory, caplog
):
    caplog.set_level(logging.INFO, logger="strata_auto_sessions")
    settings = strata_settings_factory(plugins={"auto_sessions": {"min_tokens": 100}},
                                       server={"api_keys": {"alice": "ka", "bob": "kb"}})
    client = await strata_client_factory(strata_auto_sessions, settings=settings)
    parking = client.app[SERVICE].state["auto_sessions"]
    slots = client.app[SERVICE].engine.info.slot_save_path

    async def ask(api_key: str, turns: int) -> None:
        body = {"messages": conversation("shared", turns), "max_tokens": 8, "temperature": 0}
        resp = await client.post("/v1/chat/completions", json=body,
                                 headers={"Authorization": f"Bearer {api_key}"})
        assert resp.status == 200, await resp.text()

    def restored() -> list[str]:
        return [r.getMessage() for r in caplog.records if "auto sessions: restored" in r.getMessage()]

    await ask("ka", 1)
    await ask("kb", 1)  # the same words: alice's conversation is parked, bob's is new
    files = all_parked_names(slots)
    assert len(files) == 1 and files[0].startswith("auto-alice--")
    assert parking.stats.restores == 0 and not restored(), "bob was never given alice's file"

    await ask("ka", 2)  # back to alice: bob's is parked, alice's comes back
    alice_file, bob_file = all_parked_names(slots)
    assert alice_file.startswith("auto-alice--") and bob_file.startswith("auto-bob--")
    assert alice_file.split("--", 1)[1] == bob_file.split("--", 1)[1], "one opening, two tenants"
    assert alice_file in restored()[-1]

    await ask("kb", 2)
    assert bob_file in restored()[-1]
    assert all(alice_file not in line for line in restored()[1:]), "bob's turns restore bob's file"


def other_entry_points(*keep: str) -> list[str]:
    return [ep.name for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP) if ep.name not in keep]


async def test_the_example_plugin_installed_from_its_directory_changes_the_key(
    strata_client_factory, strata_settings_factory, recorder
):
    assert Path(strata_prefix_key.__file__).resolve().is_relative_to(EXAMPLE_DIR)
    assert importlib.metadata.distribution("strata-prefix-key").entry_points.select(
        group=ENTRY_POINT_GROUP, name="prefix_key")

    same_start = [chat_body("Review this diff: a.py"), chat_body("Review this diff: b.py")]
    # Loaded like any installed plugin, through its entry point; the others are kept out.
    installed = strata_settings_factory(plugins={"prefix_key": {"chars": 17}},
                                        disable_plugins=other_entry_points("prefix_key"))
    client = await strata_client_factory(recorder, settings=installed, entrypoints=True)
    for body in same_start:
        assert (await client.post("/v1/chat/completions", json=body)).status == 200
    assert recorder.keys[0] == recorder.keys[1]

    without = strata_settings_factory(disable_plugins=other_entry_points())
    client = await strata_client_factory(recorder, settings=without, entrypoints=True)
    for body in same_start:
        await client.post("/v1/chat/completions", json=body)
    assert recorder.keys[2] != recorder.keys[3], "the built-in key tells them apart"


async def test_a_session_id_never_reaches_another_tenants_namespace(
    strata_client_factory, strata_settings_factory, caplog
):
    caplog.set_level(logging.INFO, logger="strata_auto_sessions")
    settings = strata_settings_factory(plugins={"auto_sessions": {"min_tokens": 100}},
                                       server={"api_key": "k-plain", "api_keys": {"alice": "ka"}})
    client = await strata_client_factory(strata_auto_sessions, strata_session_header, settings=settings)
    slots = client.app[SERVICE].engine.info.slot_save_path

    async def ask(api_key: str, session: str, name: str):
        body = {"messages": conversation(name), "max_tokens": 8, "temperature": 0}
        return await client.post("/v1/chat/completions", json=body,
                                 headers={"Authorization": f"Bearer {api_key}", "X-Session-Id": session})

    assert (await ask("ka", "s1", "alice")).status == 200
    assert (await ask("ka", "s2", "other")).status == 200  # a switch: alice--s1 is parked
    assert "auto-alice--s1.bin" in all_parked_names(slots)
    for key in ("k-plain", "ka"):
        resp = await ask(key, "alice--s1", "alice")
        body = await resp.json()
        assert_openai_error(body, 400, resp.status)
        assert body["error"]["code"] == "invalid_conversation_key" and "'--'" in body["error"]["message"]
    assert not [r for r in caplog.records if "auto sessions: restored" in r.getMessage()]
    assert client.app[SERVICE].state["auto_sessions"].stats.restores == 0


class _Returns:
    """A keying plugin that returns one fixed key."""

    strata_name = "fixed_key"

    def __init__(self, key: str) -> None:
        self.key = key

    @strata_serve.hookimpl
    def conversation_key(self, request):
        return self.key


async def test_a_key_with_a_trailing_newline_is_not_a_key(strata_memory_client_factory, recorder, caplog):
    client = await strata_memory_client_factory(_Returns("abc\n"), recorder)
    assert (await client.post("/v1/chat/completions", json=chat_body())).status == 200
    assert recorder.keys == [None]
    assert any("ignoring conversation key 'abc\\n'" in r.getMessage() for r in caplog.records)


def test_file_names_of_keys_are_one_to_one_under_case_folding():
    from strata_auto_sessions.store import file_key, key_of_file

    keys = ["chat", "Chat", "CHAT", "cHat", "alice--Chat", "Alice--chat", "a-b_c", "A-B_C", "x_y", "X_y", "q"]
    names = [file_key(key) for key in keys]
    assert len({name.casefold() for name in names}) == len(keys)
    assert all(key_of_file(name) == key for key, name in zip(keys, names))
    assert file_key("alice--3f2a0b") == "alice--3f2a0b", "lower-case keys keep their plain names"


async def test_two_keys_that_differ_only_by_case_get_two_files(strata_client_factory, strata_settings_factory):
    settings = strata_settings_factory(plugins={"auto_sessions": {"min_tokens": 100}})
    client = await strata_client_factory(strata_auto_sessions, strata_session_header, settings=settings)
    slots = client.app[SERVICE].engine.info.slot_save_path
    for session, name in (("Chat", "upper"), ("chat", "lower"), ("Chat", "upper")):
        body = {"messages": conversation(name), "max_tokens": 8, "temperature": 0}
        resp = await client.post("/v1/chat/completions", json=body, headers={"X-Session-Id": session})
        assert resp.status == 200
    files = all_parked_names(slots)
    assert len(files) == 2, files
    assert len({name.casefold() for name in files}) == 2, "two files even where case is folded"
    stats = client.app[SERVICE].state["auto_sessions"].stats
    assert stats.restores == 1, "Chat came back from its own file"


async def test_two_tenants_sending_one_client_session_id_never_share_a_key_or_a_file(
    strata_client_factory, strata_settings_factory, caplog
):
    # Claude Code's own session header: the same id and the same opening from two tenants.
    caplog.set_level(logging.INFO, logger="strata_auto_sessions")
    settings = strata_settings_factory(plugins={"auto_sessions": {"min_tokens": 100, "idle_save_s": 0}},
                                       server={"api_keys": {"alice": "ka", "bob": "kb"}})
    client = await strata_client_factory(strata_auto_sessions, strata_session_header, settings=settings)
    slots = client.app[SERVICE].engine.info.slot_save_path
    session = "b5b1fbbf-ba96-40de-8923-ca1fdfb5dba9"

    async def ask(api_key: str, turns: int) -> tuple[str, dict]:
        body = {"model": "m", "max_tokens": 8, "temperature": 0, "system": "You are terse.",
                "messages": conversation("shared", turns)}
        resp = await client.post("/v1/messages", json=body, headers={
            "x-api-key": api_key, "anthropic-version": "2023-06-01", "X-Claude-Code-Session-Id": session})
        assert resp.status == 200, await resp.text()
        return resp.headers["X-Strata-Conversation"], (await resp.json())["usage"]

    def restored() -> list[str]:
        return [r.getMessage() for r in caplog.records if "auto sessions: restored" in r.getMessage()]

    alice, _ = await ask("ka", 1)
    bob, _ = await ask("kb", 1)
    assert alice.startswith(f"alice--{session}_") and bob.startswith(f"bob--{session}_")
    assert alice.split("--", 1)[1] == bob.split("--", 1)[1], "one id, one opening, two tenants"
    assert not restored(), "bob was never given alice's file"
    assert (await ask("ka", 2))[0] == alice  # alice's comes back from her own file
    assert (await ask("kb", 2))[0] == bob
    lines = restored()
    assert len(lines) == 2 and "auto-alice--" in lines[0] and "auto-bob--" in lines[1], lines
    assert {name.split("--", 1)[0] for name in all_parked_names(slots)} == {"auto-alice", "auto-bob"}
