"""system_prompt_key: an edited system prompt starts a new conversation."""

import strata_system_prompt_key
from strata_serve.default_plugins import opening_key as default_key
from strata_serve.hook_types import StrataRequest
from strata_serve.testing import KeyRecorder


def request(*messages, route="chat"):
    return StrataRequest(route=route, body={"messages": [{"role": r, "content": c} for r, c in messages]})


def key(*messages, route="chat"):
    return strata_system_prompt_key.conversation_key(request(*messages, route=route))


def test_the_system_prompt_is_part_of_the_key():
    first = key(("system", "You are terse."), ("user", "Plan a trip"))
    assert len(first) == 16
    assert key(("system", "You are terse."), ("user", "Plan a trip")) == first
    assert key(("system", "You are verbose."), ("user", "Plan a trip")) != first
    assert key(("system", "You are terse."), ("user", "Plan a walk")) != first


def test_later_turns_keep_the_key():
    opening = [("system", "You are terse."), ("user", "Plan a trip")]
    later = opening + [("assistant", "Where to?"), ("user", "Rome"), ("system", "Be brief.")]
    assert key(*later) == key(*opening)


def test_developer_messages_and_text_parts_count():
    parts = [{"type": "text", "text": "You are "}, {"type": "text", "text": "terse."}]
    assert key(("developer", parts), ("user", "Hi")) == key(("developer", "You are terse."), ("user", "Hi"))
    assert key(("developer", "You are terse."), ("user", "Hi")) != key(("user", "Hi"))


def test_the_parts_cannot_run_into_each_other():
    assert key(("system", "ab"), ("user", "c")) != key(("system", "a"), ("user", "bc"))
    assert key(("system", "a"), ("system", "b"), ("user", "c")) != key(("system", "ab"), ("user", "c"))


def test_without_a_system_prompt_or_user_text_it_defers_to_the_built_in_key():
    assert key(("user", "Plan a trip")) is None
    assert key(("system", ""), ("user", "Plan a trip")) is None
    assert key(("system", "You are terse.")) is None
    assert key(("system", "You are terse."), ("user", "Hi"), route="completion") is None
    assert default_key.conversation_key(request(("user", "Plan a trip"))) is not None


async def test_end_to_end_an_edited_system_prompt_is_a_new_conversation(strata_client_factory):
    keys = KeyRecorder()
    client = await strata_client_factory(strata_system_prompt_key, keys)
    for system in ("You are terse.", "You are terse.", "You are verbose."):
        body = {"messages": [{"role": "system", "content": system}, {"role": "user", "content": "Hi"}],
                "max_tokens": 4, "temperature": 0}
        resp = await client.post("/v1/chat/completions", json=body)
        assert resp.status == 200
    first, again, edited = keys.seen
    assert first == again and edited != first
