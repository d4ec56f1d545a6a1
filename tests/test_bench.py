"""The quick benchmark runs end to end, so the benchmarks never rot (figures are not asserted)."""


from bench.run import main


async def test_quick_benchmark_writes_its_tables(tmp_path):
    await main(quick=True, out=tmp_path)
    report = (tmp_path / "README.md").read_text()
    for heading in ("Engine start", "What the layer costs", "Switching back", "save and restore throughput"):
        assert heading in report
    assert "strata + auto-sessions, RAM cache off" in report
    assert (tmp_path / "results.json").stat().st_size > 100
