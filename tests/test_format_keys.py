"""The default key, and the keying plugins, understand every API's way of opening a conversation."""

from __future__ import annotations

import hashlib

import pytest

import strata_system_prompt_key
from strata_serve.default_plugins.opening_key import conversation_key
from strata_serve.hook_types import ConversationKey, StrataRequest

TEXT = "Describe this picture"
RED, BLUE = "data:image/png;base64,cmVk", "data:image/png;base64,Ymx1ZQ=="


def key(route, body, plugin=conversation_key):
    return plugin(request=StrataRequest(route=route, body=body))


def chat(image):
    return {"messages": [{"role": "user", "content": [{"type": "text", "text": TEXT},
                                                      {"type": "image_url", "image_url": {"url": image}}]}]}


def anthropic(image):
    return {"messages": [{"role": "user", "content": [
        {"type": "text", "text": TEXT, "cache_control": {"type": "ephemeral"}},
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": image}}]}]}


def responses(image):
    return {"input": [{"role": "user", "content": [{"type": "input_text", "text": TEXT},
                                                   {"type": "input_image", "image_url": image}]}]}


@pytest.mark.parametrize("route, body", [("chat", chat), ("messages", anthropic), ("responses", responses)])
def test_the_same_words_with_other_images_are_other_conversations(route, body):
    assert key(route, body(RED)) != key(route, body(BLUE))
    assert key(route, body(RED)) == key(route, body(RED))
    assert key(route, body(RED)) != hashlib.sha1(TEXT.encode()).hexdigest()[:16]


def test_text_openings_keep_their_key_in_every_format():
    expected = hashlib.sha1(TEXT.encode()).hexdigest()[:16]
    assert key("chat", {"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": TEXT}]}) == expected
    assert key("messages", {"system": "S", "messages": [{"role": "user", "content": [{"type": "text", "text": TEXT}]},
                                                        {"role": "assistant", "content": "ok"}]}) == expected
    assert key("responses", {"instructions": "S", "input": TEXT}) == expected
    assert key("responses", {"input": [{"type": "message", "role": "developer", "content": "S"},
                                       {"type": "message", "role": "user", "content": TEXT},
                                       {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"}]}) \
        == expected
    assert key("infill", {"input_prefix": "a", "input_suffix": "b"}) == ConversationKey("infill", named=True)
    assert key("completion", {"prompt": TEXT}) is None and key("embeddings", {"input": TEXT}) is None


def test_system_prompt_key_reads_every_formats_system_prompt():
    plugin = strata_system_prompt_key.conversation_key
    chat_key = key("chat", {"messages": [{"role": "system", "content": "Be terse."},
                                         {"role": "user", "content": TEXT}]}, plugin)
    assert chat_key is not None
    assert key("messages", {"system": [{"type": "text", "text": "Be terse."}],
                            "messages": [{"role": "user", "content": TEXT}]}, plugin) == chat_key
    assert key("responses", {"instructions": "Be terse.", "input": TEXT}, plugin) == chat_key
    assert key("messages", {"system": "Be brief.", "messages": [{"role": "user", "content": TEXT}]}, plugin) != chat_key
    assert key("messages", {"messages": [{"role": "user", "content": TEXT}]}, plugin) is None
