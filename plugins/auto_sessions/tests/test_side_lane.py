"""The side lane (``engine.side_slot_tokens``): side requests never take the main conversation's slot.

Real engine with the side lane on (``side_slot_tokens`` 2048; off by default): one main slot and a side slot over one KV pool. The
clients' patterns come from their captured traffic (Open WebUI's follow-ups, title and
tags after each answer, one after another, not streamed; Claude Code's session-title
request sent at the same instant as every main turn, streamed, ``max_tokens`` 32000).
"""

from __future__ import annotations

import asyncio
import json
import logging

import pytest

from strata_serve.api import SERVICE
from strata_serve.side_lane import MAIN, SIDE
from strata_serve.testing import conversation

#: The side lane as a user turns it on (the default, and the test factory's engine, is the plain one-slot engine).
SIDE_SLOT = 2048
CTX = 4096
LANE = {"side_slot_tokens": SIDE_SLOT, "ctx_size": CTX}
ENGINE_LOGGER = "strata_serve.engine.output"
SYSTEM = "You are a helpful assistant. " * 6


def parking(client):
    return client.app[SERVICE].state["auto_sessions"]


def engine_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == ENGINE_LOGGER]


async def main_turn(client, messages: list[dict]) -> tuple[dict, dict]:
    """One streamed main turn as Open WebUI sends it: the timings and the headers."""
    body = {"messages": messages, "max_tokens": 16, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    resp = await client.post("/v1/chat/completions", json=body)
    assert resp.status == 200, await resp.text()
    timings = None
    async for raw in resp.content:
        line = raw.decode().strip()
        if line.startswith("data:") and '"timings"' in line:
            timings = json.loads(line[5:])["timings"]
    assert timings is not None, "the stream carried no timings"
    return timings, dict(resp.headers)


def task_prompt(task: str, history: list[dict]) -> str:
    flat = "\n".join(f"{m['role'].upper()}: {m['content']}" for m in history if m["role"] != "system")
    return f"### Task:\n{task}\n### Chat History:\n<chat_history>\n{flat}\n</chat_history>"


async def task_request(client, task: str, history: list[dict], **extra) -> dict:
    """One of Open WebUI's background tasks (follow-ups, title, tags): not streamed."""
    body = {"messages": [{"role": "user", "content": task_prompt(task, history)}], "temperature": 0,
            "max_tokens": 48, "stream": False, **extra}
    resp = await client.post("/v1/chat/completions", json=body)
    assert resp.status == 200, await resp.text()
    return await resp.json()


FOLLOW_UPS = "Suggest 3-5 relevant follow-up questions the user might ask next. JSON {follow_ups}"
TITLE = "Generate a concise, 3-5 word title with an emoji summarizing the chat history. JSON {title}"
TAGS = "Generate 1-3 broad tags categorizing the main themes of the chat history. JSON {tags}"


def prompt_of(timings: dict) -> int:
    return timings["prompt_n"] + timings["cache_n"]


async def long_main_conversation(client, name: str) -> tuple[list[dict], int]:
    """A main conversation of about 3,000 tokens, sent once: its messages and what the slot holds."""
    chat = [{"role": "system", "content": SYSTEM * 12}, *conversation(name, 2)]
    timings, _ = await main_turn(client, chat)
    held = prompt_of(timings)
    assert held > 2500, held
    return chat, held


async def test_open_webui_main_turns_come_back_from_their_slot(auto_client, caplog):
    caplog.set_level(logging.DEBUG, logger=ENGINE_LOGGER)
    client = await auto_client(engine=LANE, idle_save_s=0)
    chat = [{"role": "system", "content": SYSTEM}, *conversation("webui")]
    states, reused = [], []
    last_prompt = 0
    for turn in range(1, 4):
        timings, headers = await main_turn(client, chat)
        states.append(headers["X-Strata-State"])
        # Read: only what is new since the last turn; the whole last prompt came from the slot.
        reused.append((timings["cache_n"], last_prompt))
        last_prompt = prompt_of(timings)
        chat = [*chat, {"role": "assistant", "content": f"answer {turn}"},
                {"role": "user", "content": f"and question {turn + 1}?"}]
        await task_request(client, FOLLOW_UPS, chat[-6:])
        if turn == 1:
            await task_request(client, TITLE, chat[-2:])
            await task_request(client, TAGS, chat[-6:])
        service = client.app[SERVICE]
        assert service.slots[SIDE].key is not None, "the side requests ran in the side slot"
    assert states[1:] == ["slot", "slot"], states
    assert all(cache >= last for cache, last in reused[1:]), reused
    stats = parking(client).stats
    # The main conversation never left its slot: a restore, if any, is a side request's
    # opening found by its tokens in the blocks (the side slot's), never one by its key.
    assert stats.restores == stats.restores_by_tokens, "the main conversation never left its slot"
    assert not any("purging slot" in line for line in engine_lines(caplog))


async def test_claude_code_title_at_the_same_instant_as_the_main_turn(auto_client, caplog):
    """The title request (another system prompt, streamed, ``max_tokens`` 32000) and the main
    turn leave together; on ``/v1/messages`` the engine chooses their slots itself."""
    import anthropic

    caplog.set_level(logging.DEBUG, logger=ENGINE_LOGGER)
    client = await auto_client(engine=LANE, idle_save_s=0)
    url = str(client.make_url("")).rstrip("/")
    system_main = [{"type": "text", "text": "You are Claude Code, Anthropic's official CLI for Claude."},
                   {"type": "text", "text": "Static agent instructions. " * 40}]
    system_title = [{"type": "text", "text": "You are Claude Code, Anthropic's official CLI for Claude."},
                    {"type": "text", "text": "Write a 2-3 word title for this coding session. JSON {title}"}]
    prompts = ["Fix the failing test in utils.py", "Now run the tests", "And commit it"]
    messages = [{"role": "user", "content": conversation("cc")[0]["content"] + "\n" + prompts[0]}]
    states, reads, placed = [], [], []
    async with anthropic.AsyncAnthropic(base_url=url, api_key="unused", max_retries=0) as sdk:

        async def title(prompt: str) -> None:
            async with sdk.messages.stream(model="haiku", max_tokens=32000, system=system_title,
                                           messages=[{"role": "user", "content": prompt}]) as stream:
                await stream.get_final_message()

        async def main(turn_messages: list[dict]) -> tuple[dict, int]:
            # Shapes the arrival as the CLI's (the title first, the main turn a moment
            # later); nothing waits on it: either order is placed the same way.
            await asyncio.sleep(0.05)
            async with sdk.messages.with_streaming_response.create(
                    model="sonnet", max_tokens=16, system=system_main, messages=turn_messages,
                    stream=True) as resp:
                assert resp.status_code == 200
                state = resp.headers["X-Strata-State"]
                usage: dict = {}
                async for line in resp.iter_lines():
                    if line.startswith("data:") and '"usage"' in line:
                        event = json.loads(line[5:])
                        usage.update(event.get("usage") or event.get("message", {}).get("usage") or {})
            return {"state": state}, usage

        for turn, prompt in enumerate(prompts, 1):
            _, (seen, usage) = await asyncio.gather(title(prompt), main(messages))
            states.append(seen["state"])
            service = client.app[SERVICE]
            placed.append((service.slots[MAIN].key, service.slots[SIDE].key))
            reads.append(usage)
            following = prompts[turn] if turn < len(prompts) else "thanks"
            messages = [*messages, {"role": "assistant", "content": f"done {turn}"},
                        {"role": "user", "content": following}]
    main_key = placed[0][0]
    assert all(main == main_key for main, _ in placed), ("the main conversation stayed in slot 0", placed)
    assert all(side is not None and side != main_key for _, side in placed), placed
    assert states[1:] == ["slot", "slot"], states
    # Read again: only the new tokens; the rest came from the slot.
    for before, now in zip(reads, reads[1:]):
        assert now["cache_read_input_tokens"] >= before["input_tokens"] + before["cache_read_input_tokens"], reads
    assert parking(client).stats.restores == 0
    assert not any("purging slot" in line for line in engine_lines(caplog))


async def test_an_engine_crash_right_after_a_side_request_loses_no_main_conversation(auto_client, caplog):
    """The main conversation stays in its slot beside a side request, which holds the whole
    line meanwhile (the idle save cannot run): its file is made current before the side
    request goes to the engine, as a one-slot engine parks it. The engine killed at once
    after the side request: the next main turn comes back from disk, whole (without that
    save it was read again in full: found by the bench's agents, one in four lost)."""
    import os
    import signal

    caplog.set_level(logging.INFO, logger="strata_auto_sessions")
    client = await auto_client(engine=LANE, idle_save_s=600)
    service = client.app[SERVICE]
    chat = [{"role": "system", "content": SYSTEM * 4}, *conversation("crash", 2)]
    timings, _ = await main_turn(client, chat)
    held = prompt_of(timings)
    assert service.slots[MAIN].key is not None and not service.slots[MAIN].file_current
    await task_request(client, FOLLOW_UPS, chat[-2:])
    assert service.slots[SIDE].key is not None, "it ran in the side slot"
    assert service.slots[MAIN].file_current, "the main conversation's file was made current"
    assert parking(client).stats.saves == 1

    generation = service.engine.generation
    os.kill(service.engine.pid, signal.SIGKILL)
    deadline = asyncio.get_running_loop().time() + 60
    while service.engine.generation == generation or not service.engine.ready:
        assert asyncio.get_running_loop().time() < deadline, "the engine did not come back"
        await asyncio.sleep(0.05)
    timings, headers = await main_turn(client, chat)
    assert headers["X-Strata-State"] == "disk", headers
    assert timings["cache_n"] >= held - 2, (timings, held)

    # The turn moved it on: the next side request saves it again; once current, no other does.
    def main_saves() -> int:
        return sum(1 for r in caplog.records if r.getMessage().startswith("[strata] auto sessions: saved ")
                   and r.getMessage().endswith("(from slot 0)"))

    before = main_saves()
    await task_request(client, TITLE, chat[-2:])
    assert main_saves() == before + 1 and service.slots[MAIN].file_current
    await task_request(client, TAGS, chat[-2:])
    assert main_saves() == before + 1


async def test_a_side_request_too_big_for_the_side_slot_goes_the_old_way(auto_client):
    client = await auto_client(engine=LANE, idle_save_s=0)
    service = client.app[SERVICE]
    # A main conversation of about 3,000 tokens: the pool (6,144) leaves the side slot ~3,100.
    chat, held = await long_main_conversation(client, "big")
    history = [{"role": "user", "content": "x " * 1800}]  # ~3,600 bytes: more than the room
    answer = await task_request(client, TITLE, history)
    assert answer["choices"][0]["message"] is not None
    assert service.slots[MAIN].key != service.slots[SIDE].key
    assert parking(client).stats.saves >= 1, "the main conversation was parked first"
    timings, headers = await main_turn(client, chat)
    assert headers["X-Strata-State"] == "disk", "restored from its file"
    assert timings["cache_n"] >= held - 2, (timings, held)


async def test_a_long_side_answer_is_bounded_and_never_purges_the_main_slot(auto_client, caplog):
    caplog.set_level(logging.DEBUG, logger=ENGINE_LOGGER)
    client = await auto_client(engine=LANE, idle_save_s=0)
    service = client.app[SERVICE]
    chat = [{"role": "system", "content": SYSTEM * 10}, *conversation("long", 2)]
    timings, _ = await main_turn(client, chat)
    held = prompt_of(timings)
    room = CTX + SIDE_SLOT - service.slots[MAIN].tokens
    # A side request asking for 32,000 tokens, made to write them all.
    answer = await task_request(client, TITLE, chat[-2:], max_tokens=32000, ignore_eos=True)
    assert service.slots[SIDE].key is not None and answer["choices"][0]["finish_reason"] == "length"
    generated = answer["usage"]["completion_tokens"]
    assert 0 < generated < room, (generated, room)
    assert answer["usage"]["prompt_tokens"] + generated <= room
    assert not any("purging slot" in line for line in engine_lines(caplog))
    timings, headers = await main_turn(client, chat)
    assert headers["X-Strata-State"] == "slot"
    assert timings["cache_n"] >= held - 2, (timings, held)


async def test_a_main_conversation_is_restored_beside_a_side_slot_that_left_it_no_room(auto_client, caplog):
    """The engine's restore never purges an idle slot for room (a decode does): a side slot
    that filled the pool beside an empty main slot left the main conversation's restore no
    room, and it was read again in full. strata-serve empties the side slot and restores."""
    caplog.set_level(logging.INFO)
    client = await auto_client(engine=LANE, idle_save_s=0)
    service = client.app[SERVICE]
    chat, held = await long_main_conversation(client, "roomy")
    # Parked by hand: the main slot is emptied, the conversation kept in its file.
    resp = await client.post(f"/slots/{MAIN}?action=erase")
    assert resp.status == 200, await resp.text()
    assert parking(client).stats.saves >= 1
    # A side answer that takes all but 2,000 of the pool's tokens (as one that fit beside a
    # short main conversation may): the engine, asked directly, the side slot named.
    side = {"messages": [{"role": "user", "content": "a title please"}], "temperature": 0,
            "max_tokens": CTX + SIDE_SLOT - 2000, "ignore_eos": True, "id_slot": SIDE}
    status, _ = await service.engine.request("POST", "/v1/chat/completions", json=side)
    assert status == 200
    service.slots.unknown(SIDE)
    await service.check_slots()
    assert service.slots[SIDE].tokens > CTX + SIDE_SLOT - held, service.slots[SIDE].tokens
    chat += [{"role": "assistant", "content": "reply"}, {"role": "user", "content": "and more?"}]
    timings, headers = await main_turn(client, chat)
    assert headers["X-Strata-State"] == "disk", (headers.get("X-Strata-State"), timings)
    assert timings["cache_n"] >= held - 2, (timings, held)
    assert any("the side slot is emptied" in r.getMessage() for r in caplog.records)
    assert service.slots[SIDE].tokens == 0


def chat_of(name: str, chars: int) -> list[dict]:
    """A conversation whose system prompt is ``chars`` characters (the demo model reads one
    token a character), then the usual first question (about 900 more)."""
    return [{"role": "system", "content": (f"Notes of {name}. " * chars)[:chars]}, *conversation(name)]


def then(chat: list[dict], turn: int) -> list[dict]:
    return [*chat, {"role": "assistant", "content": f"reply {turn}"}, {"role": "user", "content": f"and {turn}?"}]


async def test_a_main_restore_that_empties_the_side_slot_saves_its_conversation_first(auto_client, caplog):
    """A long conversation in the side slot (it fit beside a shorter main one) is emptied when
    a restore into the main slot needs its room (the engine's restore never purges a slot
    itself): it is saved first, as a switch saves it, and its next turn comes back from
    disk. Without that it was lost: its next turn read its whole prompt again."""
    caplog.set_level(logging.INFO)
    client = await auto_client(engine=LANE, idle_save_s=0)
    service = client.app[SERVICE]
    # M, about 3,750 tokens, takes the empty main slot.
    big = chat_of("big", 2800)
    timings, _ = await main_turn(client, big)
    big_held = prompt_of(timings)
    assert 3500 < big_held < CTX - 100, big_held
    # A, too long for the room beside M (the pool less M): the main slot, M parked.
    other = chat_of("other", 1300)
    await main_turn(client, other)
    assert service.slots[MAIN].tokens < 2500, service.slots[MAIN].tokens
    # B fits beside A: the side slot, more than its share of the pool.
    side_chat = chat_of("side", 2100)
    timings, headers = await main_turn(client, side_chat)
    side_held = prompt_of(timings)
    side_key = headers["X-Strata-Conversation"]
    assert headers["X-Strata-Slot"] == str(SIDE) and service.slots[SIDE].key == side_key
    assert service.slots[SIDE].tokens > SIDE_SLOT and not service.slots[SIDE].file_current
    # M comes back: its restore needs the room B holds, and the side slot is emptied for it.
    timings, headers = await main_turn(client, then(big, 1))
    assert headers["X-Strata-State"] == "disk" and timings["cache_n"] >= big_held - 2, (headers, timings)
    assert any("the side slot is emptied" in r.getMessage() for r in caplog.records)
    assert service.slots[SIDE].tokens == 0
    # B's next turn: from its file, whole.
    timings, headers = await main_turn(client, then(side_chat, 1))
    assert headers["X-Strata-Conversation"] == side_key
    assert headers["X-Strata-State"] == "disk", (headers["X-Strata-State"], timings)
    assert timings["cache_n"] >= side_held - 2, (timings, side_held)


async def test_without_the_bound_the_engine_purges_the_idle_main_slot(llama_server_factory, caplog):
    """The control: the same engine, a side answer of 32,000 tokens sent to it directly."""
    caplog.set_level(logging.DEBUG, logger=ENGINE_LOGGER)
    bare = await llama_server_factory(side_slot_tokens=SIDE_SLOT, ctx_size=CTX, log_level="DEBUG")
    main = {"messages": [{"role": "system", "content": SYSTEM * 10}, *conversation("long", 2)],
            "max_tokens": 16, "temperature": 0, "id_slot": MAIN}
    status, _ = await bare.request("POST", "/v1/chat/completions", json=main)
    assert status == 200
    side = {"messages": [{"role": "user", "content": "a title please"}], "max_tokens": 32000,
            "ignore_eos": True, "temperature": 0, "id_slot": SIDE}
    status, _ = await bare.request("POST", "/v1/chat/completions", json=side)
    assert any(f"purging slot {MAIN}" in line for line in engine_lines(caplog)), "the main slot was purged"
    reports = {report.id: report for report in await bare.slots()}
    assert reports[MAIN].tokens == 0


@pytest.mark.parametrize("tokens", [0, SIDE_SLOT])
def test_the_engine_command_for_each_set_up(tmp_path, tokens):
    from pathlib import Path

    from strata_serve.config import EngineSettings
    from strata_serve.engine.llama_server import build_command, clears_idle_slots

    settings = EngineSettings(model=tmp_path / "m.gguf", ctx_size=8192, side_slot_tokens=tokens)
    joined = " ".join(build_command(settings, Path("/x/llama-server"), 1))
    if tokens:
        assert "-np 2 -c 10240 --kv-unified --kv-unified-per-slot 8192 --no-cache-idle-slots" in joined
        assert settings.engine_slots == 2
    else:
        assert "-np 1 -c 8192" in joined and "--kv-unified" not in joined
    assert not clears_idle_slots(settings)
    # The user's own slots, an attached engine: no side slot.
    assert not EngineSettings(parallel=2, side_slot_tokens=tokens).side_lane
    assert not EngineSettings(url="http://127.0.0.1:1", side_slot_tokens=tokens).side_lane
    assert not EngineSettings(extra_args=["-np", "3"], side_slot_tokens=tokens).side_lane
