"""Switches left to the engine's RAM prompt cache (``ram_first``), against the real engine.

With room in the engine's RAM cache, a switch saves nothing and restores nothing: the
engine moves the outgoing conversation into RAM and the incoming one back by itself.
Each claim here has a control with ``ram_first = false`` (every switch parks to disk),
or a case the belief gets wrong on purpose, where it must fall back to disk.
"""

from __future__ import annotations

import pytest

from strata_serve.api import SERVICE
from strata_serve.testing import chat, conversation, until

from strata_auto_sessions.testing import is_parked
from .test_auto_sessions import key_of, log_lines, parking, slot_dir

#: A return found its own state when it reused at least this much of its ~750-token opening.
OWN_STATE = 600
#: The engine's RAM cache for these tests: room for every conversation they hold.
ROOMY_MIB = 256


@pytest.fixture(autouse=True)
def plugin_logs(caplog):
    caplog.set_level("INFO", logger="strata_auto_sessions")


async def send(client, messages):
    """A chat turn: its answer and the ``X-Strata-State`` it came with."""
    resp = await client.post("/v1/chat/completions", json=chat(messages))
    assert resp.status == 200, await resp.text()
    return await resp.json(), resp.headers["X-Strata-State"]


async def test_switches_with_room_in_the_engines_ram_cache_touch_no_file(auto_client):
    client = await auto_client(engine={"cache_ram_mib": ROOMY_MIB})
    a, b, c = conversation("ram-a"), conversation("ram-b"), conversation("ram-c")
    for messages in (a, b, c):
        await send(client, messages)
    back, state = await send(client, a + [{"role": "assistant", "content": "x"}, {"role": "user", "content": "a?"}])
    stats = parking(client).stats
    assert stats.restores == 0, "no switch restored a file"
    assert stats.saves == 1, "only the first switch saved: the state's size is measured by a first save"
    assert stats.ram_switches == 3
    assert state == "ram" and back["timings"]["cache_n"] >= OWN_STATE, "A came back from the engine's RAM"
    assert stats.ram_hits == 1 and stats.ram_misses == 0


async def test_conversations_not_worth_a_file_are_left_to_the_engines_ram_too(auto_client):
    """Short chats (here: below ``min_tokens``) are never saved, so no save measured a state's
    size; one save made only to measure it, then removed, gives the size the switches left
    to the engine's RAM need. Before, every switch found no size, parked to disk (nothing
    worth keeping) and emptied the slot, so the engine re-read every prompt whole: eight
    short chats at once ran at 0.31x the engine alone's requests per second, 0.97x now."""
    client = await auto_client(engine={"cache_ram_mib": ROOMY_MIB}, min_tokens=5000)
    a, b, c = conversation("short-a"), conversation("short-b"), conversation("short-c")
    for messages in (a, b, c):
        await send(client, messages)
    back, state = await send(client, a + [{"role": "assistant", "content": "x"}, {"role": "user", "content": "a?"}])
    stats = parking(client).stats
    assert stats.saves == 0 and stats.restores == 0, "nothing worth a file was kept or restored"
    assert stats.ram_switches == 3 and stats.ram_hits == 1
    assert state == "ram" and back["timings"]["cache_n"] >= OWN_STATE, "A came back from the engine's RAM"
    assert "engine_erase" not in client.app[SERVICE].phases.snapshot()["count"], "no slot was emptied"
    assert not any(is_parked(slot_dir(client), key_of(client, messages)) for messages in (a, b, c))


async def test_without_ram_first_every_switch_parks_to_disk(auto_client):
    """The control of the test above: the same turns, with ``ram_first = false``."""
    client = await auto_client(engine={"cache_ram_mib": ROOMY_MIB}, ram_first=False)
    a, b, c = conversation("disk-a"), conversation("disk-b"), conversation("disk-c")
    for messages in (a, b, c):
        await send(client, messages)
    back, state = await send(client, a + [{"role": "assistant", "content": "x"}, {"role": "user", "content": "a?"}])
    stats = parking(client).stats
    assert stats.saves >= 2 and stats.restores == 1 and stats.ram_switches == 0
    assert state == "disk" and back["timings"]["cache_n"] >= OWN_STATE


async def test_a_stop_saves_the_conversations_left_in_ram_and_they_restore(auto_client):
    client = await auto_client(engine={"cache_ram_mib": ROOMY_MIB}, idle_save_s=0)
    chats = [conversation(name) for name in ("stop-a", "stop-b", "stop-c")]
    for messages in chats:
        await send(client, messages)
    assert parking(client).stats.ram_switches == 2 and parking(client).stats.saves == 1
    directory = slot_dir(client)
    keys = [key_of(client, messages) for messages in chats]
    await client.close()
    for key in keys:
        assert is_parked(directory, key), key
    again = await auto_client(engine={"cache_ram_mib": ROOMY_MIB, "slot_save_path": str(directory)})
    back, state = await send(again, chats[0] + [{"role": "assistant", "content": "x"},
                                                 {"role": "user", "content": "a?"}])
    assert state == "disk" and back["timings"]["cache_n"] >= OWN_STATE, "the file saved at the stop restores"


def sharing(name: str) -> list[dict[str, str]]:
    """A conversation whose long system message every other one of this kind repeats."""
    system = "You are a careful assistant. " + " ".join(f"rule{n} ship sea wind" for n in range(40))
    return [{"role": "system", "content": system}, {"role": "user", "content": f"Question of {name}?"}]


