"""The ledger on its own: sources, the RAM cache model, derived figures, bounded memory."""

from __future__ import annotations

import pytest

from strata_serve.exchange import Outcome, StrataRequest

from strata_serve.engine.ram_cache import MIB, EngineRamModel, budget_bytes
from strata_ram_cache_stats.ledger import Ledger, RamCacheStatsConfig

PROMPT = 800


def make_ledger(ram_mib: int | None = 256, bytes_per_token: float | None = None, **config) -> Ledger:
    budget = budget_bytes(ram_mib)
    ram = EngineRamModel(budget, 100) if budget != 0 else None
    return Ledger(RamCacheStatsConfig(**config), ram, lambda: bytes_per_token)


def ask(ledger: Ledger, key: str | None, cache_n: int, prompt: int = PROMPT, *, restored: int = 0,
        status: str = "ok", prompt_ms: float | None = None) -> str | None:
    request = StrataRequest(route="chat", body={}, conversation_key=key)
    if restored:
        request.state["auto_sessions"] = {"restored_tokens": restored}
    prompt_n = prompt - cache_n
    timings = {"cache_n": cache_n, "prompt_n": prompt_n, "predicted_n": 8,
               "prompt_ms": prompt_n * 0.5 if prompt_ms is None else prompt_ms}
    return ledger.after(request, Outcome(status=status, timings=timings if status != "error" else None))


def test_sources_of_a_first_a_continued_and_a_returning_conversation():
    ledger = make_ledger(ram_mib=0)
    assert ask(ledger, "a", 0) == "new"
    assert ask(ledger, "a", PROMPT + 8, PROMPT + 40) == "slot"
    assert ask(ledger, "b", 19) == "new"
    assert ask(ledger, "a", 19, PROMPT + 60) == "none", "a return that reused only the template"
    assert ask(ledger, "b", 790) == "ram", "a switch that found its state without a restore"
    assert ask(ledger, None, 0) == "unkeyed"
    assert ask(ledger, "a", PROMPT, PROMPT + 80, restored=PROMPT + 60) == "disk"
    assert ask(ledger, "b", 5, restored=PROMPT) == "none", "a restore the engine did not reuse"
    assert ledger.requests == {"slot": 1, "ram": 1, "disk": 1, "none": 2, "new": 2, "unkeyed": 1}


def test_a_restored_conversation_never_seen_here_counts_as_disk():
    """After strata-serve restarts the records are gone, the session files are not."""
    ledger = make_ledger()
    assert ask(ledger, "a", PROMPT - 1, restored=PROMPT) == "disk"


def test_errors_and_cancels_without_timings_are_not_measured():
    ledger = make_ledger()
    assert ask(ledger, "a", 0, status="error") is None
    assert ledger.held_key is None, "an engine error leaves the slot as it was"
    request = StrataRequest(route="chat", body={}, conversation_key="a")
    assert ledger.after(request, Outcome(status="cancelled")) is None
    assert ledger.held_key == "a", "a cancelled request still took the slot"
    assert ledger.measured == 0 and ledger.prompt_tokens == 0


def test_a_slot_changed_by_hand_is_no_longer_named():
    ledger = make_ledger()
    ask(ledger, "a", 0)
    erase = StrataRequest(route="slots", body={"action": "erase"})
    assert ledger.after(erase, Outcome(status="ok")) is None
    assert ledger.held_key is None
    assert ask(ledger, "a", 0, PROMPT + 40) == "none"
    assert ledger.ram.entries == {}, "nothing named was held, so nothing was parked"


def test_the_ram_model_parks_the_outgoing_and_takes_the_returning():
    ledger = make_ledger()
    ask(ledger, "a", 0)
    ask(ledger, "b", 19)
    assert list(ledger.ram.entries) == ["a"] and ledger.ram.tokens == PROMPT + 8
    ask(ledger, "a", PROMPT - 1)
    assert list(ledger.ram.entries) == ["b"]
    ask(ledger, None, 0)
    assert list(ledger.ram.entries) == ["b", "a"]
    ask(ledger, "c", 0)
    assert len(ledger.ram.entries) == 3, "an unkeyed prompt takes room in the cache too"


