"""The quick benchmark runs end to end, so the benchmarks never rot (times are not asserted).

What is asserted is what does not depend on the machine: the tables are there, every system
of the agent comparison ran (hearth-llm too, when installed), the engine's own token counts
say the bare engine re-read its contexts after the restart while strata-serve with
auto-sessions restored them, and only the systems that park write to disk.
"""

import json
import socket
import struct
import threading
import time

import pytest

from bench.prefix import installed as prefix_restore_installed
from bench.run import main
from bench.systems import hearth_installed


async def test_quick_benchmark_writes_its_tables(tmp_path):
    await main(quick=True, out=tmp_path)
    report = (tmp_path / "README.md").read_text()
    for heading in ("Engine start", "What the layer costs", "Switching back", "save and restore throughput",
                    "Agents at work, tiny model", "sharing a 512-token system prompt, after a restart",
                    "Where the layer's time goes"):
        assert heading in report
    assert "| 512 | strata + auto-sessions, RAM cache off, file current |" in report
    assert "| 512 | llama-server, no switch (A still in the slot) |" in report
    results = json.loads((tmp_path / "results.json").read_text())
    # The control held A: its returns read only the new turn; a file-current return was a restore.
    switch = results["switch_back"]["512"]
    held = switch["llama-server, no switch (A still in the slot)"]
    assert min(held["cache_n"]) >= 500, held["cache_n"]
    current = switch["strata + auto-sessions, RAM cache off, file current"]
    assert current["restore_ms"] and all(ms > 0 for ms in current["restore_ms"])
    assert "The restore itself took" in report and "(no switch: the floor)" in report
    # The default setup's own floor, a turn of A right after each of its at-once returns:
    # no switch (nothing restored: the engine still held A), paired by round.
    blocks = switch["strata + auto-sessions in blocks, RAM cache off"]
    assert len(blocks["held_s"]) == len(blocks["a_returns_s"]) >= 1
    assert blocks["held_restores"] == 0 and blocks["restore_ms"], blocks
    assert "Against that server's own no-switch turn of A in each round" in report

    (agents,) = results["agents"]
    summary = agents["summary"]["agents"]
    expected = {"llama-server, RAM cache default", "llama-server, RAM cache off", "llama-server -np 4, RAM cache default",
                "strata + auto-sessions, RAM cache off", "strata -np 4 + auto-sessions, RAM cache default"}
    if hearth_installed():
        expected.add("hearth-llm (its defaults: -np 1, RAM cache default)")
    assert set(summary) == expected
    for name in expected:
        assert f"| {name} |" in report
        # 4 agents, 2 steps of 2 main turns: every main turn but the first returns.
        assert summary[name]["returning"] == 4 * 3, name
        assert len(summary[name]["restart_s"]) == 1, name
    # The engine's RAM cache kept every context until the engine was killed, and none after.
    default = summary["llama-server, RAM cache default"]
    assert default["reread_after_restart"] > 0 and default["reread_tokens"] == default["reread_after_restart"]
    bare, parked = summary["llama-server, RAM cache off"], summary["strata + auto-sessions, RAM cache off"]
    assert bare["reread_after_restart"] > 0 and bare["bytes_per_request"] == 0
    assert parked["reread_tokens"] == 0 and parked["bytes_per_request"] > 0
    assert parked["file_current"]["switches"] > 0
    assert "not installed" in report if not prefix_restore_installed() else results["prefix"]["with"]

    # Where the time goes: the bare relay and strata-serve both measured, a profile taken.
    found = results["profile"]
    assert found["stream_cpu_ms bare relay"] > 0 and found["stream_cpu_ms strata"] > 0
    assert found["profile"]["total"] > 0 and "strata-serve core" in found["profile"]["categories"]
    assert "Where the layer's time goes" in report and "| bare relay |" in report

    # Several servers: after the kill, the control re-read the conversation; each shared
    # tier's replica restored what the lost one uploaded, every byte of it fetched.
    assert "Several servers: the turn after a failover" in report and "Fetch throughput from each tier" in report
    failover = results["replicas"]["failover"]
    (control,) = failover["none"]
    assert control["after"]["cache_n"] < 0.05 * control["after"]["prompt_n"], control
    for kind in ("directory", "s3"):
        (row,) = failover[kind]
        assert row["after"]["state"] == "disk" and row["after"]["cache_n"] > 10 * row["after"]["prompt_n"], row
        # Every byte of the state sent and fetched: in blocks, the manifest and each object's
        # framing add a few KB to the engine's bytes.
        saved = row["saved_bytes"]
        assert saved > 0 and all(abs(row[k] - saved) <= 0.01 * saved for k in ("fetched_bytes", "uploaded_bytes")), row
    # Against the engine alone: each measure taken both ways, as ratios in the table.
    alone = results["alone"]
    assert "## Against its own engine alone, tiny model" in report and "| 8 clients, requests/s |" in report
    assert all(len(alone["stream_tps"][n]) == 2 and min(alone["stream_tps"][n]) > 0 for n in ("engine", "strata"))
    assert all(len(alone["clients_rps"][n]) == 1 for n in ("engine", "strata"))
    # The 1-token request went all four ways, with an interval for what strata-serve added.
    for kind in ("stream", "json", "kept"):
        assert set(alone[f"one_token_{kind}_p50_ms"]) == {"engine", "strata", "relay", "bytes"}
        low, high = alone[f"one_token_{kind}_added_interval_ms"]
        assert low <= high
    assert "90% interval" in report
    # Where a plain one went, from strata-serve's own spans: the parts fit in the whole.
    for kind in ("json", "kept"):
        parts = alone[f"one_token_{kind}_parts_ms"]
        assert 0 < parts["engine"] < parts["total"] and 0 < parts["own"] < parts["total"] - parts["engine"], parts
        assert parts["read"] > 0 and parts["pre_request"] > 0 and "key" in parts and "queue" in parts, parts
    assert "| 1-token request p50, JSON, connection kept |" in report
    assert "Where a plain 1-token request's" in report and "on a kept connection went" in report
    # The streams went through the byte relay too, each way's ratio with its interval.
    alone = results["alone"]
    assert alone["stream_tps"]["bytes"] and alone["bytes_cpu_s_per_1000_tokens"] > 0
    assert "through a byte relay" in report
    # And the 1-token requests, each kind, with what the byte relay added to them.
    for kind in ("stream", "json", "kept"):
        assert len(alone[f"one_token_{kind}_ms"]["bytes"]) == alone["sizes"]["requests"], kind
        assert isinstance(alone[f"bytes_one_token_{kind}_added_p50_ms"], float), kind
    assert "The 1-token requests through the byte relay too" in report
    # And through the thread relay, each stream whole: its last event, which carries the
    # engine's count of tokens, came through.
    assert len(alone["stream_tps"]["threads"]) == 2 and min(alone["stream_tps"]["threads"]) > 0
    assert alone["threads_cpu_s_per_1000_tokens"] > 0
    assert "through a thread relay" in report and alone["threads_stream_ratio_interval"]
    low, high = alone["stream_ratio_interval"]
    assert low <= high
    print(f"bench-quick took {results['seconds']['total']:.0f} s")


