"""Response headers tell the client what strata did for its conversation."""

from __future__ import annotations

import strata_auto_sessions
from strata_serve.testing import conversation


def body(messages, **extra):
    return {"messages": messages, "max_tokens": 4, "temperature": 0, **extra}


async def state(client, messages, **extra):
    resp = await client.post("/v1/chat/completions", json=body(messages, **extra))
    assert resp.status == 200, await resp.text()
    await resp.read()
    return resp.headers.get("X-Strata-State"), resp.headers


async def test_slot_disk_and_a_full_read_are_told_apart(strata_client_factory, strata_settings_factory):
    settings = strata_settings_factory(plugins={"auto_sessions": {"min_tokens": 100}})
    client = await strata_client_factory(strata_auto_sessions, settings=settings)
    a, b = conversation("hdr-a"), conversation("hdr-b")
    first, headers = await state(client, a)
    assert first == "none" and headers["X-Strata-Restored-Tokens"] == "0"
    assert len(headers["X-Strata-Conversation"]) == 16
    assert (await state(client, a))[0] == "slot"
    assert (await state(client, b))[0] == "none"
    back, headers = await state(client, a)
    assert back == "disk" and int(headers["X-Strata-Restored-Tokens"]) > 700
    streamed, headers = await state(client, b, stream=True)
    assert streamed == "disk" and headers["Content-Type"].startswith("text/event-stream")
    assert (await state(client, b, stream=True))[0] == "slot"
    resp = await client.post("/v1/completions", json={"prompt": "Once", "max_tokens": 2})
    assert resp.headers["X-Strata-State"] == "unkeyed" and "X-Strata-Conversation" not in resp.headers


async def test_a_return_the_engines_ram_cache_brought_back_says_ram(strata_client_factory, strata_settings_factory):
    client = await strata_client_factory(settings=strata_settings_factory(engine={"cache_ram_mib": 256}))
    a, b = conversation("ram-hdr-a"), conversation("ram-hdr-b")
    await state(client, a)
    await state(client, b)
    assert (await state(client, a))[0] == "ram"
    assert (await state(client, b, stream=True))[0] == "engine", "a stream's headers leave before the engine says"
