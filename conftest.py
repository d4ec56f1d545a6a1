"""Project-wide test policy: a skipped test is a failure.

A skip here would mean the engine or a package is missing, which is a broken
set-up to fix, not a result to report as green.
"""

import pytest


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    skipped = reporter.stats.get("skipped", []) if reporter is not None else []
    if skipped and session.exitstatus == 0:
        reporter.write_line(f"[strata] {len(skipped)} test(s) skipped: treated as a failure", red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
