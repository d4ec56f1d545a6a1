"""How the plugin chooses among parked conversations (no engine: the choice alone)."""

from __future__ import annotations

from types import SimpleNamespace

from strata_auto_sessions import ParkedConversation, message_chain
from strata_prefix_restore import PrefixRestoreConfig, auto_sessions_fallback

SYSTEM = {"role": "system", "content": "S" * 4000}


def parked(key: str, messages: list[dict], tokens: int = 1200, size: int = 10**7) -> ParkedConversation:
    chain = message_chain({}, messages)
    return ParkedConversation(key=key, tokens=tokens, bytes=size, last_used=0, **chain)


class Speeds:
    """What auto-sessions measured: prefill and restore speed (None: not yet)."""

    def __init__(self, prefill_tps: float | None = None, restore_bps: float | None = None):
        self.prefill_tps, self.restore_bps = prefill_tps, restore_bps

    def prefill_seconds(self, tokens):
        return None if self.prefill_tps is None else tokens / self.prefill_tps

    def restore_seconds(self, size):
        return None if self.restore_bps is None else size / self.restore_bps


def choose(incoming, candidates, speeds=None, **config):
    service = SimpleNamespace(plugin_config=lambda name, model: PrefixRestoreConfig(**config))
    request = SimpleNamespace(conversation_key="new")
    return auto_sessions_fallback(request=request, chain=message_chain({}, incoming), parked=candidates,
                                  costs=speeds or Speeds(), service=service)


def test_the_longest_shared_opening_wins():
    incoming = [SYSTEM, {"role": "user", "content": "q1"}, {"role": "assistant", "content": "a1"},
                {"role": "user", "content": "q2, new"}]
    short = parked("short", [SYSTEM, {"role": "user", "content": "other"}])
    long = parked("long", incoming[:3] + [{"role": "user", "content": "q2, old"}])
    assert choose(incoming, [short, long]) == "long"


def test_nothing_shared_or_too_little_is_no_choice():
    incoming = [SYSTEM, {"role": "user", "content": "q"}]
    assert choose(incoming, [parked("other", [{"role": "system", "content": "T"}, *incoming[1:]])]) is None
    assert choose(incoming, [parked("small", incoming, tokens=100)], min_shared_tokens=256) is None


def test_tools_are_part_of_the_opening():
    incoming = [SYSTEM, {"role": "user", "content": "q"}]
    with_tools = message_chain({"tools": [{"type": "function", "function": {"name": "f"}}]}, incoming)
    candidate = ParkedConversation(key="tools", tokens=1200, bytes=1, last_used=0, **with_tools)
    assert choose(incoming, [candidate]) is None


def test_a_restore_that_costs_more_than_it_saves_is_not_chosen():
    incoming = [SYSTEM, {"role": "user", "content": "q"}]
    candidate = parked("big", [SYSTEM, {"role": "user", "content": "other"}], tokens=1200, size=10**9)
    fast_prefill_slow_disk = Speeds(prefill_tps=10_000, restore_bps=10**8)   # 0.12 s saved, 10 s restore
    assert choose(incoming, [candidate], fast_prefill_slow_disk) is None
    slow_prefill_fast_disk = Speeds(prefill_tps=100, restore_bps=10**10)     # 12 s saved, 0.1 s restore
    assert choose(incoming, [candidate], slow_prefill_fast_disk) == "big"