def test_the_added_p50_interval_holds_a_shift_and_only_it():
    from bench.engine_alone import added_interval

    alone = [0.010 + 0.00002 * n for n in range(50)]  # 10.00-10.98 ms
    # Every request 1 ms slower: whatever is resampled, the added p50 is about 1 ms.
    low, high = added_interval([t + 0.001 for t in alone], alone)
    assert 0.5 < low <= high < 1.5
    # The same requests both ways: 0 is inside, half a millisecond is not.
    low, high = added_interval(list(alone), alone)
    assert low < 0 < high < 0.5
    # Seeded: a run's figures repeat.
    assert added_interval(list(alone), alone) == (low, high)


def test_the_ratio_interval_keeps_each_rounds_pair_together():
    from bench.harness import paired_ratio, ratio_interval

    # The machine's speed moved round to round by far more than the 2% between the two
    # ways: resampled in pairs, each round's two figures together, the ratio stays at 0.98.
    alone = [50.0 + 10 * n for n in range(12)]
    assert paired_ratio([a * 0.98 for a in alone], alone) == pytest.approx(0.98)
    # Each round's own ratio (0.5, 0.96, 0.98), not the two medians' (49 / 50).
    assert paired_ratio([50.0, 48.0, 49.0], [100.0, 50.0, 50.0]) == pytest.approx(0.96)
    # A round without a figure (an answer without the engine's timings) is left out.
    assert paired_ratio([50.0, 48.0, 49.0], [0.0, 50.0, 50.0]) == pytest.approx(0.97)
    low, high = ratio_interval([a * 0.98 for a in alone], alone)
    assert 0.979 < low <= high < 0.981
    # The same figures, their order shuffled apart from their rounds: the spread shows.
    shuffled = [a * 0.98 for a in alone[6:] + alone[:6]]
    low, high = ratio_interval(shuffled, alone)
    assert low < 0.9 and high > 1.05
    assert ratio_interval(shuffled, alone) == (low, high)  # seeded: a run's figures repeat


