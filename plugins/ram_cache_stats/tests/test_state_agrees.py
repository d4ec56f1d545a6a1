"""``X-Strata-State`` and ``/stats`` say the same of every request: the core decides where a
request's state came from, once, and both read it (real engine)."""

from __future__ import annotations

from typing import Any

from strata_serve.testing import chat, conversation


async def stats(client) -> dict[str, Any]:
    resp = await client.get("/stats")
    assert resp.status == 200, await resp.text()
    return await resp.json()


async def send(client, body: dict[str, Any], path: str = "/v1/chat/completions") -> str:
    """Send one request; fail unless ``/stats`` counted it under the source its header named.

    A stream's headers leave before the engine says what it reused: its ``engine`` is
    then ``ram`` or ``none``, which the answer's end decides.

    :returns: the source, as ``/stats`` counted it.
    """
    before = (await stats(client))["requests_by_source"]
    resp = await client.post(path, json=body)
    assert resp.status == 200, await resp.text()
    await resp.read()
    header = resp.headers["X-Strata-State"]
    after = await stats(client)
    counted = {source: n - before.get(source, 0) for source, n in after["requests_by_source"].items()
               if n != before.get(source, 0)}
    assert len(counted) == 1 and list(counted.values()) == [1], (header, counted)
    [source] = counted
    if header == "engine":
        assert body.get("stream") and source in ("ram", "none"), (header, source)
    else:
        assert source == header, f"X-Strata-State says {header}, /stats counted {source}"
    key = resp.headers.get("X-Strata-Conversation")
    if key is not None:
        [record] = [row for row in after["conversations"] if row["key"] == key]
        assert record["last_source"] == source
    return source


async def test_with_auto_sessions_the_header_and_stats_agree_on_every_request(stats_client):
    client = await stats_client(auto_sessions=True)
    a, b, c = conversation("agree-a", 3), conversation("agree-b", 2), conversation("agree-c")
    assert await send(client, chat(a[:1])) == "none", "a conversation's first request"
    assert await send(client, chat(a[:3])) == "slot"
    assert await send(client, chat(b[:1])) == "none"
    assert await send(client, chat(a)) == "disk"
    assert await send(client, chat(b[:1], stream=True)) == "disk", "a stream restored from its file"
    assert await send(client, chat(b, stream=True)) == "slot", "a stream the slot held"
    # The slot holds the conversation, yet its history changed: the engine reuses little.
    edited = [{"role": "system", "content": "Answer in French."}, *b]
    assert await send(client, chat(edited)) == "slot"
    assert await send(client, {"prompt": "Once upon", "max_tokens": 2}, "/v1/completions") == "unkeyed"
    assert await send(client, chat(c, stream=True)) == "none", "a stream the engine read anew"


async def test_with_the_ram_cache_the_header_and_stats_agree_on_every_request(stats_client):
    client = await stats_client(engine={"cache_ram_mib": 256})
    x, y = conversation("agree-x"), conversation("agree-y")
    assert await send(client, chat(x)) == "none"
    assert await send(client, chat(y)) == "none"
    assert await send(client, chat(x)) == "ram", "a switch back the RAM cache served"
    assert await send(client, chat(y, stream=True)) == "ram", "a stream the RAM cache served"
    # A return whose prompt grew far past what it had: most of it is read anew.
    longer = x + [{"role": "assistant", "content": "noted"},
                  {"role": "user", "content": " ".join(f"tide{n} moon harbour" for n in range(120))}]
    assert await send(client, chat(y)) == "slot"
    assert await send(client, chat(longer)) == "none", "reused less than half of its prompt"