async def test_a_switch_to_a_prompt_sharing_most_of_the_held_one_parks_to_disk(auto_client):
    """The engine keeps a prompt sharing half or more of the slot's in the slot (cut to
    what they share) and caches nothing: such a switch is not left to it."""
    client = await auto_client(engine={"cache_ram_mib": ROOMY_MIB})
    a, b = sharing("share-a"), sharing("share-b")
    assert key_of(client, a) != key_of(client, b)
    await send(client, a)
    await send(client, b)
    stats = parking(client).stats
    assert stats.ram_switches == 0 and stats.saves == 1, "A was saved before B took the slot"
    back, state = await send(client, a + [{"role": "assistant", "content": "x"}, {"role": "user", "content": "a?"}])
    assert state == "disk" and back["timings"]["cache_n"] >= OWN_STATE


async def test_a_conversation_believed_in_ram_that_was_not_turns_the_belief_off(auto_client, caplog):
    """The engine's cache holds 1 MiB, the belief is told it holds far more: the engine
    drops A, A comes back reusing little, and from then on every switch parks to disk."""
    client = await auto_client(engine={"cache_ram_mib": 1})
    parking(client).engine_ram.budget = 2**40
    a, b, c, d = (conversation(name) for name in ("miss-a", "miss-b", "miss-c", "miss-d"))
    for messages in (a, b, c, d):
        await send(client, messages)
    assert parking(client).stats.ram_switches == 3
    await send(client, a + [{"role": "assistant", "content": "x"}, {"role": "user", "content": "a?"}])
    stats = parking(client).stats
    assert stats.ram_misses == 1 and not parking(client).engine_ram.trusted
    assert any("it was not there" in line for line in log_lines(caplog))
    saves, switches = stats.saves, stats.ram_switches
    await send(client, b + [{"role": "assistant", "content": "x"}, {"role": "user", "content": "b?"}])
    assert stats.saves == saves + 1 and stats.ram_switches == switches, "the next switch parked A to disk"


async def test_a_conversation_taken_back_from_ram_by_a_switch_not_left_to_it_is_believed_there_no_more(auto_client,
                                                                                                        caplog):
    """B, left in the engine's RAM, comes back with a prompt that does not continue its last
    one (its last answer replaced, as a client that cut it sends it): that switch is not
    left to the engine, which brings B back from its RAM all the same. B then leaves to
    disk and C is restored over it; B's next return must restore its file, not be left to
    a RAM that no longer holds it."""
    client = await auto_client(engine={"cache_ram_mib": ROOMY_MIB})
    a, b, c = conversation("back-a"), conversation("back-b"), conversation("back-c")
    for messages in (a, b, c):
        await send(client, messages)
    b2 = b + [{"role": "assistant", "content": "x"}, {"role": "user", "content": "b?"}]
    c2 = c + [{"role": "assistant", "content": "x"}, {"role": "user", "content": "c?"}]
    await send(client, b2)
    await send(client, c2)  # B left to the engine's RAM, its prompt three messages long
    stats = parking(client).stats
    assert parking(client).engine_ram.holds((None, key_of(client, b), 0)) and stats.ram_misses == 0
    cut = b + [{"role": "assistant", "content": "x, cut short"}, {"role": "user", "content": "b?"}]
    answer, _state = await send(client, cut)  # not a continuation: C parked to disk, B from the engine's RAM
    assert answer["timings"]["cache_n"] >= OWN_STATE, "the engine brought B back from its RAM"
    await send(client, c2 + [{"role": "assistant", "content": "y"}, {"role": "user", "content": "c!"}])  # C restored
    more = cut + [{"role": "assistant", "content": answer["choices"][0]["message"]["content"]},
                  {"role": "user", "content": "and b?"}]
    back, state = await send(client, more)
    assert state == "disk" and back["timings"]["cache_n"] >= OWN_STATE, (state, back["timings"])
    assert stats.ram_misses == 0 and parking(client).engine_ram.trusted
    assert not any("it was not there" in line for line in log_lines(caplog))


async def test_a_request_of_the_held_conversation_goes_to_the_engine_ahead_of_its_turn(auto_client):
    """auto-sessions agrees to ``may_go_ahead`` for the conversation the slot holds: the
    engine gets the second request while the first one is still answered."""
    import asyncio

    client = await auto_client(engine={"cache_ram_mib": 0})
    service = client.app[SERVICE]
    a = conversation("ahead-a")
    await send(client, a)
    long = client.post("/v1/chat/completions", json=chat(a + [{"role": "assistant", "content": "x"},
                                                              {"role": "user", "content": "long?"}],
                                                         max_tokens=2000, ignore_eos=True))  # seconds, even unloaded
    first = asyncio.ensure_future(long)
    await until(lambda: service._at_engine is not None, what="the first request at the engine")
    second = asyncio.ensure_future(client.post("/v1/chat/completions", json=chat(
        a + [{"role": "assistant", "content": "x"}, {"role": "user", "content": "short?"}], max_tokens=1)))
    await until(lambda: service._ahead is not None or second.done(), what="the second request sent or answered")
    assert service._ahead is not None and service._ahead.sent_ahead, "it was sent ahead of its turn"
    assert (await first).status == 200 and (await second).status == 200
