"""The quick benchmark runs end to end, so the benchmarks never rot (figures are not asserted)."""


from bench.run import main


async def test_quick_benchmark_writes_its_tables(tmp_path):
    await main(quick=True, out=tmp_path)
    report = (tmp_path / "README.md").read_text()
    for heading in ("Engine start", "What the layer costs", "Switching back", "save and restore throughput",
                    "Concurrent agents"):
        assert heading in report
    assert "strata + auto-sessions, RAM cache off" in report
    import json

    agents = json.loads((tmp_path / "results.json").read_text())["agents"]
    for ram in ("off", "limited", "default"):
        parked = agents[f"strata + auto-sessions, RAM cache {ram}"]
        assert parked["returns"] == 3 and parked["reread"] == 0, (ram, parked)
    assert (tmp_path / "results.json").stat().st_size > 100
