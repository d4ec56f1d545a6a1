"""The ids real clients send name their sessions; the digest names the conversation within.

The unit tests ask the plugin alone. The others run on the real engine with one slot and
auto-sessions: two sessions that open alike (the same system prompt, tools, reminders
and prompt) and differ in their ids only, each running a tool loop in turn. Keyed by the
first user message they share one key, and each return finds the other session's state
in their file; keyed by their ids, each return restores its own.
"""

from __future__ import annotations

import hashlib
import json
import re
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from multidict import CIMultiDict

import strata_auto_sessions
import strata_serve
import strata_session_header
import strata_system_prompt_key
from strata_serve.hook_types import StrataRequest
from strata_serve.testing import KeyRecorder

from plugins.session_header.tests.client_shapes import (
    AGENT_PROMPT, SESSION_A, SESSION_B, SUMMARY, TITLE_PROMPT, TOOL_NAMES, IDENTITY, REMINDERS,
    claude_code_body, claude_code_headers, claude_code_metadata, claude_code_opening, claude_code_short_turn,
    billing, claude_code_title_body, claude_code_tool_turn, codex_body, codex_headers, codex_short_turn,
    codex_tool_turn, CODEX_OPENING,
)

#: A return restored its own state when the engine reused at least this share of its prompt.
OWN_STATE = 0.9


def key(route: str, body: dict[str, Any], headers: dict[str, str] | None = None, config=None) -> str | None:
    request = StrataRequest(route=route, body=body, headers=CIMultiDict(headers or {}))
    config = config or strata_session_header.SessionHeaderConfig()
    service = SimpleNamespace(plugin_config=lambda name, model: config)
    answer = strata_session_header.conversation_key(request, service)
    assert answer is None or answer.named, "a key the client named names one conversation"
    return None if answer is None else answer.key


def documented_digest(identity: dict[str, Any]) -> str:
    """The digest as the README writes it down, computed here on its own."""
    framed = json.dumps(identity, ensure_ascii=False, sort_keys=True, separators=(",", ":"))
    return hashlib.sha1(framed.encode("utf-8")).hexdigest()[:8]


def main_turn(session: str | None, messages: list[dict[str, Any]], **options) -> tuple[str, dict, dict]:
    return "messages", claude_code_body(messages, session, **options), claude_code_headers(session)


# --- the plugin alone ----------------------------------------------------------------


def test_a_claude_code_key_is_the_session_id_and_the_documented_digest():
    route, body, headers = main_turn(SESSION_A, claude_code_opening())
    expected = documented_digest({"system": [IDENTITY, AGENT_PROMPT], "tools": sorted(TOOL_NAMES)})
    assert key(route, body, headers) == f"{SESSION_A}_{expected}"
    # metadata.user_id alone names the same session the same way
    assert key(route, body) == f"{SESSION_A}_{expected}"
    del body["metadata"]
    assert key(route, body, headers) == f"{SESSION_A}_{expected}"
    assert key(route, body) is None, "no id: the plugin defers"


def test_a_claude_code_session_keeps_its_key_across_turns_and_compaction():
    route, opening, headers = main_turn(SESSION_A, claude_code_opening())
    first = key(route, opening, headers)
    later = claude_code_body(claude_code_opening() + claude_code_tool_turn("a")
                             + claude_code_short_turn("Now run the tests"), SESSION_A)
    # After a compaction a summary is the first message, and the billing line follows it.
    compacted = claude_code_body([{"role": "user", "content": [{"type": "text", "text": REMINDERS},
                                                               {"type": "text", "text": SUMMARY}]}],
                                 SESSION_A, fingerprint="f9d")
    assert key(route, later, headers) == first
    assert key(route, compacted, headers) == first


