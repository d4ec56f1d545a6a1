"""The soak's verdict on its faults of the shared tier and of slow clients (#38): other
clients answered while the tier hung and while slow readers held on, every stop ended,
and when each fault is made."""

from __future__ import annotations

import copy
from types import SimpleNamespace

from bench import soak


def _run() -> dict:
    """A soak's findings that pass: the tier hung from 10 to 50 s (a restart at 45 s ends
    its clean window), slow readers held from 60 to 90 s, another client answered in each."""
    def record(began: float, ended: float, **more) -> dict:
        return {"api": "chat", "stream": False, "pattern": "read_all", "began": began, "ended": ended,
                "status": 200, "outcome": "answered", "detail": "", "state": "disk", "reused": 600, "read": 40,
                "held_before": 600, "phase": "faults", "role": "client", **more}

    back = {"name": "c", "api": "chat", "status": 200, "state": "disk", "held_before": 700, "reused": 699,
            "read": 40, "outcome": "answered"}
    samples = [{"at": float(t), "pid": 7, "rss_mib": 90.0, "fds": 30, "session_files": 3, "temporaries": 0,
                "disk_bytes": 1, "stats": None} for t in range(0, 121, 5)]
    return {
        "problems": [], "began": 0.0, "faults_over": 120.0,
        "plan": {"keep": 8, "conversations": 6, "hung_tier": True, "slow_reader": True},
        "faults": [{"kind": "hung_tier", "began": 10.0, "ended": 50.0, "detail": {}},
                   {"kind": "restart", "began": 45.0, "ended": 50.0, "detail": {}},
                   {"kind": "slow_reader", "began": 60.0, "ended": 90.0, "detail": {"generation_over": True}}],
        "records": [record(12.0, 20.0), record(11.0, 25.0, role="hung_turn"), record(61.0, 70.0)],
        "samples": samples, "stops": [{"why": "restart", "at": 45.0, "took_s": 3.0, "killed": False}],
        "returns": {"parked": 2, "conversations": 3, "first": [back, back], "quiet": [back, back]},
    }


def test_the_verdict_on_the_hung_tier_the_slow_readers_and_the_stops():
    assert soak.judge(_run()) == []
    broken = {
        # The answer inside the hung window came after the restart began: not clean.
        "none answered while the tier hung": lambda f: f["records"][0].update(began=40.0, ended=47.0),
        "only the hung conversation's own turn answered": lambda f: f["records"].pop(0),
        "none answered while slow readers held on": lambda f: f["records"][2].update(began=85.0, ended=95.0),
        "a stop that had to be killed": lambda f: f["stops"][0].update(killed=True, took_s=30.0),
        "an upload's temporary left": lambda f: [s.update(temporaries=1, temporary_names=["tmp-auto-a-1.bin"])
                                                 for s in f["samples"][3:8]],
    }
    for name, breaks in broken.items():
        found = copy.deepcopy(_run())
        breaks(found)
        assert soak.judge(found), name
    # An upload's snapshot seen at two samples, 5 s apart, is one under way, not one left.
    found = _run()
    for sample in found["samples"][3:5]:
        sample.update(temporaries=1, temporary_names=["tmp-auto-a-1.bin"])
    assert soak.judge(found) == []
    # Slow readers held while the engine still made their answers: the hold proves nothing.
    found = _run()
    found["faults"][2]["detail"]["generation_over"] = False
    found["records"][2].update(began=85.0, ended=95.0)
    assert soak.judge(found) == []


def test_the_first_hung_tier_ends_with_the_restart_and_each_kind_has_its_cycle():
    plan = soak.Plan(minutes=5, fault_every_s=60)
    running = SimpleNamespace(plan=plan)
    running.cycles = lambda: soak.Soak.cycles(running)
    schedule = soak.Soak.schedule(running)
    kinds = [kind for _, kind in schedule]
    assert kinds.count("restart") == 1 and kinds.count("slow_reader") == 1 and kinds.count("kill") == 2
    hung = [at for at, kind in schedule if kind == "hung_tier"]
    back = [at for at, kind in schedule if kind == "tier_back"]
    (restart,) = [at for at, kind in schedule if kind == "restart"]
    assert len(hung) == len(back) == 2 and hung[0] < restart < back[0] and back[0] - restart < 1
    assert back[0] - hung[0] == min(plan.hang_s, 0.6 * plan.fault_every_s)
    # Without the new faults, the cycles and the restart are as they were.
    plain = SimpleNamespace(plan=soak.Plan(minutes=5, fault_every_s=60, hung_tier=False, slow_reader=False))
    plain.cycles = lambda: soak.Soak.cycles(plain)
    kinds = [kind for _, kind in soak.Soak.schedule(plain)]
    assert kinds.count("kill") == 5 and "hung_tier" not in kinds and "slow_reader" not in kinds
    assert dict((kind, at) for at, kind in soak.Soak.schedule(plain))["restart"] == 50.0
