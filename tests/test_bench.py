"""The quick benchmark runs end to end, so the benchmarks never rot (times are not asserted).

What is asserted is what does not depend on the machine: the tables are there, every system
of the agent comparison ran (hearth-llm too, when installed), the engine's own token counts
say the bare engine re-read its contexts after the restart while strata-serve with
auto-sessions restored them, and only the systems that park write to disk.
"""

import json

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
    print(f"bench-quick took {results['seconds']['total']:.0f} s")
