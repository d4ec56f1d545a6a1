"""OpenAI's Responses API, with the official ``openai`` SDK, against the real engine."""

from __future__ import annotations

import asyncio

import openai
import pytest

import strata_auto_sessions
from strata_serve.api import SERVICE
from strata_serve.testing import conversation

OWN_STATE = 600


def opening(name: str) -> str:
    return conversation(name)[0]["content"]


@pytest.fixture
async def parked(strata_client_factory, strata_settings_factory):
    settings = strata_settings_factory(engine={"cache_ram_mib": 0},
                                       plugins={"auto_sessions": {"min_tokens": 100, "idle_save_s": 0}})
    client = await strata_client_factory(strata_auto_sessions, settings=settings)
    sdk = openai.OpenAI(base_url=str(client.make_url("/v1")), api_key="unused", max_retries=0)
    yield client, sdk
    sdk.close()


async def test_responses_through_a_switch_and_back_reuse_the_parked_state(parked):
    client, sdk = parked
    service = client.app[SERVICE]

    def ask(name: str):
        raw = sdk.responses.with_raw_response.create(
            model="local", instructions="You are terse.", max_output_tokens=4, temperature=0,
            input=[{"role": "user", "content": [{"type": "input_text", "text": opening(name)}]}],
        )
        return raw.parse(), raw.headers

    first, headers = await asyncio.to_thread(ask, "responses-a")
    assert first.output_text and headers["X-Strata-State"] == "none"
    # usage (input_tokens counts the reused ones) gave the picture its numbers.
    assert service.slots[0].tokens == first.usage.input_tokens + first.usage.output_tokens - 1
    await service.check_slots()
    assert service.slots.corrections == 0

    await asyncio.to_thread(ask, "responses-b")
    back, headers = await asyncio.to_thread(ask, "responses-a")
    assert back.usage.input_tokens_details.cached_tokens >= OWN_STATE, back.usage
    assert headers["X-Strata-State"] == "disk" and int(headers["X-Strata-Restored-Tokens"]) >= OWN_STATE
    assert service.state["auto_sessions"].stats.restores == 1


async def test_streamed_responses_through_a_switch_and_back(parked):
    client, sdk = parked
    service = client.app[SERVICE]

    def ask(text: str):
        stream = sdk.responses.create(model="local", input=text, max_output_tokens=4, temperature=0, stream=True)
        kinds, completed = [], None
        for event in stream:
            kinds.append(event.type)
            if event.type == "response.completed":
                completed = event.response
        return kinds, completed, stream.response.headers

    kinds, first, headers = await asyncio.to_thread(ask, opening("responses-stream-a"))
    assert kinds[-1] == "response.completed" and "response.output_text.delta" in kinds
    assert headers["Content-Type"].startswith("text/event-stream")
    assert service.slots[0].tokens == first.usage.input_tokens + first.usage.output_tokens - 1
    await asyncio.to_thread(ask, opening("responses-stream-b"))
    _, back, headers = await asyncio.to_thread(ask, opening("responses-stream-a"))
    assert back.usage.input_tokens_details.cached_tokens >= OWN_STATE, back.usage
    assert headers["X-Strata-State"] == "disk"
    await service.check_slots()
    assert service.slots.corrections == 0


async def test_a_prompt_cache_key_names_the_conversation(parked):
    client, _ = parked
    keys = []
    for text in ("first words", "other words"):
        resp = await client.post("/v1/responses", json={"input": text, "max_output_tokens": 1,
                                                        "prompt_cache_key": "codex-session-1"})
        assert resp.status == 200, await resp.text()
        keys.append(resp.headers["X-Strata-Conversation"])
    assert keys[0] == keys[1]
    resp = await client.post("/v1/responses", json={"input": "first words", "max_output_tokens": 1})
    assert resp.headers["X-Strata-Conversation"] != keys[0]


async def test_bad_responses_bodies_are_refused_in_openais_shape(parked):
    client, sdk = parked
    for bad in ({"max_output_tokens": 2}, {"input": 5},
                {"input": [{"role": "user", "content": [{"type": "input_text", "text": 5}]}]},
                {"input": "hi", "tools": [{"type": "function"}]}, {"input": "hi", "max_output_tokens": -1},
                {"input": "hi", "previous_response_id": "resp_x"}):
        resp = await client.post("/v1/responses", json=bad)
        assert resp.status == 400, (bad, await resp.text())
        body = await resp.json()
        assert set(body) == {"error"} and body["error"]["message"], body
    with pytest.raises(openai.BadRequestError):
        await asyncio.to_thread(sdk.responses.create, model="local", input="hi", max_output_tokens=-1)