def test_side_requests_and_sub_agents_of_a_session_are_conversations_of_their_own():
    route, main, headers = main_turn(SESSION_A, claude_code_opening())
    title = claude_code_title_body(SESSION_A)
    probe = {"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": "quota"}],
             "metadata": claude_code_metadata(SESSION_A)}
    keys = [key(route, main, headers), key(route, title, headers), key(route, probe, headers),
            key(route, main, claude_code_headers(SESSION_A, agent="agent-a")),
            key(route, main, claude_code_headers(SESSION_A, agent="agent-b"))]
    assert all(k.startswith(f"{SESSION_A}_") for k in keys), keys
    assert len(set(keys)) == len(keys), "each its own conversation of the one session"
    assert keys[1].endswith(documented_digest({"system": [IDENTITY, TITLE_PROMPT], "tools": []}))
    assert keys[2].endswith(documented_digest({"system": [], "tools": [], "user": "quota"}))
    assert keys[3].endswith(documented_digest({"system": [IDENTITY, AGENT_PROMPT], "tools": sorted(TOOL_NAMES),
                                               "agent": "agent-a"}))


def test_two_sessions_that_open_alike_get_two_keys():
    route, body, _ = main_turn(None, claude_code_opening())
    a = key(route, {**body, "metadata": claude_code_metadata(SESSION_A)}, claude_code_headers(SESSION_A))
    b = key(route, {**body, "metadata": claude_code_metadata(SESSION_B)}, claude_code_headers(SESSION_B))
    assert a != b and a.split("_", 1)[1] == b.split("_", 1)[1], "one opening, two sessions"
    codex = [key("responses", codex_body(CODEX_OPENING, session), codex_headers(session))
             for session in (SESSION_A, SESSION_B)]
    assert codex[0] != codex[1]


@pytest.mark.parametrize("cache_key, headers", [
    (SESSION_A, {}),
    (None, codex_headers(SESSION_A)),
    (None, codex_headers(SESSION_A, header="session_id")),
    (SESSION_A, codex_headers(SESSION_A)),
])
def test_codex_names_its_conversation_by_prompt_cache_key_or_its_session_header(cache_key, headers):
    body = codex_body(CODEX_OPENING, cache_key)
    found = key("responses", body, headers)
    instructions = [body["instructions"], CODEX_OPENING[0]["content"][0]["text"]]
    assert found == f"{SESSION_A}_{documented_digest({'system': instructions, 'tools': ['shell', 'update_plan']})}"
    later = codex_body(CODEX_OPENING + codex_tool_turn("a") + codex_short_turn("Also add a test"), cache_key)
    assert key("responses", later, headers) == found


def test_a_codex_sub_agent_with_its_own_prompt_cache_key_is_its_own_conversation():
    parent = key("responses", codex_body(CODEX_OPENING, SESSION_A), codex_headers(SESSION_A))
    child = key("responses", codex_body(CODEX_OPENING, SESSION_B), codex_headers(SESSION_A))
    assert child.startswith(f"{SESSION_B}_") and child != parent


def test_an_open_webui_chat_and_its_title_task_get_two_keys():
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    title = {"messages": [{"role": "user", "content": "### Task:\nGenerate a concise title..."}]}
    headers = {"X-OpenWebUI-Chat-Id": "0b7e2f9c-1d2a-4c55-9e1f-5a3b2c1d0e9f"}
    keys = {key("chat", chat, headers), key("chat", title, headers)}
    assert len(keys) == 2 and all(k.startswith("0b7e2f9c-") for k in keys)


@pytest.mark.parametrize("bad", ["", "x" * 56, "two words", "a--b", "café", "../up"])
def test_a_clients_id_that_is_not_usable_is_passed_over_never_refused(bad):
    route, body, _ = main_turn(None, claude_code_opening())
    for headers, extra in (
        ({"X-Claude-Code-Session-Id": bad}, {}),
        ({}, {"metadata": {"user_id": json.dumps({"session_id": bad})}}),
        ({"session-id": bad, "session_id": bad}, {}),
        ({"X-OpenWebUI-Chat-Id": bad}, {}),
        ({}, {"prompt_cache_key": bad}),
    ):
        assert key(route, {**body, **extra}, headers) is None, (headers, extra)
        # ...and the next source is read
        assert key(route, {**body, **extra}, {**headers, "X-Session-Id": "s1"}) == "s1"


