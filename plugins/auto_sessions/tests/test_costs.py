"""The one cost rule (``policy.Costs``) on the core's measurements: what every decision of
parking takes, a save, a restore by tokens, a fetch from the shared tier, a fallback."""

from __future__ import annotations

import pytest

from strata_auto_sessions import AutoSessionsConfig, Costs
from strata_serve import EngineMeasures


def measured(prefill_tps: float = 1000.0, restore_mbps: float = 100.0, bytes_per_token: int = 1000) -> EngineMeasures:
    """An engine measured at ``prefill_tps`` tokens/s of prefill and ``restore_mbps`` MB/s of restore."""
    m = EngineMeasures()
    m.prefill_tokens, m.prefill_ms = 10_000, 10_000 / prefill_tps * 1000
    m.state_tokens, m.state_bytes = 1000, 1000 * bytes_per_token
    m.restored(10**8, 10**8 / (restore_mbps * 10**6) * 1000)
    return m


def test_before_anything_is_measured_every_state_past_min_tokens_is_worth_it():
    costs = Costs.of(AutoSessionsConfig(min_tokens=100, min_prefill_s=2), EngineMeasures())
    assert costs.worth(None) == (True, "")
    assert costs.worth(99)[0] is False and "below min_tokens (100)" in costs.worth(99)[1]
    assert costs.worth(100) == (True, "")
    assert costs.prefill_seconds(1000) is None and costs.restore_seconds(10**6) is None


def test_a_state_is_worth_it_when_reading_it_again_takes_min_prefill_s_more_than_bringing_it_back():
    # 1,000 tokens/s of prefill; 100 MB/s of restore; 1,000 bytes a token (1 MB = 0.01 s a 1,000 tokens)
    costs = Costs.of(AutoSessionsConfig(min_tokens=0, min_prefill_s=2), measured())
    assert costs.prefill_seconds(3000) == pytest.approx(3.0)
    assert costs.restore_seconds(3 * 10**6) == pytest.approx(0.03)
    assert costs.worth(3000) == (True, "")  # 3 s to read, 0.03 s to restore
    worth, why = costs.worth(1500)  # 1.5 s to read
    assert not worth and "less than min_prefill_s (2 s) more than a restore" in why
    # A fetch from the shared tier counts against it, as the restore does.
    worth, why = costs.worth(3000, 3 * 10**6, more_s=1.5, more="fetching")
    assert not worth and "more than fetching (1.5 s) and restoring it (0.0 s)" in why
    assert costs.worth(3000, 3 * 10**6, more_s=0.5, more="fetching") == (True, "")


def test_a_restore_as_slow_as_the_prefill_is_never_worth_it():
    # 1 MB/s of restore at 1,000 bytes a token: 1,000 tokens/s, the prefill's speed
    costs = Costs.of(AutoSessionsConfig(min_tokens=0, min_prefill_s=2), measured(restore_mbps=1.0))
    assert costs.restore_seconds(3 * 10**6) == pytest.approx(3.0)
    for tokens in (3000, 30_000, 300_000):
        assert costs.worth(tokens)[0] is False, tokens
    # twice as fast as the prefill: worth it once it saves 2 s
    costs = Costs.of(AutoSessionsConfig(min_tokens=0, min_prefill_s=2), measured(restore_mbps=2.0))
    assert costs.worth(3900)[0] is False and costs.worth(4100)[0] is True
