"""Anthropic and Responses prompts as tokens: the backend's copy of llama-server's conversion
(``chat_bodies.py``) gives the very tokens the engine reads, checked against the engine's own
slot; a conversion that drifts from the engine's gives no tokens at all."""

from __future__ import annotations

import copy
import logging

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from plugins.session_header.tests.client_shapes import (
    SESSION_A, claude_code_body, claude_code_opening, claude_code_short_turn, claude_code_title_body,
    claude_code_tool_turn, codex_body, codex_short_turn, codex_tool_turn, CODEX_OPENING,
)
from strata_serve.engine.llama_server import chat_bodies
from strata_serve.engine.llama_server.chat_bodies import (NotConverted, anthropic_as_chat, normalized_billing,
                                                          responses_as_chat)


def claude_code_turns() -> dict[str, dict]:
    """Claude Code's requests: a first turn, one whose billing line has its stamp, one after a tool call, one with a thinking block
    and a tool result in parts, a title request, and a system prompt given as one string."""
    grown = claude_code_opening() + claude_code_tool_turn("utils") + claude_code_short_turn("Now run it.")
    thinking = claude_code_opening() + [
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "The test imports utils."},
                                          {"type": "tool_use", "id": "toolu_9", "name": "Bash",
                                           "input": {"path": "tests/", "cmd": "pytest -x"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_9",
                                      "content": [{"type": "text", "text": "1 failed, "},
                                                  {"type": "text", "text": "3 passed"}]}]}]
    as_string = {**claude_code_body(claude_code_opening(), SESSION_A), "system": "You are a helpful agent."}
    stamped = claude_code_body(claude_code_opening(), SESSION_A)
    stamped["system"][0]["text"] = "x-anthropic-billing-header: cc_version=2.1.197.0df; cc_entrypoint=cli; cch=a5145;"
    return {
        "first turn": claude_code_body(claude_code_opening(), SESSION_A),
        "a billing stamp": stamped,
        "after a tool call": claude_code_body(grown, SESSION_A),
        "thinking and parts": {**claude_code_body(thinking, SESSION_A),
                               "thinking": {"type": "enabled", "budget_tokens": 1024}},
        "title": claude_code_title_body(SESSION_A),
        "system as one string": as_string,
    }


def codex_turns() -> dict[str, dict]:
    """Codex's requests: a first turn, one after a tool call, one with a reasoning item of its
    own and one merged into the message before it, and an input given as one string."""
    grown = CODEX_OPENING + codex_tool_turn("cli") + codex_short_turn("Add a test too.")
    reasoning = CODEX_OPENING + [
        {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "Look at cli.py."}]},
        *codex_tool_turn("cli")]
    merged = CODEX_OPENING + [
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Looking."}]},
        {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "cli.py first."}]},
        *codex_tool_turn("cli")]
    return {
        "first turn": codex_body(CODEX_OPENING, "conv-1"),
        "reasoning merged into a message": codex_body(merged, "conv-1"),
        "after a tool call": codex_body(grown, "conv-1"),
        "a reasoning item": codex_body(reasoning, "conv-1"),
        "input as one string": {**codex_body([], None), "input": "Add a --verbose flag to cli.py"},
    }