@pytest.mark.parametrize("user_id", ["not json", json.dumps(["a"]), json.dumps({"device_id": "d"}),
                                     json.dumps({"session_id": 7}), 42, "[" * 100_000,
                                     json.dumps({"session_id": SESSION_A, "pad": "x" * 2000})])
def test_a_metadata_user_id_without_a_session_is_passed_over(user_id):
    route, body, _ = main_turn(None, claude_code_opening())
    assert key(route, {**body, "metadata": {"user_id": user_id}}) is None


def test_the_clients_ids_come_before_x_session_id_which_is_still_refused_when_bad():
    route, body, headers = main_turn(SESSION_A, claude_code_opening())
    assert key(route, body, {**headers, "X-Session-Id": "mine"}).startswith(f"{SESSION_A}_")
    with pytest.raises(strata_serve.KeyRefused):
        key(route, {"messages": body["messages"]}, {"X-Session-Id": "a b"})
    old = strata_session_header.SessionHeaderConfig(sources=["header", "metadata"])
    assert key(route, body, {**headers, "X-Session-Id": "mine"}, config=old) == "mine"
    assert key(route, body, headers, config=old) is None, "the earlier behaviour, when configured"


async def test_the_plugin_is_asked_before_a_guess_from_the_prompt(strata_memory_client_factory):
    recorder = KeyRecorder()
    # Registered first, so pluggy alone would ask system_prompt_key first.
    client = await strata_memory_client_factory(strata_session_header, strata_system_prompt_key, recorder)
    body = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}],
            "max_tokens": 4}
    headers = {"X-OpenWebUI-Chat-Id": SESSION_A}
    resp = await client.post("/v1/chat/completions", json=body, headers=headers)
    assert resp.status == 200, await resp.text()
    assert recorder.seen == [key("chat", body, headers)] and recorder.seen[0].startswith(f"{SESSION_A}_")
    assert resp.headers["X-Strata-Conversation"] == recorder.seen[0]


# --- on the real engine ----------------------------------------------------------------


class Reuse:
    """Test plugin: each request's key and the share of its prompt the engine reused."""

    strata_name = "reuse"

    def __init__(self) -> None:
        self.turns: list[tuple[str | None, float, Any]] = []

    @strata_serve.hookimpl
    def post_request(self, request, outcome):
        timings = outcome.timings
        assert timings is not None, f"no timings for {request.route}"
        share = timings.reused / max(1, timings.reused + timings.prefilled)
        self.turns.append((request.conversation_key, share, timings))


@pytest.fixture
def parked(strata_client_factory, strata_settings_factory):
    """``await parked(*plugins, **server)``: one slot, auto-sessions, the RAM cache off, and
    the bundled keying plugins as ``make serve`` installs them (system_prompt_key
    registered last, so pluggy alone would ask it first)."""

    async def make(*plugins, siblings: int = 4, **server):
        settings = strata_settings_factory(
            server=server, engine={"cache_ram_mib": 0, "parallel": 1},
            plugins={"auto_sessions": {"min_tokens": 100, "idle_save_s": 0, "siblings": siblings}},
        )
        reuse = Reuse()
        client = await strata_client_factory(strata_auto_sessions, strata_session_header,
                                             strata_system_prompt_key, *plugins, reuse, settings=settings)
        return client, reuse

    return make


async def send(client, reuse: Reuse, path: str, body: dict, headers: dict) -> tuple[str, float]:
    """One request; its key as ``X-Strata-Conversation`` says it, and the share it reused."""
    resp = await client.post(path, json=body, headers=headers)
    assert resp.status == 200, await resp.text()
    await resp.read()
    said = resp.headers.get("X-Strata-Conversation")
    key_held, share, _ = reuse.turns[-1]
    assert said == key_held, "the answer names the key the core held"
    return said, share


def claude_code_turns(name: str) -> list[list[dict]]:
    """A session's messages turn by turn: the opening, a tool loop, two short turns."""
    opening = claude_code_opening()
    tool = opening + claude_code_tool_turn(name)
    third = tool + claude_code_short_turn(f"Now run the tests of {name}")
    return [opening, tool, third, third + claude_code_short_turn("And commit.")]


