"""Clients unlike ours: several at once, over real sockets, closing whenever they like.

Agents stream with ``requests`` and close the connection as soon as they have read
the last event; chat UIs give up on a slow answer; scripts time out while queued.
Whatever they do, every conversation must come back with its state: from the slot,
from its file, or (with the engine's RAM cache on) from the engine, never re-read.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import socket
from pathlib import Path

import anthropic
import pytest
import requests

from strata_serve.api import SERVICE
from strata_serve.testing import conversation

from tests.parked_state import settle
from tests.slot_reads import ENGINE_ARGS, SlotReads

from strata_auto_sessions.testing import is_parked

#: How each request's client behaves.
PATTERNS = (
    "after_last_event",   # read up to the event with the timings, then close (before [DONE])
    "before_first_byte",  # send the request, close at once
    "mid_stream",         # read two events, close
    "after_done",         # read everything, [DONE] included, then close
    "timeout_queued",     # non-streaming, gives up after 50 ms (while others hold the FIFO)
    "timeout_running",    # non-streaming, a long answer, gives up after 300 ms
    "read_all",           # a well-behaved client
)
#: A return reused its own state when it reused at least this much of its opening
#: (each opening is about 750 tokens; only the chat template's few tokens are shared).
OWN_STATE = 600


def body(messages: list[dict], *, stream: bool, max_tokens: int = 8) -> dict:
    return {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": stream}


def client_turn(url: str, messages: list[dict], pattern: str) -> dict | None:
    """One turn by a client of this pattern; returns the timings it saw, if any."""
    endpoint = url + "/v1/chat/completions"
    if pattern == "before_first_byte":
        payload = json.dumps(body(messages, stream=True)).encode()
        host, port = url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            # The Host a client would send: any other name is refused (DNS rebinding) and the
            # request would never reach the server.
            sock.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}:{port}\r\n".encode()
                         + b"Content-Type: application/json\r\n"
                         + f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
        return None
    if pattern.startswith("timeout"):
        queued = pattern == "timeout_queued"
        try:
            reply = requests.post(endpoint, json=body(messages, stream=False, max_tokens=8 if queued else 3000),
                                  timeout=0.05 if queued else 0.3)
            return reply.json().get("timings")
        except requests.exceptions.Timeout:
            return None
    with requests.post(endpoint, json=body(messages, stream=True), stream=True, timeout=60) as reply:
        assert reply.status_code == 200, reply.text
        events = 0
        for line in reply.iter_lines():
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                if pattern == "after_done":
                    break
                continue
            events += 1
            event = json.loads(data)
            if pattern == "mid_stream" and events >= 2:
                return None
            if "timings" in event and pattern == "after_last_event":
                return event["timings"]  # leaving the with-block closes the connection now
    return None


async def read_all(url: str, messages: list[dict]) -> dict:
    def call() -> dict:
        reply = requests.post(url + "/v1/chat/completions", json=body(messages, stream=False), timeout=60)
        assert reply.status_code == 200, reply.text
        return reply.json()

    return await asyncio.to_thread(call)


@pytest.mark.parametrize("cache_ram_mib,parallel", [(0, 1), (1, 1), (None, 1), (0, 2), (None, 2)],
                         ids=["ram-off", "ram-below-working-set", "ram-default", "ram-off-2-slots",
                              "ram-default-2-slots"])
async def test_concurrent_impatient_clients_never_lose_a_conversation(auto_client, caplog, cache_ram_mib, parallel):
    """Every turn after a conversation's first, impatient or not, finds its state: checked
    on the engine's own count of what each request read in its slot, so a conversation
    lost in one round and rebuilt by its next (cut) turn cannot pass, nor one that ran
    beside another."""
    slot_reads = SlotReads(caplog)
    client = await auto_client(slot_reads, engine={"cache_ram_mib": cache_ram_mib, "parallel": parallel,
                                                   "ctx_size": 4096 * parallel, "extra_args": ENGINE_ARGS},
                               idle_save_s=0)
    url = str(client.make_url("")).rstrip("/")
    names = ["main-a", "main-b", "main-c"]
    chats = {name: conversation(name) for name in names}
    patterns = itertools.cycle(PATTERNS)
    for round_ in range(1, 5):
        turns, used = [], {}
        for name in names:
            chats[name] = chats[name] + [{"role": "assistant", "content": f"noted {round_}"},
                                         {"role": "user", "content": f"step {round_} of {name}?"}]
            used[name] = next(patterns)
            turns.append(asyncio.to_thread(client_turn, url, chats[name], used[name]))
        await asyncio.gather(*turns)
        await settle(client)
        # Checked after each round: a conversation lost here and rebuilt by its next turn,
        # cut or not, has read its opening twice.
        assert not slot_reads.rereads(OWN_STATE), (round_, used, slot_reads.reads, parking_numbers(client))
    # The count sees reads: each conversation's opening was read, once; no request went uncounted.
    assert len({read.key for read in slot_reads.reads if (read.tokens or 0) >= OWN_STATE}) == len(names), (
        slot_reads.reads)
    unsaid = [read for read in slot_reads.reads if read.tokens is None]
    assert len(unsaid) <= len(slot_reads.reads) // 10, ("most tasks are accounted for", unsaid)
    assert not [r for r in caplog.records if "slot_reads failed" in r.getMessage()], [
        r.exc_text or r.getMessage() for r in caplog.records if "slot_reads failed" in r.getMessage()]
    # Every conversation returns, read to the end, one at a time and all switches.
    for name in names + names:
        reply = await read_all(url, chats[name])
        assert reply["timings"]["cache_n"] >= OWN_STATE, (name, reply["timings"], parking_numbers(client))
    # The last answer reached its client before the server's own steps after it (the
    # reads' count among them) ended: they end here, not in the stop.
    await settle(client)
    service = client.app[SERVICE]
    assert not list(Path(service.engine.info.slot_save_path).glob("tmp-*")), "no temporary left behind"
    await service.check_slots()
    assert service.slots.corrections == 0, "the picture matched the engine"


def parking_numbers(client) -> dict:
    return client.app[SERVICE].state["auto_sessions"].stats.snapshot()


async def test_a_stream_closed_after_its_last_event_is_saved_at_the_next_switch(auto_client, caplog):
    """The exact sequence a real agent benchmark lost a conversation to."""
    client = await auto_client(idle_save_s=0)
    url = str(client.make_url("")).rstrip("/")
    a, b = conversation("agent-a"), conversation("agent-b")
    seen = await asyncio.to_thread(client_turn, url, a, "after_last_event")
    assert seen is not None and seen["prompt_n"] > OWN_STATE
    await settle(client)
    await read_all(url, b)  # the switch: A must be saved now
    numbers = parking_numbers(client)
    assert numbers["saves"] == 1, numbers
    back = await read_all(url, a)
    assert back["timings"]["cache_n"] >= OWN_STATE


async def test_a_client_that_leaves_during_the_switch_save_leaves_no_temporary(auto_client, monkeypatch):
    """The client goes away while the outgoing conversation is being saved for it."""
    client = await auto_client(idle_save_s=0)
    service = client.app[SERVICE]
    a, b = conversation("leave-a"), conversation("leave-b")
    url = str(client.make_url("")).rstrip("/")
    await read_all(url, a)
    real_save = service.engine.save
    saving, client_gone = asyncio.Event(), asyncio.Event()

    async def slow_save(filename, slot=0):
        saving.set()
        await client_gone.wait()  # the client gives up meanwhile
        return await real_save(filename, slot)

    monkeypatch.setattr(service.engine, "save", slow_save)
    leaving = asyncio.create_task(client.post("/v1/chat/completions", json=body(b, stream=False)))
    await asyncio.wait_for(saving.wait(), 10)
    leaving.cancel()
    await asyncio.gather(leaving, return_exceptions=True)
    client_gone.set()
    await settle(client)
    directory = Path(service.engine.info.slot_save_path)
    assert not list(directory.glob("tmp-*")), "the save ran to its end, nothing half-written"
    key_a = service.conversation_key(_request(a))
    assert is_parked(directory, key_a), "A was saved all the same"
    assert service.slots[0].key == key_a, "B never reached the engine: the slot still holds A"
    monkeypatch.setattr(service.engine, "save", real_save)
    back = await read_all(url, a)
    assert back["timings"]["cache_n"] >= OWN_STATE


def _request(messages):
    from strata_serve.hook_types import StrataRequest

    return StrataRequest(route="chat", body={"messages": messages})


async def anthropic_turn(sdk: anthropic.AsyncAnthropic, messages: list[dict], pattern: str) -> None:
    """One turn through Anthropic's SDK, as an agent might leave it."""
    if pattern == "read_all":
        await sdk.messages.create(model="local", max_tokens=8, extra_body={"temperature": 0}, messages=messages)
        return
    async with sdk.messages.stream(model="local", max_tokens=8, messages=messages) as stream:
        events = 0
        async for event in stream:
            events += 1
            if pattern == "mid_stream" and events >= 2:
                return
            if pattern == "after_last_event" and event.type == "message_delta":
                return  # leaves before message_stop: the SDK closes the connection


