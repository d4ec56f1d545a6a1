"""/slots: the engine's slot API behind the FIFO, with file names kept inside the slot directory."""

import pytest

from strata_serve.api.app_state import SERVICE
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
    # Slot actions hold the slot in the FIFO, with hooks of their own: they are no request.
    assert [e[0] for e in recorder.events].count("pre") == 2
    actions = [e for e in recorder.events if e[0].endswith("_slot_action")]
    assert [e[:3] for e in actions] == [(step, 0, action) for action in ("save", "erase", "restore")
                                        for step in ("pre_slot_action", "post_slot_action")]
    assert all(e[3] is False for e in actions if e[0] == "pre_slot_action"), "the slot is held"
    assert [e[3] for e in actions if e[0] == "post_slot_action"][1:] == [0, (await restored.json())["n_restored"]]


async def test_erase_without_restore_pays_a_full_prefill(strata_client_factory):
    client = await strata_client_factory()
    await client.post("/v1/chat/completions", json=chat_body(PROMPT))
    await client.post("/slots/0?action=erase")
    again = await (await client.post("/v1/chat/completions", json=chat_body(PROMPT))).json()
    assert again["timings"]["cache_n"] == 0


# An absolute name points into the test's own directory: on the in-memory engine, which
# writes where it is told, a broken check must never write over a file of the machine's.
@pytest.mark.parametrize("name", ["../escape.bin", "{tmp}/escape.bin", "..", "a/b.bin", "nul\x00.bin"])
async def test_path_traversal_is_refused(strata_memory_client_factory, tmp_path, name):
    client = await strata_memory_client_factory()
    name = name.format(tmp=tmp_path)
    resp = await client.post("/slots/0?action=save", json={"filename": name})
    assert_openai_error(await resp.json(), 400, resp.status)
    assert not (tmp_path / "escape.bin").exists()


async def test_symlink_escape_is_refused(strata_memory_client_factory, tmp_path):
    client = await strata_memory_client_factory()
    (tmp_path / "slots").mkdir(exist_ok=True)  # made by llama-server's start; the double makes none
    outside = tmp_path / "outside.bin"
    outside.write_bytes(b"not a slot file")
    (tmp_path / "slots" / "link.bin").symlink_to(outside)
    for action in ("save", "restore"):
        resp = await client.post(f"/slots/0?action={action}", json={"filename": "link.bin"})
        assert_openai_error(await resp.json(), 400, resp.status)
    assert outside.read_bytes() == b"not a slot file"


async def test_bad_slot_requests(strata_memory_client_factory):
    client = await strata_memory_client_factory()
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


async def test_every_slot_of_a_parallel_engine_takes_slot_actions(strata_client_factory, strata_settings_factory,
                                                                  tmp_path):
    settings = strata_settings_factory(engine={"parallel": 2, "slot_save_path": tmp_path})
    client = await strata_client_factory(settings=settings)
    service = client.app[SERVICE]
    ok = await client.post("/v1/chat/completions", json=chat_body())
    assert ok.status == 200
    holder = next(s.id for s in service.slots if s.key == ok.headers["X-Strata-Conversation"])
    saved = {}
    for n in (0, 1):
        resp = await client.post(f"/slots/{n}?action=save", json={"filename": f"s{n}.bin"})
        assert resp.status == 200, await resp.text()
        saved[n] = (await resp.json())["n_saved"]
    # Each action reached its own slot: only the one that ran the request holds tokens.
    assert saved[holder] > 0 and saved[1 - holder] == 0
    for bad in ("2", "-1", "x", "\u0663"):
        resp = await client.post(f"/slots/{bad}?action=save", json={"filename": "y.bin"})
        body = await resp.json()
        assert_openai_error(body, 404, resp.status)
        assert body["error"]["code"] == "no_such_slot" and "2 slot(s)" in body["error"]["message"]


TENANTS = {"api_key": "k-plain", "api_keys": {"alice": "ka", "bob": "kb"}}


