"""The ledger on its own: sources from the core's record of each request, derived figures, bounded memory."""

from __future__ import annotations

import pytest

from strata_serve.hook_types import Outcome, StrataRequest, Timings

from strata_ram_cache_stats.ledger import Ledger, RamCacheStatsConfig

PROMPT = 800


def make_ledger(bytes_per_token: float | None = None, **config) -> Ledger:
    return Ledger(RamCacheStatsConfig(**config), 256 * 2**20, lambda: bytes_per_token)


def ask(ledger: Ledger, key: str | None, cache_n: int, prompt: int = PROMPT, *, restored: int = 0,
        in_slot: bool | None = None, status: str = "ok", prompt_ms: float | None = None) -> str | None:
    """One request; ``in_slot`` is the core's record (default: the same key as the last request)."""
    request = StrataRequest(route="chat", body={}, conversation_key=key, restored_tokens=restored)
    last = getattr(ledger, "_test_last_key", object())
    request.found_in_slot = (key is not None and key == last and not restored) if in_slot is None else in_slot
    ledger._test_last_key = key
    prompt_n = prompt - cache_n
    timings = Timings(reused=cache_n, prefilled=prompt_n, generated=8,
                      prefill_ms=prompt_n * 0.5 if prompt_ms is None else prompt_ms)
    return ledger.after(request, Outcome(status=status, timings=timings if status != "error" else None))


def test_sources_of_a_first_a_continued_and_a_returning_conversation():
    ledger = make_ledger()
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
    request = StrataRequest(route="chat", body={}, conversation_key="a")
    assert ledger.after(request, Outcome(status="cancelled")) is None
    assert ledger.measured == 0 and ledger.prompt_tokens == 0


def test_a_cancelled_request_with_timings_is_measured():
    """A client that closed its stream right after the last event: the engine did the work."""
    ledger = make_ledger()
    request = StrataRequest(route="chat", body={}, conversation_key="a")
    timings = Timings(reused=0, prefilled=PROMPT, generated=8, prefill_ms=400.0)
    assert ledger.after(request, Outcome(status="cancelled", timings=timings)) == "new"


def test_slot_actions_are_not_measured():
    ledger = make_ledger()
    erase = StrataRequest(route="slots", body={"action": "erase"})
    assert ledger.after(erase, Outcome(status="ok")) is None
    assert ledger.measured == 0


def test_a_return_without_a_restore_that_rereads_is_counted():
    ledger = make_ledger()
    for key in ("a", "b", "c"):
        ask(ledger, key, 19)
    assert ask(ledger, "a", 19) == "none"
    assert ledger.returns_reread == 1
    assert ask(ledger, "c", 790, in_slot=False) == "ram", "found without a restore: the engine's RAM cache"
    assert ask(ledger, "c", 5, PROMPT + 40, in_slot=True) == "none"
    assert ledger.returns_reread == 2
    assert ledger.snapshot()["returns_reread"] == 2


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