#: A chat template that shows every field the conversions fill (the demo model's own shows
#: only roles and text): the tools, each call's name, id and arguments, the id a tool's result
#: answers, and the reasoning.
TOOLS_TEMPLATE = """\
{%- if tools %}<|im_start|>system
Tools: {{ tools | tojson }}<|im_end|>
{% endif %}
{%- for message in messages %}<|im_start|>{{ message.role }}
{%- if message.reasoning_content %} thinking: {{ message.reasoning_content }}{% endif %}
{%- if message.content is string %}{{ message.content }}
{%- elif message.content %}{% for part in message.content %}{{ part.text }}{% endfor %}{% endif %}
{%- if message.tool_calls %}{% for call in message.tool_calls %} call {{ call.id }}: {{ call.function.name }}
{{- call.function.arguments | tojson }}{% endfor %}{% endif %}
{%- if message.tool_call_id %} answers {{ message.tool_call_id }}{% endif %}<|im_end|>
{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


@pytest.fixture
def engine_showing_tools(llama_server_factory, tmp_path):
    """A llama-server whose chat template renders the tools, calls and reasoning."""
    template = tmp_path / "tools.jinja"
    template.write_text(TOOLS_TEMPLATE)

    async def make():
        return await llama_server_factory(extra_args=["--chat-template-file", str(template)])

    return make


CASES = ([("/v1/messages", name, body) for name, body in claude_code_turns().items()]
         + [("/v1/responses", name, body) for name, body in codex_turns().items()])


# -- the conversion alone ----------------------------------------------------------------


def test_a_billing_stamp_is_overwritten_as_the_engine_does_and_nothing_else_is():
    line = "x-anthropic-billing-header: cc_version=2.1.101.e51; cc_entrypoint=cli; cch=a5145;You are Claude Code."
    assert normalized_billing(line) == line.replace("cch=a5145;", "cch=fffff;")
    assert normalized_billing("You are cch=a5145; here") == "You are cch=a5145; here"
    cut = "x-anthropic-billing-header: cch=a51"
    assert normalized_billing(cut) == cut, "a stamp without its ';' is left as it is"


def test_a_tool_call_keeps_its_arguments_in_the_order_given_and_results_follow_the_message():
    body = {"messages": [{"role": "assistant", "content": [
        {"type": "text", "text": "Let me look."},
        {"type": "tool_use", "id": "t1", "name": "Read", "input": {"z": 1, "a": "é"}},
        {"type": "tool_result", "tool_use_id": "t0", "content": "old"}]}]}
    messages = anthropic_as_chat(body)["messages"]
    assert messages[0]["tool_calls"][0]["function"]["arguments"] == '{"z":1,"a":"é"}'
    assert messages[0]["content"] == [{"type": "text", "text": "Let me look."}]
    assert messages[1] == {"role": "tool", "tool_call_id": "t0", "content": "old"}


def test_responses_merge_an_assistant_message_and_its_tool_call_into_one():
    chat = responses_as_chat(codex_body(CODEX_OPENING + [
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Sure."}]},
        {"type": "function_call", "call_id": "c1", "name": "shell", "arguments": "{}"}], None))
    assistant = chat["messages"][-1]
    assert assistant["role"] == "assistant" and assistant["content"] == [{"text": "Sure.", "type": "text"}]
    assert [call["id"] for call in assistant["tool_calls"]] == ["c1"]
    assert chat["max_tokens"] == 16 and "max_output_tokens" not in chat and "input" not in chat


@pytest.mark.parametrize("body", [
    {"input": "hi", "previous_response_id": "resp_1"},
    {"input": [{"type": "mystery"}]},
    {"input": 3},
    {"input": "hi", "tools": "shell"},
], ids=["previous response", "unknown item", "input not text or list", "tools not a list"])
def test_a_responses_body_the_engine_refuses_is_not_converted(body):
    with pytest.raises(NotConverted):
        responses_as_chat(body)


def test_an_anthropic_body_without_messages_is_not_converted():
    with pytest.raises(NotConverted):
        anthropic_as_chat({"system": "hi"})


#: Any JSON, weighted towards the words the two conversions look for.
WORDS = ["text", "image", "tool_use", "tool_result", "thinking", "input_text", "input_image", "output_text",
         "refusal", "message", "function_call", "function_call_output", "reasoning", "user", "assistant", "system",
         "developer", "function", "base64", "url"]
FIELDS = ["type", "role", "content", "text", "source", "input", "id", "name", "tool_use_id", "thinking", "data",
          "url", "arguments", "call_id", "output", "summary", "status", "image_url", "refusal", "input_schema"]
ANY_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=4) | st.sampled_from(WORDS),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.sampled_from(FIELDS), inner, max_size=5),
    max_leaves=25)


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(anthropic=st.dictionaries(st.sampled_from(["system", "messages", "tools", "tool_choice", "stop_sequences",
                                                  "max_tokens", "thinking", "metadata"]), ANY_JSON, max_size=6),
       responses=st.dictionaries(st.sampled_from(["input", "instructions", "tools", "max_output_tokens", "reasoning",
                                                  "previous_response_id"]), ANY_JSON, max_size=6))
def test_any_body_converts_or_is_refused_as_the_engine_refuses_it(anthropic, responses):
    """Whatever a client sends, a conversion gives a chat or :class:`NotConverted`, never
    another error (it runs in a plugin's step at a switch)."""
    for convert, body in ((anthropic_as_chat, anthropic), (responses_as_chat, responses)):
        try:
            chat = convert(body)
        except NotConverted:
            continue
        assert isinstance(chat["messages"], list)


# -- against the engine --------------------------------------------------------------------


@pytest.mark.parametrize("path,name,body", CASES, ids=[f"{p} {n}" for p, n, _ in CASES])
async def test_the_tokens_made_are_the_ones_the_engine_reads(engine_showing_tools, path, name, body):
    """The engine answers the request itself; then the tokens made for it, sent as a prompt,
    reuse all but the last of them from the slot: the slot held exactly those tokens."""
    engine = await engine_showing_tools()
    tokens = await engine.prompt_tokens(path, copy.deepcopy(body))
    assert tokens, f"{name}: no tokens"
    status, answer = await engine.request("POST", path, {**body, "stream": False}, op="test")
    # With tools, the engine parses the answer for calls, and a random model's answer is none
    # (a 500 that names the format): the prompt was read all the same.
    assert status == 200 or "format" in str(answer), answer
    status, again = await engine.request("POST", "/completion",
                                         {"prompt": tokens, "n_predict": 1, "cache_prompt": True, "id_slot": 0},
                                         op="test")
    assert status == 200, again
    assert again["timings"]["cache_n"] == len(tokens) - 1, (name, again["timings"], len(tokens))


async def test_a_request_with_an_image_gives_no_tokens(llama_server_factory):
    engine = await llama_server_factory()
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}
    body = claude_code_body([{"role": "user", "content": [image, {"type": "text", "text": "What is it?"}]}], None)
    assert await engine.prompt_tokens("/v1/messages", body) is None
    codex = codex_body([{"type": "message", "role": "user", "content": [
        {"type": "input_image", "image_url": "data:image/png;base64,iVBORw0KGgo="}]}], None)
    assert await engine.prompt_tokens("/v1/responses", codex) is None