def codex_turns(name: str) -> list[list[dict]]:
    tool = CODEX_OPENING + codex_tool_turn(name)
    third = tool + codex_short_turn(f"Also add a test for {name}")
    return [CODEX_OPENING, tool, third, third + codex_short_turn("And commit.")]


def claude_code_request(session: str, with_ids: bool, messages: list[dict]) -> tuple[str, dict, dict]:
    body = claude_code_body(messages, session if with_ids else None)
    return "/v1/messages", body, claude_code_headers(session if with_ids else None)


def codex_request(how: str):
    def request(session: str, with_ids: bool, items: list[dict]) -> tuple[str, dict, dict]:
        cache_key = session if with_ids and how in ("prompt_cache_key", "both") else None
        headers = codex_headers(session if with_ids and how in ("session-id", "both") else None)
        return "/v1/responses", codex_body(items, cache_key), headers

    return request


async def alternate(client, reuse: Reuse, turns, request, with_ids: bool) -> tuple[set[str], list[float]]:
    """Session A's opening and tool loop, then B's, then A and B in turn twice.

    Returns the keys seen and the share each return (a turn after the other session's)
    reused of its prompt.
    """
    a, b = turns("alpha"), turns("beta")
    keys, returns = set(), []
    order = [(SESSION_A, a[0]), (SESSION_A, a[1]), (SESSION_B, b[0]), (SESSION_B, b[1]),
             (SESSION_A, a[2]), (SESSION_B, b[2]), (SESSION_A, a[3]), (SESSION_B, b[3])]
    for n, (session, messages) in enumerate(order):
        said, share = await send(client, reuse, *request(session, with_ids, messages))
        keys.add(said)
        if n >= 4:
            returns.append(share)
    return keys, returns


@pytest.mark.parametrize("client_shape", ["claude_code", "codex_session_id", "codex_prompt_cache_key"])
async def test_two_sessions_that_open_alike_each_restore_their_own_state(parked, client_shape):
    turns, request = {
        "claude_code": (claude_code_turns, claude_code_request),
        "codex_session_id": (codex_turns, codex_request("session-id")),
        "codex_prompt_cache_key": (codex_turns, codex_request("prompt_cache_key")),
    }[client_shape]
    client, reuse = await parked()
    keys, returns = await alternate(client, reuse, turns, request, with_ids=True)
    assert len(keys) == 2, keys
    assert {k.split("_", 1)[0] for k in keys} == {SESSION_A, SESSION_B}
    assert all(share >= OWN_STATE for share in returns), [round(s, 3) for s in returns]
    print(f"\n{client_shape}: returns with ids reused {[round(s, 3) for s in returns]}")

    # The control: without the ids the two sessions share one key; kept to one file a key
    # (siblings = 1), each return finds the other's state (only the common opening is
    # reused). The test above would see that.
    await client.close()  # one server per slot directory
    client, reuse = await parked(siblings=1)
    keys, returns = await alternate(client, reuse, turns, request, with_ids=False)
    assert len(keys) == 1, keys
    assert all(share < OWN_STATE for share in returns), [round(s, 3) for s in returns]
    print(f"{client_shape}: returns without ids, one file a key, reused {[round(s, 3) for s in returns]}")
    # By default the key keeps a file for each (its siblings): each return finds its own.
    await client.close()
    client, reuse = await parked()
    keys, returns = await alternate(client, reuse, turns, request, with_ids=False)
    assert len(keys) == 1, keys
    assert all(share >= OWN_STATE for share in returns), [round(s, 3) for s in returns]
    print(f"{client_shape}: returns without ids, a file each under the key, reused {[round(s, 3) for s in returns]}")


