"""The ledger on its own: the core's source of each request counted, derived figures, bounded memory."""

from __future__ import annotations

import pytest

from strata_serve import EngineMeasures, state_source
from strata_serve.hook_types import Outcome, StrataRequest, Timings

from strata_ram_cache_stats.ledger import Ledger, RamCacheStatsConfig

PROMPT = 800


def make_ledger(**config) -> Ledger:
    return Ledger(RamCacheStatsConfig(**config), 256 * 2**20, EngineMeasures())


def ask(ledger: Ledger, key: str | None, cache_n: int, prompt: int = PROMPT, *, restored: int = 0,
        in_slot: bool | None = None, status: str = "ok", prompt_ms: float | None = None) -> str | None:
    """One request, recorded as the core does (its measures, its source); ``in_slot`` is
    the core's record (default: the same key as the last request)."""
    request = StrataRequest(route="chat", body={}, conversation_key=key, restored_tokens=restored)
    last = getattr(ledger, "_test_last_key", object())
    request.found_in_slot = (key is not None and key == last and not restored) if in_slot is None else in_slot
    ledger._test_last_key = key
    prompt_n = prompt - cache_n
    timings = Timings(reused=cache_n, prefilled=prompt_n, generated=8,
                      prefill_ms=prompt_n * 0.5 if prompt_ms is None else prompt_ms)
    if status == "error":
        timings = None
    else:
        ledger.measures.answered(timings)
    request.state_source = state_source(request, timings)
    return ledger.after(request, Outcome(status=status, timings=timings))


def test_sources_are_the_cores_and_new_conversations_are_counted_apart():
    ledger = make_ledger()
    assert ask(ledger, "a", 0) == "none", "a first request"
    assert ask(ledger, "a", PROMPT + 8, PROMPT + 40) == "slot"
    assert ask(ledger, "b", 19) == "none"
    assert ask(ledger, "a", 19, PROMPT + 60) == "none", "a return that reused only the template"
    assert ask(ledger, "b", 790) == "ram", "a switch that found its state without a restore"
    assert ask(ledger, None, 0) == "unkeyed"
    assert ask(ledger, "a", PROMPT, PROMPT + 80, restored=PROMPT + 60) == "disk"
    assert ask(ledger, "b", 5, restored=PROMPT) == "disk", "restored, as the client is told, reused or not"
    assert ledger.requests == {"slot": 1, "ram": 1, "disk": 2, "none": 3, "unkeyed": 1}
    assert ledger.new_conversations == 2 and ledger.snapshot()["new_conversations"] == 2


def test_a_restored_conversation_never_seen_here_counts_as_disk():
    """After strata-serve restarts the records are gone, the session files are not."""
    ledger = make_ledger()
    assert ask(ledger, "a", PROMPT - 1, restored=PROMPT) == "disk"
    assert ledger.new_conversations == 1


def test_errors_and_cancels_without_timings_are_not_measured():
    ledger = make_ledger()
    assert ask(ledger, "a", 0, status="error") is None
    request = StrataRequest(route="chat", body={}, conversation_key="a", state_source="engine")
    assert ledger.after(request, Outcome(status="cancelled")) is None
    assert ledger.measured == 0 and ledger.prompt_tokens == 0


def test_a_cancelled_request_with_timings_is_measured():
    """A client that closed its stream right after the last event: the engine did the work."""
    ledger = make_ledger()
    timings = Timings(reused=0, prefilled=PROMPT, generated=8, prefill_ms=400.0)
    request = StrataRequest(route="chat", body={}, conversation_key="a", state_source=state_source(
        StrataRequest(route="chat", body={}, conversation_key="a"), timings))
    assert ledger.after(request, Outcome(status="cancelled", timings=timings)) == "none"


def test_a_request_the_core_gave_no_source_is_not_measured():
    ledger = make_ledger()
    never_sent = StrataRequest(route="chat", body={}, conversation_key="a")
    timings = Timings(reused=0, prefilled=PROMPT, generated=8, prefill_ms=400.0)
    assert ledger.after(never_sent, Outcome(status="ok", timings=timings)) is None
    assert ledger.measured == 0


def test_a_return_that_found_its_state_nowhere_is_counted():
    ledger = make_ledger()
    for key in ("a", "b", "c"):
        ask(ledger, key, 19)
    assert ledger.returns_reread == 0, "first requests are new conversations, not returns"
    assert ask(ledger, "a", 19) == "none"
    assert ledger.returns_reread == 1
    assert ask(ledger, "c", 790, in_slot=False) == "ram", "found without a restore: the engine's RAM cache"
    assert ask(ledger, "b", 5, restored=PROMPT) == "disk"
    assert ledger.returns_reread == 1
    assert ledger.snapshot()["returns_reread"] == 1


def test_prefill_speed_is_the_cores_and_prices_reused_tokens_even_those_seen_before_it_was_known():
    ledger = make_ledger()
    ask(ledger, "a", 0, 10, prompt_ms=100.0)  # too short to measure a speed
    ask(ledger, "a", 10, 20)  # 10 reused, speed still unknown
    assert ledger.tokens_per_second is None and ledger.avoided_seconds == 0
    ask(ledger, "a", 20, 1020, prompt_ms=500.0)  # 1,000 tokens in 0.5 s: 2,000 tokens/s
    assert ledger.tokens_per_second == pytest.approx(2000) == ledger.measures.prefill_tokens_per_second
    assert ledger.avoided_seconds == pytest.approx(30 / 2000)
    numbers = ledger.snapshot()
    assert numbers["prompt_tokens"] == 1050 and numbers["reused_tokens"] == 30
    assert numbers["prefilled_tokens"] == 1020
    assert numbers["reuse_ratio"] == pytest.approx(30 / 1050, abs=1e-4)
    assert numbers["prefill_seconds"] == pytest.approx(0.1 + 0.005 + 0.5)
    assert numbers["prefill_tokens_per_second"] == pytest.approx(2000)


def test_bytes_per_token_is_the_cores():
    ledger = make_ledger()
    assert ledger.snapshot()["engine_ram_cache"]["bytes_per_token"] is None
    ledger.measures.state_file(1000, 250_000)
    assert ledger.snapshot()["engine_ram_cache"]["bytes_per_token"] == 250


def test_conversation_records_are_capped_oldest_dropped():
    ledger = make_ledger(max_conversations=2)
    for key in ("a", "b", "a", "c"):
        ask(ledger, key, 0)
    assert list(ledger.conversations) == ["a", "c"]
    assert ledger.records_dropped == 1
    assert [row["key"] for row in ledger.recent_conversations()] == ["c", "a"]
    assert ledger.new_conversations == 3
    ask(ledger, "b", PROMPT)
    assert ledger.new_conversations == 4, "b is no longer remembered"
