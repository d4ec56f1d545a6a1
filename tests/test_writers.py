"""Each piece of shared state has one writer: what a keying plugin answers is a value the
core records, the slot registry is recorded by the service, and what chooses a slot answers.

Unit tests of the core's logic: no engine (a stand-in answers ``slots()`` where one is asked).
"""

from __future__ import annotations

import logging

import pytest

import strata_serve
from strata_serve.config import Settings
from strata_serve.engine.base import EngineUnavailable, SlotReport
from strata_serve.keying import choose_key
from strata_serve.memory_engine import MemoryEngine
from strata_serve.plugins import get_plugin_manager
from strata_serve.service import Service
from strata_serve.slot_choice import claim_for, locate
from strata_serve.slot_state import SlotRegistry


class Keying:
    """A keying plugin answering whatever it is told to."""

    strata_name = "keying"

    def __init__(self, answer, legacy_named: bool = False):
        self.answer, self.legacy_named = answer, legacy_named

    @strata_serve.hookimpl
    def conversation_key(self, request):
        if self.legacy_named:
            request.conversation_named = True  # the way before the hook returned a value
        return self.answer


def service_with(plugin, tenant_keys: dict[str, str] | None = None) -> Service:
    settings = Settings(server={"api_keys": tenant_keys} if tenant_keys else {})
    pm = get_plugin_manager(settings, entrypoints=False, plugins=[plugin], defaults=False)
    return Service(settings, pm, MemoryEngine())


def chat(tenant: str | None = None) -> strata_serve.StrataRequest:
    return strata_serve.StrataRequest(route="chat", body={"messages": [{"role": "user", "content": "hi"}]},
                                      tenant=tenant)


def test_a_keying_plugin_answers_a_value_and_the_core_records_it():
    named = service_with(Keying(strata_serve.ConversationKey("session-7", named=True)))
    request = chat()
    assert named.conversation_key(request) == "session-7" and request.conversation_named is True
    guessed = service_with(Keying("opening-hash"))
    request = chat()
    assert guessed.conversation_key(request) == "opening-hash" and request.conversation_named is False
    request.conversation_named = True  # a request keyed again gets the new answer, whatever it held
    assert guessed.conversation_key(request) == "opening-hash" and request.conversation_named is False


def test_the_keying_step_returns_its_answer_and_writes_nothing_on_the_request():
    service = service_with(Keying(strata_serve.ConversationKey("s1", named=True)), {"alice": "ka"})
    request = chat(tenant="alice")
    answer = choose_key(service.pm, request, service)
    assert answer == strata_serve.ConversationKey("alice--s1", named=True), "checked and in the tenant's namespace"
    assert request.conversation_key is None and request.conversation_named is False


def test_a_named_answer_is_checked_like_a_plain_key():
    with pytest.raises(strata_serve.KeyRefused, match="reserved"):
        service_with(Keying(strata_serve.ConversationKey("a--b", named=True))).conversation_key(chat())
    request = chat()
    assert service_with(Keying(strata_serve.ConversationKey("no spaces", named=True))).conversation_key(request) is None
    assert request.conversation_named is False, "no key, so nothing named"


def test_a_plugin_that_still_sets_the_field_is_heard_and_told_once(caplog):
    service = service_with(Keying("client-id", legacy_named=True))
    with caplog.at_level(logging.WARNING, logger="strata_serve.service"):
        first, second = chat(), chat()
        assert service.conversation_key(first) == "client-id" and first.conversation_named is True
        assert service.conversation_key(second) == "client-id" and second.conversation_named is True
    said = [r.getMessage() for r in caplog.records if "ConversationKey(key, named=True)" in r.getMessage()]
    assert len(said) <= 1, said


def test_a_save_that_finds_the_slot_empty_records_it_empty_and_nameless():
    slots = SlotRegistry.for_engine(1)
    slots.sent(0, chat())
    slots[0].key = "k"
    slots.saved(0, 0)
    assert slots[0].empty and slots[0].key is None and slots[0].since is None
    slots.sent(0, chat())
    slots[0].key, slots[0].tokens = "k", 40
    slots.saved(0, 40)
    assert slots[0].key == "k" and slots[0].tokens == 40, "a save that found tokens keeps the name"


def test_a_provisional_state_is_told_through_the_plugins_own_method():
    slots = SlotRegistry.for_engine(1)
    slots[0].key, slots[0].tokens, slots[0].file_current = "k", 12, True
    slots.nothing_durable(0)
    assert slots[0].key is None and slots[0].empty and not slots[0].file_current


class Reporting:
    """An engine stand-in whose slot reports are given (or which cannot be asked)."""

    def __init__(self, reports: list[SlotReport] | None):
        self.reports = reports
        self.pinned_routes = frozenset({"/v1/chat/completions"})

    async def slots(self) -> list[SlotReport]:
        if self.reports is None:
            raise EngineUnavailable("down")
        return self.reports


def test_a_claim_answers_whether_the_engine_places_the_request_and_leaves_the_request_alone():
    request = strata_serve.StrataRequest(route="embeddings", body={}, api=strata_serve.api_of(
        strata_serve.StrataRequest(route="embeddings", body={})))
    claim = claim_for(request, Reporting([]), 2)
    assert claim.exclusive and claim.pinned is False
    assert request.pinned is True, "the service records it, not the question"
    chat_request = strata_serve.StrataRequest(route="chat", body={}, api=strata_serve.api_of(chat()))
    assert claim_for(chat_request, Reporting([]), 2).pinned is True


async def test_locate_answers_where_the_engine_ran_a_request_and_the_registry_records_it():
    slots = SlotRegistry.for_engine(3)
    request = chat()
    request.conversation_key = "k"
    slots.sent(0, request)
    reports = [SlotReport(id=0, task=4, tokens=0), SlotReport(id=1, task=9, tokens=30), SlotReport(id=2, task=5, tokens=7)]
    before = [(s.key, s.tokens) for s in slots]
    found = await locate(Reporting(reports), slots, tasks_before={0: 4, 1: 2, 2: 3})
    assert [(s.key, s.tokens) for s in slots] == before, "locate writes nothing"
    assert found.ran == 1 and found.touched == frozenset({2})
    assert slots.located(0, found) == 1
    assert slots[1].key == "k" and slots[1].tokens == 30 and slots[0].key is None
    unknown = await locate(Reporting(None), slots, tasks_before=None)
    assert unknown.reports is None and slots.located(1, unknown) == 1
    assert all(s.key is None for s in slots), "the engine did not say: no slot's name is trusted"