# -- the soak ---------------------------------------------------------------------------------

from bench import soak  # noqa: E402


def test_a_short_soak_passes_under_every_fault(tmp_path):
    """The soak for 30 s, a fault every 8 s (four conversations, so the returns are few):
    each kind of fault was made, every API was answered, conversations were parked and came
    back, and the verdict passed. (Under load, the restart holds the other faults back.)
    The slow readers' answers are short here (the engine makes the soak's own 1,200
    logprob tokens in about 90 s a piece on this machine: longer than the run)."""
    plan = soak.Plan(minutes=0.5, fault_every_s=8, stop_s=2, conversations=4, slow_tokens=150)
    assert soak.main(plan, tmp_path, "pytest") == 0, (tmp_path / "soak.md").read_text()
    report = (tmp_path / "soak.md").read_text()
    assert "## Over time" in report and "Passed:" in report
    found = json.loads((tmp_path / "soak.json").read_text())
    kinds = [f["kind"] for f in found["faults"]]
    assert kinds.count("kill") >= 1 and kinds.count("stop") >= 1 and kinds.count("disk_full") >= 1, kinds
    assert kinds.count("restart") == 1, kinds
    # Every API was sent to; under the faults of so short a run, not each is answered there.
    assert {r["api"] for r in found["records"]} == set(soak.PATHS)
    assert any(r["outcome"] == "answered" and r["phase"] == "faults" for r in found["records"])
    answered = {r["api"] for r in found["records"] if r["outcome"] == "answered"}
    assert set(soak.CONVERSATION_APIS) <= answered, answered
    assert {r["pattern"] for r in found["records"]} == set(soak.PATTERNS)
    assert found["returns"]["parked"] >= 2 and len(found["returns"]["quiet"]) == found["returns"]["parked"]
    assert len(found["samples"]) >= 5 and all(s["rss_mib"] > 0 and s["fds"] > 0 for s in found["samples"])


def _clean_run() -> dict:
    """A soak's findings that pass: a kill from 10 to 12 s, one 502 under it."""
    records = [
        {"api": "chat", "stream": False, "pattern": "read_all", "began": 1.0, "ended": 1.5, "status": 200,
         "outcome": "answered", "detail": "", "state": "disk", "reused": 600, "read": 40, "held_before": 600,
         "phase": "faults"},
        {"api": "messages", "stream": False, "pattern": "read_all", "began": 10.5, "ended": 11.0, "status": 502,
         "outcome": "failed_in_shape", "detail": "HTTP 502", "state": None, "reused": None, "read": None,
         "held_before": 0, "phase": "faults"},
    ]
    back = {"name": "c", "api": "chat", "status": 200, "state": "disk", "held_before": 700, "reused": 699,
            "read": 40, "outcome": "answered"}
    samples = [{"at": float(t), "pid": 7, "rss_mib": 90.0, "fds": 30, "session_files": 3, "temporaries": 0,
                "disk_bytes": 1, "stats": None} for t in range(0, 61, 5)]
    return {"problems": [], "began": 0.0, "faults_over": 60.0, "plan": {"keep": 8},
            "faults": [{"kind": "kill", "began": 10.0, "ended": 12.0}], "records": records, "samples": samples,
            "returns": {"parked": 2, "conversations": 3, "first": [back, back], "quiet": [back, back]}}


