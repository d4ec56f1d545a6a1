"""Anthropic's Messages API, with the official ``anthropic`` SDK, against the real engine.

A switch and back reuses the parked state (the engine says so in
``usage.cache_read_input_tokens``), every refusal is in Anthropic's error shape, and
the slot picture records what the engine says the slot holds.
"""

from __future__ import annotations

import asyncio

import anthropic
import pytest

import strata_auto_sessions
from strata_serve.api import SERVICE
from strata_serve.testing import conversation

#: A return reused its own state when it reused at least this much of its ~750-token opening.
OWN_STATE = 600


def opening(name: str) -> str:
    return conversation(name)[0]["content"]


@pytest.fixture
def parked_client(strata_client_factory, strata_settings_factory):
    """A server with auto-sessions parking from 100 tokens, the engine's RAM cache off."""

    async def make(**server):
        settings = strata_settings_factory(
            server=server, engine={"cache_ram_mib": 0},
            plugins={"auto_sessions": {"min_tokens": 100, "idle_save_s": 0}},
        )
        return await strata_client_factory(strata_auto_sessions, settings=settings)

    return make


#: SDK clients made by a test, closed after it (an unclosed one leaks its sockets).
_made: list[anthropic.Anthropic] = []


@pytest.fixture(autouse=True)
def close_sdk_clients():
    yield
    while _made:
        _made.pop().close()


def sdk(client, **options) -> anthropic.Anthropic:
    options = {"api_key": "unused", "max_retries": 0, **options}
    made = anthropic.Anthropic(base_url=str(client.make_url("")).rstrip("/"), **options)
    _made.append(made)
    return made


def assert_anthropic_error(body, kind: str | None = None) -> None:
    assert isinstance(body, dict) and body.get("type") == "error", body
    assert set(body) == {"type", "error"}, body
    assert isinstance(body["error"].get("message"), str) and body["error"]["message"], body
    if kind is not None:
        assert body["error"]["type"] == kind, body


async def test_the_sdk_through_a_switch_and_back_reuses_the_parked_state(parked_client):
    client = await parked_client()
    service = client.app[SERVICE]
    messages = sdk(client).messages

    def ask(name: str):
        raw = messages.with_raw_response.create(
            model="local", max_tokens=4, extra_body={"temperature": 0}, system="You are terse.",
            messages=[{"role": "user", "content": [{"type": "text", "text": opening(name)}]}],
        )
        return raw.parse(), raw.headers

    first, headers = await asyncio.to_thread(ask, "anthropic-a")
    assert first.content[0].type == "text" and first.usage.output_tokens == 4
    assert headers["X-Strata-State"] == "none" and len(headers["X-Strata-Conversation"]) == 16
    # The picture took its numbers from usage: what the engine says the slot holds.
    recorded = service.slots[0].tokens
    assert recorded == first.usage.input_tokens + first.usage.cache_read_input_tokens + 3
    await service.check_slots()
    assert service.slots.corrections == 0 and service.slots[0].tokens == recorded

    await asyncio.to_thread(ask, "anthropic-b")
    back, headers = await asyncio.to_thread(ask, "anthropic-a")
    assert back.usage.cache_read_input_tokens >= OWN_STATE, back.usage
    assert headers["X-Strata-State"] == "disk" and int(headers["X-Strata-Restored-Tokens"]) >= OWN_STATE
    stats = service.state["auto_sessions"].stats
    assert stats.saves >= 2 and stats.restores == 1, stats


async def test_the_sdk_streams_through_a_switch_and_back(parked_client):
    client = await parked_client()
    service = client.app[SERVICE]
    messages = sdk(client).messages

    def ask(name: str):
        with messages.stream(model="local", max_tokens=4, extra_body={"temperature": 0},
                             messages=[{"role": "user", "content": opening(name)}]) as stream:
            text = "".join(stream.text_stream)
            final = stream.get_final_message()
            return text, final, stream.response.headers

    text, first, headers = await asyncio.to_thread(ask, "anthropic-stream-a")
    assert text and headers["Content-Type"].startswith("text/event-stream")
    assert service.slots[0].tokens == first.usage.input_tokens + first.usage.cache_read_input_tokens + 3
    await asyncio.to_thread(ask, "anthropic-stream-b")
    _, back, headers = await asyncio.to_thread(ask, "anthropic-stream-a")
    assert back.usage.cache_read_input_tokens >= OWN_STATE, back.usage
    assert headers["X-Strata-State"] == "disk"
    assert service.state["auto_sessions"].stats.restores == 1
    await service.check_slots()
    assert service.slots.corrections == 0


