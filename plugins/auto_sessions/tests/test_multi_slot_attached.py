"""Parking on an engine strata-serve attaches to (``engine.url``) that runs two slots.

strata-serve is told neither the engine's slot count nor its flags: it reads the count
from the engine (``/props``), and since it cannot know whether the engine empties idle
slots itself (``--kv-unified`` with its RAM cache on does, when a task starts), it saves
each conversation as its answer ends and asks the engine what its slots hold before every
request. Shown against a bare llama-server that keeps its slots and one that empties them.
"""

from __future__ import annotations

import pytest

import strata_serve
from strata_serve.api import SERVICE
from strata_serve.testing import assert_openai_error, conversation

from plugins.auto_sessions.tests.test_multi_slot import OWN_STATE, more, numbers, stream_turn, url_of
from tests.parked_state import settle

#: The bare engines: one buffer per slot and no RAM cache (it keeps its slots), and one
#: KV buffer for all slots with its RAM cache on (it empties idle slots when a task starts).
ENGINES = {
    "keeps-idle-slots": {"cache_ram_mib": 0},
    "empties-idle-slots": {"cache_ram_mib": 256, "extra_args": ["--kv-unified"]},
}


class PictureCheck:
    """At each request's turn, after the core's own check and before any plugin acts: does
    the picture of every idle slot hold what the engine says (its token count)?"""

    strata_name = "picture_check"

    def __init__(self) -> None:
        self.compared = 0
        self.wrong: list[tuple[int, int | None, int]] = []

    @strata_serve.hookimpl(tryfirst=True)
    async def pre_request(self, request, service):
        if len(service.fifo.busy) > 1:
            return  # another request at work: the engine may be changing
        for report in await service.engine.slots():
            if report.processing:
                continue
            recorded, actual = service.slots[report.id].tokens, report.tokens or 0
            self.compared += 1
            if recorded is not None and recorded != actual:
                self.wrong.append((report.id, recorded, actual))


@pytest.mark.parametrize("kind", list(ENGINES))
async def test_an_attached_engine_with_two_slots_parks_and_restores_each(
        kind, llama_server_factory, auto_client, tmp_path):
    shared = tmp_path / "shared-slots"
    bare = await llama_server_factory(parallel=2, ctx_size=4096, slot_save_path=shared, **ENGINES[kind])
    check = PictureCheck()
    client = await auto_client(check, idle_save_s=0, engine={
        "url": bare.info.url, "slot_save_path": str(shared), "api_key": bare.api_key.get_secret_value(),
        "cache_ram_mib": ENGINES[kind]["cache_ram_mib"]})
    service = client.app[SERVICE]
    url = url_of(client)
    assert service.settings.engine.parallel == 1, "strata-serve was not told how many slots"
    assert len(await bare.slots()) == 2 == len(service.slots), "it asked the engine"
    assert service.engine.info.clears_idle_slots is None, "whether the engine empties idle slots is not known"

    async def turn(messages):  # one at a time, each ended (its save made) before the next
        answer = await stream_turn(url, messages)
        await settle(client)
        return answer

    # A and B take a slot each (their answers saved as they end); C then D displace them,
    # then A and B come back: into both slots, B last into slot 1.
    a, b, c, d = (conversation(f"att-{name}") for name in "abcd")
    firsts = [int((await turn(messages))[1]["X-Strata-Slot"]) for messages in (a, b)]
    assert firsts == [0, 1]
    assert numbers(client)["saves"] == 2, "each conversation was saved as its answer ended"
    await turn(c)
    await turn(d)
    came_back = set()
    for messages in (a, b):
        timings, headers = await turn(more(messages, "back"))
        assert headers["X-Strata-State"] == "disk" and timings["cache_n"] >= OWN_STATE, (headers, timings)
        came_back.add(int(headers["X-Strata-Slot"]))
    assert came_back == {0, 1}, "restored into both slots"
    assert service.slots[1].key == headers["X-Strata-Conversation"]
    assert numbers(client)["restore_failures"] == 0 and numbers(client)["save_failures"] == 0

    # Slot actions by hand reach every slot the engine runs, and none past them.
    held_1 = (await bare.slots())[1].tokens
    saved = await client.post("/slots/1?action=save", json={"filename": "by-hand.bin"})
    assert saved.status == 200, await saved.text()
    assert (await saved.json())["n_saved"] == held_1 >= OWN_STATE
    assert (shared / "by-hand.bin").is_file()
    restored = await client.post("/slots/1?action=restore", json={"filename": "by-hand.bin"})
    assert restored.status == 200 and (await restored.json())["n_restored"] == held_1, await restored.text()
    for action in ("save", "restore", "erase"):
        resp = await client.post(f"/slots/2?action={action}", json={"filename": "by-hand.bin"})
        assert resp.status == 404, (action, await resp.text())
        body = await resp.json()
        assert_openai_error(body)
        assert body["error"]["code"] == "no_such_slot" and "runs 2 slot(s)" in body["error"]["message"], body

    # Before every request the picture of every idle slot was the engine's own count,
    # whether the engine kept its idle slots or emptied them behind strata-serve's back.
    assert check.compared >= 8 and check.wrong == [], check.wrong
    engine_emptied = service.slots.corrections > 0
    assert engine_emptied == (kind == "empties-idle-slots"), service.slots.corrections
