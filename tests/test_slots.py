"""/slots: the engine's slot API behind the FIFO, with file names kept inside the slot directory."""

import pytest

from strata_serve.testing import assert_openai_error, chat_body

PROMPT = "Tell me about the sea and the ships that sail on it"


async def test_save_erase_restore_round_trip_reuses_the_prompt(strata_client_factory, recorder, tmp_path):
    client = await strata_client_factory(recorder)
    first = await (await client.post("/v1/chat/completions", json=chat_body(PROMPT))).json()

    saved = await client.post("/slots/0?action=save", json={"filename": "manual.bin"})
    assert saved.status == 200, await saved.text()
    assert (await saved.json())["n_saved"] > 10
    assert (tmp_path / "slots" / "manual.bin").stat().st_size > 1000

    erased = await client.post("/slots/0?action=erase")
    assert erased.status == 200
    restored = await client.post("/slots/0?action=restore", json={"filename": "manual.bin"})
    assert restored.status == 200, await restored.text()
    assert (await restored.json())["n_restored"] > 10

    again = await (await client.post("/v1/chat/completions", json=chat_body(PROMPT))).json()
    assert again["choices"][0]["message"]["content"] == first["choices"][0]["message"]["content"]
    prompt_tokens = again["timings"]["cache_n"] + again["timings"]["prompt_n"]
    assert again["timings"]["cache_n"] >= prompt_tokens - 2, again["timings"]
    # Slot actions run through the FIFO and the hooks like any request.
    assert [e[0] for e in recorder.events].count("pre") == 5


async def test_erase_without_restore_pays_a_full_prefill(strata_client_factory):
    client = await strata_client_factory()
    await client.post("/v1/chat/completions", json=chat_body(PROMPT))
    await client.post("/slots/0?action=erase")
    again = await (await client.post("/v1/chat/completions", json=chat_body(PROMPT))).json()
    assert again["timings"]["cache_n"] == 0


@pytest.mark.parametrize("name", ["../escape.bin", "/etc/passwd", "..", "a/b.bin", "nul\x00.bin"])
async def test_path_traversal_is_refused(strata_client_factory, tmp_path, name):
    client = await strata_client_factory()
    resp = await client.post("/slots/0?action=save", json={"filename": name})
    assert_openai_error(await resp.json(), 400, resp.status)
    assert not (tmp_path / "escape.bin").exists()


async def test_symlink_escape_is_refused(strata_client_factory, tmp_path):
    client = await strata_client_factory()
    outside = tmp_path / "outside.bin"
    outside.write_bytes(b"not a slot file")
    (tmp_path / "slots" / "link.bin").symlink_to(outside)
    for action in ("save", "restore"):
        resp = await client.post(f"/slots/0?action={action}", json={"filename": "link.bin"})
        assert_openai_error(await resp.json(), 400, resp.status)
    assert outside.read_bytes() == b"not a slot file"


async def test_bad_slot_requests(strata_client_factory):
    client = await strata_client_factory()
    cases = [
        ("/slots/0?action=explode", {"filename": "a.bin"}, 400),
        ("/slots/0", {"filename": "a.bin"}, 400),
        ("/slots/1?action=save", {"filename": "a.bin"}, 404),
        ("/slots/0?action=save", {}, 400),
        ("/slots/0?action=save", {"filename": 7}, 400),
        ("/slots/0?action=save", {"filename": "a.bin", "extra": 1}, 400),
        ("/slots/0?action=restore", {"filename": "missing.bin"}, 404),
    ]
    for path, body, status in cases:
        resp = await client.post(path, json=body)
        assert_openai_error(await resp.json(), status, resp.status)


async def test_slots_listing(strata_client_factory):
    client = await strata_client_factory()
    slots = await (await client.get("/slots")).json()
    assert len(slots) == 1 and slots[0]["id"] == 0 and slots[0]["n_ctx"] > 0


async def test_parallel_engine_refuses_slot_actions_with_409(strata_client_factory, strata_settings_factory):
    settings = strata_settings_factory(engine={"parallel": 2})
    client = await strata_client_factory(settings=settings)
    resp = await client.post("/slots/0?action=save", json={"filename": "x.bin"})
    body = await resp.json()
    assert_openai_error(body, 409, resp.status)
    assert "parallel" in body["error"]["message"]
    ok = await client.post("/v1/chat/completions", json=chat_body())
    assert ok.status == 200