def test_the_soak_verdict_fails_each_thing_it_requires():
    assert soak.judge(_clean_run()) == []
    broken = {
        "a 500": lambda f: f["records"][0].update(status=500, outcome="violation"),
        "a 502 with no fault under way": lambda f: f["records"][1].update(began=40.0, ended=40.5),
        "an error not in the API's shape": lambda f: f["records"][1].update(outcome="violation"),
        "a hang": lambda f: f["records"][0].update(ended=1.0 + soak.DEADLINE_S + 1),
        "refused with no restart": lambda f: f["records"][1].update(outcome="unreachable"),
        "a parked state lost": lambda f: f["returns"]["first"].__setitem__(0, {**f["returns"]["first"][0],
                                                                              "state": "none"}),
        "a parked file gone when its return was sent": lambda f: f["returns"]["first"].__setitem__(
            0, {**f["returns"]["first"][0], "state": "none", "had_file": False}),
        "a quiet return re-reading": lambda f: f["returns"]["quiet"].__setitem__(0, {**f["returns"]["quiet"][0],
                                                                                 "reused": 600}),
        "nothing parked": lambda f: f["returns"].update(parked=0, first=[], quiet=[]),
        "memory growing": lambda f: [s.update(rss_mib=90.0 + s["at"]) for s in f["samples"]],
        "open files growing": lambda f: [s.update(fds=30 + int(s["at"])) for s in f["samples"]],
        "files past keep": lambda f: f["samples"][3].update(session_files=10),
        "temporaries past one save's": lambda f: f["samples"][3].update(temporaries=3),
        "a temporary left": lambda f: [s.update(temporaries=1, temporary_names=["tmp-auto-a-1.json"])
                                       for s in f["samples"][3:5]],
    }
    for name, breaks in broken.items():
        found = _clean_run()
        breaks(found)
        assert soak.judge(found), name


def _one_shot_server(answer: bytes | None) -> tuple[socket.socket, threading.Thread]:
    """A loopback listener that takes one connection, reads the request, sends ``answer``
    (None: nothing) and resets the connection (SO_LINGER 0: a TCP RST, not a FIN)."""
    listener = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        conn, _ = listener.accept()
        conn.recv(65536)
        if answer is not None:
            conn.sendall(answer)
            time.sleep(0.2)
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        conn.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return listener, thread


