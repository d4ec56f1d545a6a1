"""Tenants kept apart: slot files, auto-sessions' own files, and strict isolation of the slot."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import pytest

import strata_auto_sessions
import strata_ram_cache_stats
from strata_auto_sessions.store import SessionStore, Sidecar
from strata_serve.api import SERVICE
from strata_serve.config import ConfigError, load_settings
from strata_serve.engine.llama_server import build_command
from strata_serve.hook_types import EngineError
from strata_serve.testing import assert_openai_error, chat_body, conversation
from strata_auto_sessions.testing import all_parked_names

ROOT = Path(__file__).resolve().parent.parent
KEYS = {"api_key": "k-plain", "api_keys": {"alice": "ka", "bob": "kb"}}
STRICT = {**KEYS, "tenant_isolation": "strict"}
#: Alice's text, and a guess of the same length that shares nothing with it but the template.
ALICE = conversation("alice")[0]["content"]
WRONG = conversation("zorro")[0]["content"]


def as_(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


async def ask(client, key: str, text: str, **extra) -> dict:
    resp = await client.post("/v1/chat/completions", json=chat_body(text, **extra), headers=as_(key))
    assert resp.status == 200, await resp.text()
    return await resp.json()


# -- settings ------------------------------------------------------------------------------


def test_strict_mode_turns_the_ram_cache_off_and_refuses_what_would_share_state(tmp_path):
    model = tmp_path / "m.gguf"
    strict = load_settings(server={"tenant_isolation": "strict"}, engine={"model": str(model)})
    assert strict.engine.cache_ram_mib == 0
    command = build_command(strict.engine, tmp_path / "llama-server", 1)
    assert command[command.index("--cache-ram") + 1] == "0"
    assert load_settings(engine={"model": str(model)}).engine.cache_ram_mib is None, "shared: untouched"
    attached = load_settings(server={"tenant_isolation": "strict"},
                             engine={"url": "http://127.0.0.1:1", "cache_ram_mib": 0})
    assert attached.engine.cache_ram_mib == 0

    refused = {
        "an attached engine nobody said is without RAM cache": {"engine": {"url": "http://127.0.0.1:1"}},
        "a RAM cache asked for": {"engine": {"cache_ram_mib": 512}},
        "several slots": {"engine": {"parallel": 2}},
        "--cache-ram in extra_args": {"engine": {"extra_args": ["--cache-ram", "512"]}},
        "-cram in extra_args": {"engine": {"extra_args": ["-cram", "512"]}},
        "slots in extra_args": {"engine": {"extra_args": ["--parallel=4"]}},
        "the plugin that erases, disabled": {"disable_plugins": ["tenant_isolation"]},
    }
    for why, sections in refused.items():
        with pytest.raises(ConfigError, match="tenant_isolation") as caught:
            load_settings(**{"server": {"tenant_isolation": "strict"}, **sections})
        assert caught.value.args[0], why


def test_tenant_names_that_differ_only_by_case_are_refused():
    with pytest.raises(ConfigError, match="differ only by case"):
        load_settings(server={"api_keys": {"alice": "a", "Alice": "b"}})


# -- auto-sessions' files are its own ------------------------------------------------------


def test_the_store_lists_and_sweeps_only_files_with_its_sidecar(tmp_path):
    store = SessionStore(tmp_path)
    store.prepare()
    (tmp_path / "auto-junk.bin").write_bytes(b"saved by hand by an older version")
    (tmp_path / "auto-junk2.json").write_bytes(b"\x00\x01 a state file saved by hand as .json")
    (tmp_path / "auto-other.bin").write_bytes(b"x")
    (tmp_path / "auto-other.json").write_text('{"key": "someone", "fingerprint": {}, "tokens": 1, "bytes": 1, '
                                              '"created": 0, "last_used": 0, "digest": ""}')
    store.bin_path("Mine").write_bytes(b"y" * 10)
    store.write_sidecar(Sidecar(key="Mine", fingerprint={}, tokens=1, bytes=10, created=0, last_used=0, digest=""))
    assert [key for key, *_ in store.files()] == ["Mine"]
    assert store.prune(keep=1, max_bytes=1) == [("Mine", 10)]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "auto-.held.json", "auto-.server.json", "auto-junk.bin", "auto-junk2.json", "auto-other.bin",
        "auto-other.json"]


async def test_hand_saved_files_are_never_pruned_by_auto_sessions(strata_client_factory, strata_settings_factory):
    # Whole files: alice's file is copied under auto-sessions' names below.
    settings = strata_settings_factory(plugins={"auto_sessions": {"min_tokens": 100, "keep": 3, "blocks": False}},
                                       server=KEYS)
    client = await strata_client_factory(strata_auto_sessions, settings=settings)
    slots = client.app[SERVICE].engine.info.slot_save_path
    body = {"messages": conversation("alice"), "max_tokens": 8, "temperature": 0}
    resp = await client.post("/v1/chat/completions", json=body, headers=as_("ka"))
    assert resp.status == 200
    await ask(client, "kb", "bob's words")  # a switch: alice's conversation is parked
    (alice_file,) = slots.glob("auto-alice--*.bin")
    # What an older version let bob do through /slots: newer files under auto-sessions' names.
    later = time.time() + 60
    for i in range(12):
        junk = slots / f"auto-junk{i}.bin"
        junk.write_bytes(alice_file.read_bytes())
        os.utime(junk, (later, later))
    for i in range(3):  # more switches: two more saves, each followed by a prune
        body = {"messages": conversation(f"bob{i}"), "max_tokens": 8, "temperature": 0}
        assert (await client.post("/v1/chat/completions", json=body, headers=as_("kb"))).status == 200
    assert alice_file.exists(), "alice's file was pruned to make room for hand-saved ones"
    assert all((slots / f"auto-junk{i}.bin").exists() for i in range(12))
    parking = client.app[SERVICE].state["auto_sessions"]
    assert parking.stats.saves == 3 and parking.stats.files_on_disk == 3 and parking.stats.prunes == 0


# -- strict isolation of the slot ----------------------------------------------------------


@pytest.mark.parametrize("mode, cache_ram", [("shared", 0), ("shared", None), ("strict", None)])
async def test_a_guess_at_another_tenants_prompt_shows_in_cache_n_only_when_shared(
    strata_client_factory, strata_settings_factory, mode, cache_ram
):
    settings = strata_settings_factory(server={**KEYS, "tenant_isolation": mode},
                                       engine={"cache_ram_mib": cache_ram})
    client = await strata_client_factory(settings=settings)
    engine = client.app[SERVICE].engine

    async def bob_guesses(text: str) -> dict:
        await ask(client, "ka", ALICE)
        if cache_ram is None:
            await ask(client, "kb", "something else entirely")  # alice's prompt now only in RAM, if anywhere
        return (await ask(client, "kb", text))["timings"]

    right, wrong = await bob_guesses(ALICE), await bob_guesses(WRONG)
    prompt = right["cache_n"] + right["prompt_n"]
    assert prompt > 500
    if mode == "shared":
        assert right["cache_n"] > wrong["cache_n"] + 400, (right, wrong)  # the leak, documented
    else:
        assert engine.info.cache_ram_mib == 0
        # Equal: at most the chat template's opening, from bob's own request before.
        assert right["cache_n"] == wrong["cache_n"] < 10, (right, wrong)


async def test_strict_mode_erases_after_auto_sessions_parked_and_keeps_a_tenants_own_state(
    strata_client_factory, strata_settings_factory, caplog
):
    caplog.set_level(logging.DEBUG, logger="strata_serve.tenant_isolation")
    settings = strata_settings_factory(server=STRICT, plugins={"auto_sessions": {"min_tokens": 100}})
    client = await strata_client_factory(strata_auto_sessions, settings=settings)
    slots = client.app[SERVICE].engine.info.slot_save_path

    def erases() -> list[str]:
        return [r.getMessage() for r in caplog.records if "tenant isolation: slot erased" in r.getMessage()]

    first_alice = await ask(client, "ka", ALICE)
    bob = await ask(client, "kb", ALICE)  # the same words: bob still reuses nothing of hers
    assert bob["timings"]["cache_n"] == 0
    assert len(all_parked_names(slots, "auto-alice--")) == 1, "parked before the erase"
    assert erases() == ["[strata] tenant isolation: slot erased before a request of bob"]

    alice = await ask(client, "ka", ALICE)  # back from her file: not erased, fully reused
    assert alice["timings"]["cache_n"] >= first_alice["usage"]["prompt_tokens"] - 2
    bob_again = await ask(client, "kb", ALICE)
    assert bob_again["timings"]["cache_n"] >= bob["usage"]["prompt_tokens"] - 2
    assert len(erases()) == 1, "a tenant's own restored state is never erased"
    assert client.app[SERVICE].state["auto_sessions"].stats.restores == 2


@pytest.mark.parametrize("mode", ["shared", "strict"])
async def test_a_hand_save_takes_another_tenants_state_only_when_shared(
    strata_client_factory, strata_settings_factory, mode
):
    settings = strata_settings_factory(server={**KEYS, "tenant_isolation": mode})
    client = await strata_client_factory(settings=settings)
    await ask(client, "ka", ALICE)
    saved = await client.post("/slots/0?action=save", json={"filename": "loot.bin"}, headers=as_("kb"))
    assert saved.status == 200, await saved.text()
    await ask(client, "ka", "alice again, something else")
    restored = await client.post("/slots/0?action=restore", json={"filename": "loot.bin"}, headers=as_("kb"))
    assert restored.status == 200, await restored.text()
    guess = (await ask(client, "kb", ALICE))["timings"]
    if mode == "shared":
        assert (await saved.json())["n_saved"] > 500 and guess["cache_n"] > 500
    else:
        assert (await saved.json())["n_saved"] == 0 and guess["cache_n"] == 0


async def test_a_failed_erase_leaves_the_request_reusing_nothing(
    strata_client_factory, strata_settings_factory, caplog
):
    client = await strata_client_factory(settings=strata_settings_factory(server=STRICT))
    engine = client.app[SERVICE].engine
    real_erase = engine.erase

    async def failing_erase(slot: int = 0):  # a test double: the real engine's erase does not fail
        raise EngineError(op="erase", message="refused", status=500)

    await ask(client, "ka", ALICE)
    engine.erase = failing_erase
    guess = await ask(client, "kb", ALICE)
    assert guess["timings"]["cache_n"] == 0
    assert any("erasing the slot before a request of another tenant failed" in r.getMessage()
               for r in caplog.records if r.levelno == logging.ERROR)
    engine.erase = real_erase
    await ask(client, "ka", ALICE)
    assert (await ask(client, "kb", ALICE))["timings"]["cache_n"] == 0


@pytest.mark.parametrize("mode", ["shared", "strict"])
async def test_server_wide_figures_are_for_the_plain_key_only_when_strict(
    strata_client_factory, strata_settings_factory, mode
):
    settings = strata_settings_factory(server={**KEYS, "tenant_isolation": mode})
    client = await strata_client_factory(strata_ram_cache_stats, settings=settings)
    await ask(client, "ka", ALICE)
    for path in ("/slots", "/stats", "/metrics"):
        plain = await client.get(path, headers=as_("k-plain"))
        assert plain.status == 200, path
        bob = await client.get(path, headers=as_("kb"))
        if mode == "shared":
            assert bob.status == 200, path
        else:
            body = await bob.json()
            assert_openai_error(body, 403, bob.status)
            assert body["error"]["code"] == "strict_isolation"


async def test_slots_never_show_one_tenant_anothers_text(strata_client_factory, strata_settings_factory,
                                                         monkeypatch):
    """An engine run with its slot debugging on (``LLAMA_SERVER_SLOTS_DEBUG``) puts each slot's
    last prompt and answer in ``GET /slots``: figures are shared, words are not."""
    monkeypatch.setenv("LLAMA_SERVER_SLOTS_DEBUG", "1")
    client = await strata_client_factory(settings=strata_settings_factory(server=KEYS))
    await ask(client, "ka", ALICE)
    engine_view = (await client.app[SERVICE].engine.slots())[0]
    assert ALICE in engine_view.raw["prompt"], "the engine itself shows the text: the control"
    for key in ("kb", "k-plain", "ka"):
        resp = await client.get("/slots", headers=as_(key))
        assert resp.status == 200
        (slot,) = await resp.json()
        assert slot["n_prompt_tokens"] == engine_view.tokens, "the figures are there"
        shown = {field for field in ("prompt", "generated") if field in slot}
        if key == "ka":
            assert ALICE in slot["prompt"] and "generated" in slot, "alice sees her own slot whole"
        else:
            assert not shown and ALICE[:40] not in await resp.text(), key


def test_the_readmes_cost_of_strict_mode_is_the_measured_one():
    from bench.tenants import read_results, summary

    results = read_results(ROOT / "bench" / "results" / "tenants.md")
    said = summary(results)
    readme = (ROOT / "README.md").read_text()
    block = readme.split("<!-- tenants-summary:", 1)[1].split("-->", 1)[1]
    assert block.split("<!-- end tenants-summary -->", 1)[0].strip() == said
    assert said in (ROOT / "bench" / "results" / "tenants.md").read_text()
    assert results["common_prefix"]["strict"]["cache_n"] == [0] * 2 * results["rounds"]


async def test_strict_mode_keeps_what_a_tenant_restored_by_hand(strata_client_factory, strata_settings_factory):
    client = await strata_client_factory(settings=strata_settings_factory(server=STRICT))
    first = await ask(client, "ka", ALICE)
    saved = await client.post("/slots/0?action=save", json={"filename": "mine.bin"}, headers=as_("ka"))
    assert saved.status == 200 and (await saved.json())["n_saved"] > 500
    await ask(client, "kb", WRONG)
    restored = await client.post("/slots/0?action=restore", json={"filename": "mine.bin"}, headers=as_("ka"))
    assert restored.status == 200, await restored.text()
    again = await ask(client, "ka", ALICE)
    assert again["timings"]["cache_n"] >= first["usage"]["prompt_tokens"] - 2, "her own state, not erased"


async def test_strict_mode_on_an_attached_engine_with_several_slots_erases_them_all(
    strata_client_factory, strata_settings_factory, llama_server_factory
):
    bare = await llama_server_factory(parallel=2)  # llama-server's own default runs 4
    settings = strata_settings_factory(server=STRICT, engine={
        "url": bare.info.url, "cache_ram_mib": 0, "slot_save_path": str(bare.info.slot_save_path),
        "api_key": bare.api_key.get_secret_value()})
    client = await strata_client_factory(settings=settings)
    assert client.app[SERVICE].engine.info.parallel == 2
    other = conversation("xavier")[0]["content"]

    async def bob_guesses(text: str) -> dict:
        await ask(client, "ka", ALICE)
        await ask(client, "ka", other)  # the engine keeps ALICE in one slot, this in the other
        return (await ask(client, "kb", text))["timings"]

    right, wrong = await bob_guesses(ALICE), await bob_guesses(WRONG)
    assert right["cache_n"] == wrong["cache_n"] < 10, (right, wrong)


@pytest.mark.parametrize("mode", ["shared", "strict"])
async def test_state_headers_tell_a_tenant_nothing_of_another_when_strict(
    strata_client_factory, strata_settings_factory, mode
):
    """Bob sends alice's exact words right after her, then other words: in shared mode
    his headers say the state came from the engine's cache for the right guess only
    (the documented leak); in strict mode both answers carry the same headers, his own
    conversation's, and nothing of hers."""
    settings = strata_settings_factory(server={**KEYS, "tenant_isolation": mode},
                                       plugins={"auto_sessions": {"min_tokens": 100}})
    client = await strata_client_factory(strata_auto_sessions, settings=settings)

    async def bob_guesses(text: str) -> dict:
        await ask(client, "ka", ALICE)
        resp = await client.post("/v1/chat/completions", json=chat_body(text), headers=as_("kb"))
        assert resp.status == 200, await resp.text()
        return {name: value for name, value in resp.headers.items() if name.startswith("X-Strata-")}

    right, wrong = await bob_guesses(ALICE), await bob_guesses(WRONG)
    for headers in (right, wrong):
        assert headers["X-Strata-Conversation"].startswith("bob--"), headers
        assert "alice" not in " ".join(headers.values())
        assert headers["X-Strata-Restored-Tokens"] == "0"
    if mode == "shared":
        assert (right["X-Strata-State"], wrong["X-Strata-State"]) == ("ram", "none")
    else:
        assert right["X-Strata-State"] == wrong["X-Strata-State"] == "none"
        assert {k: v for k, v in right.items() if k != "X-Strata-Conversation"} == \
               {k: v for k, v in wrong.items() if k != "X-Strata-Conversation"}