def test_a_restore_parks_nothing_and_leaves_the_ram_copy_alone():
    ledger = make_ledger()
    ask(ledger, "a", 0)
    ask(ledger, "b", 19)
    ask(ledger, "a", PROMPT, restored=PROMPT + 8)
    assert list(ledger.ram.entries) == ["a"], "b was overwritten by the restore, not parked"


def test_a_parked_conversation_that_returns_without_reuse_is_a_ram_miss():
    ledger = make_ledger()
    for key in ("a", "b", "c"):
        ask(ledger, key, 19)
    assert ask(ledger, "a", 19) == "none"
    assert ledger.ram_misses == 1
    assert ask(ledger, "c", 19) == "none"
    assert ledger.ram_misses == 2


def test_the_budget_evicts_the_oldest_once_bytes_per_token_are_known():
    ledger = make_ledger(ram_mib=1, bytes_per_token=528.0)  # 1 MiB holds 1,985 tokens
    for key in ("a", "b", "c"):
        ask(ledger, key, 19)
    assert list(ledger.ram.entries) == ["a", "b"]
    ask(ledger, "d", 19)
    assert list(ledger.ram.entries) == ["b", "c"], "a was dropped to make room for c"
    assert ledger.ram.estimated_bytes(528.0) == 2 * (PROMPT + 8) * 528
    assert ask(ledger, "a", 19) == "none" and ledger.ram_misses == 0, "a was known to be gone"


def test_without_bytes_per_token_or_budget_only_the_entry_cap_applies():
    ledger = make_ledger(ram_mib=-1, bytes_per_token=528.0)
    assert ledger.ram.budget is None
    ledger.ram.max_entries = 2
    for key in ("a", "b", "c", "d"):
        ask(ledger, key, 0)
    assert list(ledger.ram.entries) == ["b", "c"]


@pytest.mark.parametrize("mib, expected", [(None, 8192 * MIB), (0, 0), (-1, None), (256, 256 * MIB)])
def test_budget(mib, expected):
    assert budget_bytes(mib) == expected


def test_prefill_speed_prices_reused_tokens_even_those_seen_before_it_was_known():
    ledger = make_ledger(speed_min_tokens=32)
    ask(ledger, "a", 0, 10, prompt_ms=100.0)  # too short to measure a speed
    ask(ledger, "a", 10, 20)  # 10 reused, speed still unknown
    assert ledger.tokens_per_second is None and ledger.avoided_seconds == 0
    ask(ledger, "a", 20, 1020, prompt_ms=500.0)  # 1,000 tokens in 0.5 s: 2,000 tokens/s
    assert ledger.tokens_per_second == pytest.approx(2000)
    assert ledger.avoided_seconds == pytest.approx(30 / 2000)
    numbers = ledger.snapshot()
    assert numbers["prompt_tokens"] == 1050 and numbers["reused_tokens"] == 30
    assert numbers["prefilled_tokens"] == 1020
    assert numbers["reuse_ratio"] == pytest.approx(30 / 1050, abs=1e-4)
    assert numbers["prefill_seconds"] == pytest.approx(0.1 + 0.005 + 0.5)


def test_conversation_records_are_capped_oldest_dropped():
    ledger = make_ledger(max_conversations=2)
    for key in ("a", "b", "a", "c"):
        ask(ledger, key, 0)
    assert list(ledger.conversations) == ["a", "c"]
    assert ledger.records_dropped == 1
    assert [row["key"] for row in ledger.recent_conversations()] == ["c", "a"]
    assert ask(ledger, "b", PROMPT) == "new", "b is no longer remembered"


def test_an_engine_restart_empties_the_slot_and_the_ram_model():
    ledger = make_ledger()
    ask(ledger, "a", 0)
    ask(ledger, "b", 0)
    ledger.engine_restarted()
    assert ledger.held_key is None and ledger.ram.entries == {}
    assert ask(ledger, "b", 0) == "none"
    assert ledger.ram_misses == 0