async def test_impatient_anthropic_and_openai_clients_side_by_side_on_two_slots(auto_client):
    """Claude Code's API beside OpenAI chat clients, concurrent and leaving early, on an
    engine with two slots: the engine places each Anthropic request itself (it ignores
    ``id_slot`` there), and still every conversation comes back with its own state."""
    client = await auto_client(engine={"cache_ram_mib": 0, "parallel": 2, "ctx_size": 8192}, idle_save_s=0)
    url = str(client.make_url("")).rstrip("/")
    names = ["claude-a", "claude-b", "chat-c", "chat-d"]
    chats = {name: conversation(name) for name in names}
    patterns = itertools.cycle(["after_last_event", "mid_stream", "read_all", "after_last_event"])
    async with anthropic.AsyncAnthropic(base_url=url, api_key="unused", max_retries=0) as sdk:
        for round_ in range(1, 4):
            turns = []
            for name in names:
                chats[name] = chats[name] + [{"role": "assistant", "content": f"noted {round_}"},
                                             {"role": "user", "content": f"step {round_} of {name}?"}]
                pattern = next(patterns)
                if name.startswith("claude"):
                    turns.append(anthropic_turn(sdk, chats[name], pattern))
                else:
                    pattern = "after_last_event" if pattern == "read_all" else pattern
                    turns.append(asyncio.to_thread(client_turn, url, chats[name], pattern))
            await asyncio.gather(*turns)
            await settle(client)
        for name in names + names:
            if name.startswith("claude"):
                reply = await sdk.messages.create(model="local", max_tokens=8, extra_body={"temperature": 0},
                                                  messages=chats[name])
                reused = reply.usage.cache_read_input_tokens
            else:
                reused = (await read_all(url, chats[name]))["timings"]["cache_n"]
            assert reused is not None and reused >= OWN_STATE, (name, reused, parking_numbers(client))
    service = client.app[SERVICE]
    await service.check_slots()
    assert service.slots.corrections == 0, "the picture matched the engine"
