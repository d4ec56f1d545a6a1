"""The engine's other routes through strata-serve: embeddings, infill, and the ones that touch no slot."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest

import strata_auto_sessions
import strata_session_header
from strata_serve.api import SERVICE
from strata_serve.demo_model import write_demo_model
from strata_serve.testing import assert_openai_error, conversation

PARKING = {"auto_sessions": {"min_tokens": 100, "idle_save_s": 0}}


@pytest.fixture
def fim_model(tmp_path_factory):
    return write_demo_model(tmp_path_factory.mktemp("fim") / "fim.gguf", fim=True)


async def chat(client, name: str):
    resp = await client.post("/v1/chat/completions",
                             json={"messages": conversation(name), "max_tokens": 2, "temperature": 0})
    assert resp.status == 200, await resp.text()
    return resp


async def test_routes_that_touch_no_slot_never_evict_or_save(strata_client_factory, strata_settings_factory):
    client = await strata_client_factory(strata_auto_sessions, settings=strata_settings_factory(plugins=PARKING))
    service = client.app[SERVICE]
    await chat(client, "untouched")
    held = replace(service.slots[0])
    calls = [("POST", "/tokenize", {"content": "Hello there", "with_pieces": True}),
             ("POST", "/detokenize", {"tokens": [300, 329]}),
             ("POST", "/apply-template", {"messages": [{"role": "user", "content": "Hello"}]}),
             ("GET", "/props", None),
             ("POST", "/v1/messages/count_tokens", {"messages": [{"role": "user", "content": "Hello"}]})]
    # They are answered while another request holds the FIFO: they never wait in it.
    busy = await service.fifo.acquire()
    try:
        for method, path, body in calls:
            resp = await asyncio.wait_for(client.request(method, path, json=body), 10)
            assert resp.status == 200, (path, await resp.text())
            assert await resp.json()
    finally:
        service.fifo.release(busy)
    assert service.slots[0] == held
    assert service.state["auto_sessions"].stats.saves == 0
    again = await chat(client, "untouched")
    assert again.headers["X-Strata-State"] == "slot"


async def test_detokenize_refuses_ids_outside_the_vocabulary(strata_client_factory):
    client = await strata_client_factory()
    for tokens in ([99_999_999], [-1], ["a"]):
        resp = await client.post("/detokenize", json={"tokens": tokens})
        assert_openai_error(await resp.json(), 400, resp.status)
    resp = await client.post("/tokenize", json={"content": 5})
    assert_openai_error(await resp.json(), 400, resp.status)
    resp = await client.post("/apply-template", json={"messages": [{"role": "user", "content": [{"type": "text"}]}]})
    assert_openai_error(await resp.json(), 400, resp.status)


async def test_embeddings_go_through_the_fifo_unkeyed(strata_client_factory, strata_settings_factory):
    settings = strata_settings_factory(plugins=PARKING,
                                       engine={"extra_args": ["--embeddings", "--pooling", "mean"]})
    client = await strata_client_factory(strata_auto_sessions, strata_session_header, settings=settings)
    service = client.app[SERVICE]
    await chat(client, "embed-a")
    # Even a session id does not key them: no conversation is left in the slot.
    resp = await client.post("/v1/embeddings", json={"input": ["hello", "world"]}, headers={"X-Session-Id": "s1"})
    assert resp.status == 200, await resp.text()
    answer = await resp.json()
    assert len(answer["data"]) == 2 and len(answer["data"][0]["embedding"]) == 64
    assert resp.headers["X-Strata-State"] == "unkeyed"
    assert service.state["auto_sessions"].stats.saves == 1, "the held conversation was parked first"
    assert service.slots[0].key is None
    back = await chat(client, "embed-a")
    assert back.headers["X-Strata-State"] == "disk"
    resp = await client.post("/v1/embeddings", json={"input": 5})
    assert_openai_error(await resp.json(), 400, resp.status)


async def test_embeddings_the_engine_does_not_serve_are_a_400(strata_client_factory):
    client = await strata_client_factory()
    resp = await client.post("/v1/embeddings", json={"input": "hello"})
    body = await resp.json()
    assert_openai_error(body, 400, resp.status)
    assert body["error"]["code"] == "not_supported" and "--embeddings" in body["error"]["message"]


async def test_infill_is_one_conversation_parked_around_a_chat(strata_client_factory, strata_settings_factory,
                                                               fim_model):
    settings = strata_settings_factory(plugins=PARKING, engine={"model": str(fim_model)})
    client = await strata_client_factory(strata_auto_sessions, settings=settings)
    service = client.app[SERVICE]
    extra = [{"filename": "ships.py", "text": conversation("infill")[0]["content"]}]
    body = {"input_prefix": "def sail(", "input_suffix": "):\n", "input_extra": extra, "n_predict": 3,
            "temperature": 0}
    resp = await client.post("/infill", json=body)
    assert resp.status == 200, await resp.text()
    first = await resp.json()
    assert resp.headers["X-Strata-Conversation"] == "infill" and first["timings"]["predicted_n"] == 3
    await service.check_slots()
    assert service.slots.corrections == 0
    await chat(client, "infill-chat")
    resp = await client.post("/infill", json={**body, "stream": True})
    assert resp.status == 200
    events = (await resp.read()).decode()
    assert resp.headers["X-Strata-State"] == "disk"
    assert '"stop":true' in events and '"timings"' in events
    stats = service.state["auto_sessions"].stats
    assert stats.restores == 1 and stats.saves == 2
    await service.check_slots()
    assert service.slots.corrections == 0
    for bad in ({"input_prefix": "a"}, {"input_prefix": "a", "input_suffix": ["x"]},
                {"input_prefix": "a", "input_suffix": "b", "id_slot": 3}):
        resp = await client.post("/infill", json=bad)
        assert_openai_error(await resp.json(), 400, resp.status)


async def test_infill_on_a_model_without_its_tokens_is_a_400(strata_client_factory):
    client = await strata_client_factory()
    resp = await client.post("/infill", json={"input_prefix": "a", "input_suffix": "b"})
    assert_openai_error(await resp.json(), 400, resp.status)