def test_the_soak_tells_a_connection_reset_before_the_answer_from_one_cut_during_it():
    """Reset before the status line (a stopping server's backlog): unanswered, which only a
    restart excuses; reset once the answer began: a violation, whatever was under way."""
    for answer, expected, label in [
        (None, "unreachable", "dropped before the answer"),
        (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 500\r\n\r\n{\"id\"",
         "violation", "ChunkedEncodingError"),
    ]:
        listener, thread = _one_shot_server(answer)
        try:
            record = soak.Record("chat", False, "read_all", time.monotonic())
            url = f"http://127.0.0.1:{listener.getsockname()[1]}"
            soak.send(url, "chat", {"model": "m", "messages": [{"role": "user", "content": "hi"}]}, "read_all", record)
            thread.join(10)
        finally:
            listener.close()
        assert (record.outcome, record.detail.split(":")[0]) == (expected, label), record


class _Busy:
    """A server whose stats move for ``busy_s``, then stay still (or never stop, for ever)."""

    def __init__(self, busy_s: float) -> None:
        self.until = time.monotonic() + busy_s

    def stats(self) -> dict:
        moving = time.monotonic() < self.until
        return {"requests": time.monotonic_ns() if moving else 0, "plugins": {"auto_sessions": {"saves": 1}}}


def test_the_soak_lists_parked_files_only_once_the_server_has_settled(tmp_path, monkeypatch):
    """The list of parked files waits for the server's own work to stop (SETTLED_S still),
    not for a fixed time; a server that never settles is a problem named in the verdict."""
    from types import SimpleNamespace

    monkeypatch.setattr(soak, "SETTLED_S", 0.5)
    working = SimpleNamespace(server=_Busy(1.5), slot_dir=tmp_path, problems=[])
    began = time.monotonic()
    soak.Soak.settle(working)
    assert time.monotonic() - began >= 2.0 and working.problems == []

    monkeypatch.setattr(soak, "SETTLE_DEADLINE_S", 1.0)
    endless = SimpleNamespace(server=_Busy(3600), slot_dir=tmp_path, problems=[])
    soak.Soak.settle(endless)
    assert endless.problems and "still working" in endless.problems[0]


# -- the third-party agent benchmark and the bare engine it is compared with -------------------

from pathlib import Path  # noqa: E402

from bench import agent_sim  # noqa: E402
from bench.systems import System, bare_command  # noqa: E402


def test_the_bare_engine_of_the_comparisons_is_the_plain_one_slot_engine():
    """What a user runs bare: one slot of the whole context, no side slot over a shared pool
    (strata-serve's default gives the engine it starts one; the bare engine must not get it)."""
    command = bare_command(System("bare", "bare"), Path("m.gguf"), 8192, Path("slots"), [], Path("llama-server"), 1)
    assert command[command.index("-np") + 1] == "1" and command[command.index("-c") + 1] == "8192"
    assert "--kv-unified" not in command and "--kv-unified-per-slot" not in command
    off = bare_command(System("bare", "bare", cache_ram_mib=0), Path("m.gguf"), 8192, Path("slots"), [],
                       Path("llama-server"), 1)
    assert off[off.index("--cache-ram") + 1] == "0" and off[off.index("-np") + 1] == "1"


def _record(phase: str, step: int, reuse: float, **extra) -> dict:
    return {"session": 0, "phase": phase, "step": step, "reuse": reuse, "prompt": 1000, "cached": int(reuse * 1000),
            "error": None, "aborted": False, **extra}


def test_agent_sim_contexts_kept_are_counted_at_its_own_threshold():
    """A return that reused less than agent-sim's threshold lost its context; aborted and
    failed returns are not counted either way; a first main turn never returns."""
    records = [_record("main", 0, 0.0), _record("main", 1, 0.99), _record("main", 2, 0.1),
               _record("sub", 0, 0.0), _record("finalize", 0, 0.98), _record("finalize", 0, 0.65),
               _record("finalize", 0, 0.9, aborted=True), _record("finalize", 0, 0.0, error="HTTP 500")]
    assert agent_sim.kept(records) == (1, 2)
    assert agent_sim.continued(records) == (1, 2)


def test_agent_sim_ratios_pair_each_run_with_the_bare_run_of_its_round_and_ram_setting():
    runs = {"bare-default": [{"round": 0, "wall_s": 100.0}, {"round": 1, "wall_s": 200.0}],
            "strata-default": [{"round": 1, "wall_s": 180.0}, {"round": 0, "wall_s": 110.0}],
            "bare-off": [{"round": 0, "wall_s": 300.0}],
            "strata-off": [{"round": 0, "wall_s": 150.0}]}
    found = agent_sim.ratios(runs)
    assert found == {"strata-default": [0.9, 1.1], "strata-off": [0.5]}
    assert set(found) == {s.key for s in agent_sim.systems() if not s.key.startswith("bare")}
    table = "\n".join(agent_sim.report({"version": agent_sim.VERSION, "args": agent_sim.ARGS, "rounds": 2,
                                        "systems": {s.key: s.name for s in agent_sim.systems()},
                                        "runs": {k: [{**r, "kept": (3, 3), "continued": (6, 6),
                                                      "load_before": (1.0, 1.0, 1.0)} for r in v]
                                                 for k, v in runs.items()}, "ratios": found}))
    assert "| strata-serve, its defaults | 145.0 (110.0-180.0) | 1.000 (0.900-1.100) | 6/6 | 12/12 |" in table


# -- what each kind of Python server costs a short request ----------------------------------------

async def test_the_http_floor_bench_asks_every_way_in_turn(tmp_path):
    from bench import http_floor
    from strata_serve.models import packaged_model_path

    found = await http_floor.measure(Path(packaged_model_path("smollm2")), tmp_path, requests=2)
    ways = {"engine", "strata", *http_floor.RELAYS}
    for how in ("kept", "new"):
        assert set(found[how]["ms"]) == ways and all(len(t) == 2 and min(t) > 0 for t in found[how]["ms"].values())
        assert set(found[how]["cpu_ms"]) == ways - {"engine"}
    # Every relay ran on uvloop, as the table says.
    assert set(found["loops"]) == set(http_floor.RELAYS)
    assert all(loop.startswith("uvloop") for loop in found["loops"].values()), found["loops"]
    report = "\n".join(http_floor.report(found))
    for row in ("| strata-serve, its defaults |", "| app: aiohttp web.Application", "| proto: asyncio.Protocol",
                "| bytes: byte relay"):
        assert row in report