async def test_a_conversion_that_drifts_from_the_engine_gives_no_tokens_and_says_so_once(llama_server_factory,
                                                                                        monkeypatch, caplog):
    """Stands for an engine newer than the copy: the conversion drops the system prompt, the
    engine's count disagrees, and no tokens are given (a restore by key follows)."""
    engine = await llama_server_factory()
    body = claude_code_body(claude_code_opening(), SESSION_A)
    assert await engine.prompt_tokens("/v1/messages", body), "the control: the true conversion agrees"

    def without_system(given):
        chat = anthropic_as_chat(given)
        chat["messages"] = [m for m in chat["messages"] if m.get("role") != "system"]
        return chat

    monkeypatch.setitem(chat_bodies_paths(), "/v1/messages", without_system)
    caplog.set_level(logging.WARNING, logger="strata_serve.engine")
    assert await engine.prompt_tokens("/v1/messages", body) is None
    assert await engine.prompt_tokens("/v1/messages", body) is None
    said = [r.getMessage() for r in caplog.records if "copy of its conversion" in r.getMessage()]
    assert len(said) == 1 and "/v1/messages" in said[0], said


def chat_bodies_paths() -> dict:
    from strata_serve.engine.llama_server import prompts
    assert prompts.CONVERTED["/v1/messages"] is chat_bodies.anthropic_as_chat
    return prompts.CONVERTED