def as_(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def without_name(body: dict, name: str) -> dict:
    """The error with the file name taken out, to compare two answers about two names."""
    error = dict(body["error"])
    error["message"] = error["message"].replace(repr(name), "<name>")
    return error


async def test_a_tenant_reaches_only_its_own_slot_files(strata_client_factory, strata_settings_factory, tmp_path):
    client = await strata_client_factory(settings=strata_settings_factory(server=TENANTS))
    slots = tmp_path / "slots"
    assert (await client.post("/v1/chat/completions", json=chat_body(PROMPT), headers=as_("ka"))).status == 200

    saved = await client.post("/slots/0?action=save", json={"filename": "x.bin"}, headers=as_("ka"))
    assert saved.status == 200, await saved.text()
    assert (await saved.json())["filename"] == "x.bin", "the answer names what the client said"
    alice_tokens = (await saved.json())["n_saved"]
    alice_file = slots / "hand-alice--x.bin"
    alice_bytes = alice_file.read_bytes()
    assert not (slots / "x.bin").exists()

    # The plain key is a tenant of its own: its x.bin is a plain name, and holds another state.
    plain_words = chat_body("The plain key's own, much longer words: " + "a wave, a gull, a harbour; " * 20)
    assert (await client.post("/v1/chat/completions", json=plain_words, headers=as_("k-plain"))).status == 200
    plain = await client.post("/slots/0?action=save", json={"filename": "x.bin"}, headers=as_("k-plain"))
    assert plain.status == 200 and (slots / "x.bin").exists()
    assert (await plain.json())["n_saved"] != alice_tokens, "the two files hold states told apart by size"

    # bob has no x.bin of his own: neither alice's nor the plain key's is restored for him.
    missing = await client.post("/slots/0?action=restore", json={"filename": "x.bin"}, headers=as_("kb"))
    nosuch = await client.post("/slots/0?action=restore", json={"filename": "nosuch.bin"}, headers=as_("kb"))
    assert_openai_error(await missing.json(), 404, missing.status)
    assert missing.status == nosuch.status
    assert without_name(await missing.json(), "x.bin") == without_name(await nosuch.json(), "nosuch.bin"), \
        "another tenant's file and no file at all get the same answer"
    # bob's x.bin is his own: alice's is not overwritten.
    assert (await client.post("/v1/chat/completions", json=chat_body("bob's own words"), headers=as_("kb"))).status == 200
    bob = await client.post("/slots/0?action=save", json={"filename": "x.bin"}, headers=as_("kb"))
    assert bob.status == 200
    assert alice_file.read_bytes() == alice_bytes and (slots / "hand-bob--x.bin").exists()

    # No way from the plain key into a named tenant's namespace.
    for name in ("hand-alice--x.bin", "HAND-alice--x.bin"):
        resp = await client.post("/slots/0?action=restore", json={"filename": name}, headers=as_("k-plain"))
        assert_openai_error(await resp.json(), 400, resp.status)
    # alice gets back exactly what she saved, not the plain key's x.bin nor bob's.
    restored = await client.post("/slots/0?action=restore", json={"filename": "x.bin"}, headers=as_("ka"))
    assert restored.status == 200 and (await restored.json())["filename"] == "x.bin"
    assert (await restored.json())["n_restored"] == alice_tokens
    assert alice_file.read_bytes() == alice_bytes


@pytest.mark.parametrize("key", ["ka", "k-plain"])
async def test_auto_sessions_names_are_refused_to_hand_actions_whatever_the_tenant(
    strata_memory_client_factory, strata_settings_factory, tmp_path, key
):
    client = await strata_memory_client_factory(settings=strata_settings_factory(server=TENANTS))
    slots = tmp_path / "slots"
    slots.mkdir(exist_ok=True)  # made by llama-server's start; the double makes none
    (slots / "auto-alice--s1.bin").write_bytes(b"a parked conversation")
    answers = {}
    for action in ("save", "restore"):
        for name in ("auto-alice--s1.bin", "auto-alice--nosuch.bin", "Auto-junk.bin", "tmp-auto-x-1.bin"):
            resp = await client.post(f"/slots/0?action={action}", json={"filename": name}, headers=as_(key))
            body = await resp.json()
            assert_openai_error(body, 400, resp.status)
            assert body["error"]["code"] == "reserved_filename"
            answers[(action, name)] = without_name(body, name)
    assert answers[("restore", "auto-alice--s1.bin")] == answers[("restore", "auto-alice--nosuch.bin")]
    assert (slots / "auto-alice--s1.bin").read_bytes() == b"a parked conversation"
    assert sorted(p.name for p in slots.iterdir()) == ["auto-alice--s1.bin"]


async def test_a_name_too_long_once_namespaced_is_refused_not_failed(strata_memory_client_factory, strata_settings_factory):
    client = await strata_memory_client_factory(settings=strata_settings_factory(server=TENANTS))
    for name in ("é" * 127 + ".bin", "x" * 250 + ".bin", "\ud800.bin"):
        resp = await client.post("/slots/0?action=save", json={"filename": name}, headers=as_("ka"))
        assert_openai_error(await resp.json(), 400, resp.status)
        resp = await client.post("/slots/0?action=restore", json={"filename": name}, headers=as_("ka"))
        assert_openai_error(await resp.json(), 400, resp.status)


@pytest.mark.parametrize("read", ["answered during the call", "asked before the call"])
async def test_a_slot_report_read_around_a_slot_call_leaves_the_slot_to_the_call(
        strata_client_factory, monkeypatch, read):
    """Another request's ``GET /slots`` can overlap a slot call (seen with two slots and
    impatient clients): answered while a restore is in flight, it shows the file already
    loaded and the picture not yet told; asked before the call, it shows the slot as it
    was. Neither is a correction: the call's own record stands, and agrees with the engine."""
    client = await strata_client_factory()
    service = client.app[SERVICE]
    assert (await client.post("/v1/chat/completions", json=chat_body(PROMPT * 6))).status == 200
    saved = await client.post("/slots/0?action=save", json={"filename": "long.bin"})
    assert saved.status == 200, await saved.text()
    assert (await client.post("/v1/chat/completions", json=chat_body(PROMPT))).status == 200
    await service.check_slots()
    short = service.slots[0].tokens
    assert short is not None and short < (await saved.json())["n_saved"]
    stale, actions = None, None
    if read == "answered during the call":
        real_restore = service.engine.restore

        async def restore(filename, slot):
            answer = await real_restore(filename, slot)
            await service.check_slots()  # the engine has loaded the file; the picture is not told yet
            return answer

        monkeypatch.setattr(service.engine, "restore", restore)
    else:
        actions = service.slots.actions()
        stale = await service.engine.slots()
    restored = await client.post("/slots/0?action=restore", json={"filename": "long.bin"})
    assert restored.status == 200, await restored.text()
    n_restored = (await restored.json())["n_restored"]
    if stale is not None:
        service.slots.adopt_engine_counts(stale, actions)  # the report asked before, arriving now
    assert service.slots.corrections == 0, "a report overlapping the call is no correction"
    assert service.slots[0].tokens == n_restored != short
    await service.check_slots()
    assert service.slots.corrections == 0 and service.slots[0].tokens == n_restored, "the picture is the engine's"
    if stale is not None:
        service.slots.adopt_engine_counts(stale)  # the control: taken at its word, it is wrong
        assert service.slots.corrections == 1 and service.slots[0].tokens == short