async def test_the_title_request_of_a_session_never_replaces_the_main_turns_state(parked):
    client, reuse = await parked()
    main = claude_code_turns("alpha")
    headers = claude_code_headers(SESSION_A)
    main_key, _ = await send(client, reuse, "/v1/messages", claude_code_body(main[0], SESSION_A), headers)
    title_key, _ = await send(client, reuse, "/v1/messages", claude_code_title_body(SESSION_A), headers)
    assert title_key != main_key and title_key.startswith(f"{SESSION_A}_")
    short = main[0] + claude_code_short_turn("Go on.")
    again, share = await send(client, reuse, "/v1/messages", claude_code_body(short, SESSION_A), headers)
    assert again == main_key
    assert share >= OWN_STATE, f"the main turn came back to {share:.1%} of its prompt"


async def tokens(client, text: str) -> int:
    resp = await client.post("/tokenize", json={"content": text})
    assert resp.status == 200, await resp.text()
    return len((await resp.json())["tokens"])


async def test_after_compaction_the_session_keeps_its_key_and_reuses_the_shared_opening(parked):
    client, reuse = await parked()
    headers = claude_code_headers(SESSION_A)
    turns = claude_code_turns("alpha")
    main_key, _ = await send(client, reuse, "/v1/messages", claude_code_body(turns[1], SESSION_A), headers)
    # The title request takes the slot (another system prompt): the main turn is parked.
    await send(client, reuse, "/v1/messages", claude_code_title_body(SESSION_A), headers)
    compacted = [{"role": "user", "content": [{"type": "text", "text": REMINDERS}, {"type": "text", "text": SUMMARY}]}]
    resp = await client.post("/v1/messages", json=claude_code_body(compacted, SESSION_A, fingerprint="f9d"),
                             headers=headers)
    assert resp.status == 200, await resp.text()
    await resp.read()
    assert resp.headers["X-Strata-Conversation"] == main_key, "the same conversation after compaction"
    assert int(resp.headers["X-Strata-Restored-Tokens"]) > 0, "its parked state was restored"
    _, _, timings = reuse.turns[-1]
    shared = await tokens(client, AGENT_PROMPT)
    assert timings.reused >= shared, f"reused {timings.reused}, the agent prompt alone is {shared} tokens"
    assert timings.prefilled >= await tokens(client, SUMMARY) * 0.9, "the summary was read"


@settings(max_examples=300, deadline=None)
@given(value=st.one_of(st.text(max_size=80), st.binary(max_size=80).map(lambda b: b.decode("latin-1"))),
       source=st.sampled_from(["X-Claude-Code-Session-Id", "session-id", "session_id", "X-OpenWebUI-Chat-Id",
                               "prompt_cache_key", "user_id"]))
def test_any_value_of_a_clients_id_gives_a_valid_key_or_none_never_a_refusal(value, source):
    body: dict[str, Any] = {"messages": [{"role": "user", "content": "hi"}]}
    headers = {}
    if source == "prompt_cache_key":
        body["prompt_cache_key"] = value
    elif source == "user_id":
        body["metadata"] = {"user_id": json.dumps({"session_id": value})}
    else:
        headers[source] = value
    found = key("chat", body, headers)
    if found is None:
        return
    assert re.fullmatch(r"[A-Za-z0-9_-]{1,64}", found) and "--" not in found, found
    assert found == f"{value}_{found[-8:]}", "a usable id is kept as sent"


def test_claude_codes_billing_lines_are_left_out_of_the_system_prompt():
    from strata_serve.api.anthropic import without_billing_lines

    body = claude_code_body(claude_code_opening(), SESSION_A)
    assert [block["text"] for block in without_billing_lines(body)["system"]] == [IDENTITY, AGENT_PROMPT]
    mixed = {"system": "x-anthropic-billing-header: cc_version=1; cch=ab12c;\nYou are terse.\nkeep x-anthropic-billing-header: as text"}
    assert without_billing_lines(mixed)["system"] == "You are terse.\nkeep x-anthropic-billing-header: as text"
    assert "system" not in without_billing_lines({"system": [{"type": "text", "text": billing()}]})
    untouched = {"system": [{"type": "text", "text": "Plain."}, {"type": "text", "text": ""}]}
    assert without_billing_lines(untouched)["system"] == [{"type": "text", "text": "Plain."}, {"type": "text", "text": ""}]