async def test_count_tokens_counts_and_touches_nothing(parked_client):
    client = await parked_client()
    service = client.app[SERVICE]
    sdk_client = sdk(client)
    await asyncio.to_thread(sdk_client.messages.create, model="local", max_tokens=2,
                            messages=[{"role": "user", "content": opening("count-a")}])
    held = repr(service.slots[0])
    counted = await asyncio.to_thread(sdk_client.messages.count_tokens, model="local",
                                      messages=[{"role": "user", "content": opening("count-b")}])
    assert counted.input_tokens > OWN_STATE
    assert repr(service.slots[0]) == held
    assert service.state["auto_sessions"].stats.saves == 0


async def test_every_refusal_is_in_anthropics_shape(parked_client):
    client = await parked_client(api_key="secret")
    headers = {"Authorization": "Bearer secret"}
    body = {"model": "local", "max_tokens": 2, "messages": [{"role": "user", "content": "Hello"}]}

    resp = await client.post("/v1/messages", data=b"{not json", headers={**headers, "Content-Type": "application/json"})
    assert resp.status == 400
    assert_anthropic_error(await resp.json(), "invalid_request_error")
    resp = await client.post("/v1/messages", json=body)
    assert resp.status == 401
    assert_anthropic_error(await resp.json(), "authentication_error")
    resp = await client.post("/v1/messages", data=b"x", headers={**headers, "Content-Type": "text/plain"})
    assert resp.status == 415
    assert_anthropic_error(await resp.json())
    resp = await client.post("/v1/messages", json=body, headers={**headers, "Origin": "https://evil.example"})
    assert resp.status == 403
    assert_anthropic_error(await resp.json(), "permission_error")
    resp = await client.post("/v1/messages/nope", json=body, headers=headers)
    assert resp.status == 404
    assert_anthropic_error(await resp.json(), "not_found_error")
    for bad in ({**body, "max_tokens": 0}, {**body, "messages": [{"role": "user", "content": [{"type": "text"}]}]},
                {**body, "system": [{"type": "text"}]}, {key: v for key, v in body.items() if key != "messages"}):
        resp = await client.post("/v1/messages", json=bad, headers=headers)
        assert resp.status == 400, bad
        assert_anthropic_error(await resp.json(), "invalid_request_error")
    # OpenAI routes keep OpenAI's shape.
    resp = await client.post("/v1/chat/completions", json={"messages": []}, headers=headers)
    assert resp.status == 400 and set(await resp.json()) == {"error"}

    # The key Anthropic's clients send (X-Api-Key) is taken too, and the SDK reads our errors.
    keyed = sdk(client, api_key="secret")
    reply = await asyncio.to_thread(keyed.messages.create, **body)
    assert reply.usage.output_tokens == 2
    with pytest.raises(anthropic.AuthenticationError):
        await asyncio.to_thread(sdk(client, api_key="wrong").messages.create, **body)
    with pytest.raises(anthropic.BadRequestError) as refused:
        await asyncio.to_thread(keyed.messages.create, **{**body, "max_tokens": 0})
    assert "max_tokens" in refused.value.body["error"]["message"]


async def test_a_system_message_among_the_messages_is_answered_as_the_engine_answers_it(parked_client):
    """Claude Code's first request of a session carries its environment as a ``system``
    message after the first user message; the engine takes it, so strata-serve does too
    (a refusal cost every new session a failed round trip). Other roles are still refused."""
    client = await parked_client()
    text = [{"type": "text", "text": "Hello"}]
    body = {"model": "local", "max_tokens": 2, "stream": False,
            "messages": [{"role": "user", "content": text},
                         {"role": "system", "content": [{"type": "text", "text": "# Environment\nlinux"}]}]}
    resp = await client.post("/v1/messages", json=body)
    assert resp.status == 200, await resp.text()
    answer = await resp.json()
    assert answer["type"] == "message" and answer["usage"]["output_tokens"] == 2, answer
    for role in ("tool", "robot"):
        resp = await client.post("/v1/messages", json={**body, "messages": [{"role": role, "content": text}]})
        assert resp.status == 400, role
        assert_anthropic_error(await resp.json(), "invalid_request_error")


async def test_a_full_queue_is_refused_in_anthropics_shape(parked_client):
    client = await parked_client(queue_limit=0)
    fifo = client.app[SERVICE].fifo
    held = await fifo.acquire()  # another request holds the engine
    try:
        resp = await client.post("/v1/messages", json={"max_tokens": 2, "messages": [{"role": "user", "content": "x"}]})
        assert resp.status == 503 and resp.headers["Retry-After"]
        assert_anthropic_error(await resp.json(), "overloaded_error")
    finally:
        fifo.release(held)
