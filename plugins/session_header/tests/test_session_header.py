"""session_header: where the id is found, in which order, and what is refused."""

from types import SimpleNamespace

import pytest
from multidict import CIMultiDict

import strata_serve
import strata_session_header
from strata_serve.hook_types import StrataRequest
from strata_serve.plugins import get_plugin_manager
from strata_serve.testing import assert_openai_error, chat_body, KeyRecorder


def key(headers=None, route="chat", config=None, **body):
    """The plugin's answer for one request, with ``config`` as the server's section."""
    request = StrataRequest(route=route, body=chat_body(**body), headers=CIMultiDict(headers or {}))
    config = config or strata_session_header.SessionHeaderConfig()
    service = SimpleNamespace(plugin_config=lambda name, model: config)
    answer = strata_session_header.conversation_key(request, service)
    assert answer is None or answer.named, "a key the client named names one conversation"
    return None if answer is None else answer.key


def configure(strata_settings_factory, **section):
    settings = strata_settings_factory(plugins={"session_header": section})
    get_plugin_manager(settings, entrypoints=False, plugins=[strata_session_header])
    return settings.plugin_config("session_header", strata_session_header.SessionHeaderConfig)


USER_TOO = strata_session_header.SessionHeaderConfig(sources=["header", "metadata", "user"])


def test_each_source_names_the_conversation():
    assert key({"x-session-id": "chat-42"}) == "chat-42"
    assert key(metadata={"session_id": "s_7"}) == "s_7"
    assert key(user="user-1234", config=USER_TOO) == "user-1234"
    assert key(route="completion", user="user-1234", config=USER_TOO) == "user-1234"


def test_user_is_not_a_source_by_default():
    # A chat UI sends the same `user` with every conversation of one person: as a key it
    # would give all of them one file, and switching between them would park nothing.
    assert key(user="user-1234") is None
    assert key(route="completion", user="user-1234") is None


def test_without_an_id_it_defers():
    assert key() is None
    assert key(metadata={"trace": "x"}) is None


def test_a_session_beats_a_user():
    assert key({"X-Session-Id": "h"}, metadata={"session_id": "m"}, user="u", config=USER_TOO) == "h"
    assert key(metadata={"session_id": "m"}, user="u", config=USER_TOO) == "m"


@pytest.mark.parametrize("value, problem", [
    ("x" * 65, "65 characters long"),
    ("../../etc/passwd", "letters, digits"),
    ("two words", "letters, digits"),
    ("", "letters, digits"),
    ("café", "letters, digits"),
])
def test_a_bad_header_is_refused_naming_it(value, problem):
    with pytest.raises(strata_serve.KeyRefused, match=problem) as refused:
        key({"X-Session-Id": value})
    assert refused.value.param == "X-Session-Id"


def test_a_bad_metadata_session_id_is_refused():
    with pytest.raises(strata_serve.KeyRefused, match="must be a string") as refused:
        key(metadata={"session_id": 42})
    assert refused.value.param == "metadata.session_id"


def test_a_user_that_is_no_id_is_passed_over():
    # OpenAI's `user` is often an email: the client did not send it for us.
    assert key(user="ada@example.com", config=USER_TOO) is None
    assert key(user="ada@example.com", metadata={"session_id": "m"}, config=USER_TOO) == "m"


def test_header_name_and_sources_are_configurable(strata_settings_factory):
    config = configure(strata_settings_factory, header="X-Conversation", sources=["user", "header"])
    assert key({"X-Conversation": "c1"}, config=config) == "c1"
    assert key({"X-Session-Id": "ignored"}, config=config) is None
    assert key({"X-Conversation": "c1"}, config=config, user="u1") == "u1"
    assert key(config=config, metadata={"session_id": "m"}) is None


def test_an_unknown_source_stops_the_start(strata_settings_factory):
    from strata_serve.config import ConfigError

    with pytest.raises(ConfigError, match=r"plugins\.session_header\.sources\.0"):
        configure(strata_settings_factory, sources=["cookie"])


async def test_end_to_end_the_header_keys_and_a_bad_one_gets_400(strata_client_factory):
    keys = KeyRecorder()
    client = await strata_client_factory(strata_session_header, keys)
    resp = await client.post("/v1/chat/completions", json=chat_body(), headers={"X-Session-Id": "agent-1"})
    assert resp.status == 200
    resp = await client.post("/v1/chat/completions", json=chat_body(), headers={"X-Session-Id": "a/b"})
    body = await resp.json()
    assert_openai_error(body, 400, resp.status)
    assert body["error"]["param"] == "X-Session-Id"
    assert body["error"]["code"] == "invalid_conversation_key"
    assert keys.seen == ["agent-1"], "the refused request never reached the engine"
