"""Project-wide test policy: a skipped test is a failure; the test-only plugins are loaded.

A skip here would mean the engine or a package is missing, which is a broken
set-up to fix, not a result to report as green.

The plugins only the tests load (the example plugins in ``examples/``: a keying plugin,
and quirks_strata_metal for an engine no backend here drives) are installed by the test set-up (make's
``.venv/.examples``) into a site directory of their own beside the venv's
site-packages, not into it: a plain ``strata-serve run`` never finds them. The tests
add that directory here, entry points included.

Every engine a test starts runs one thread (``LLAMA_ARG_THREADS``, read by llama-server;
a test's own setting wins). The test models are tiny, so one thread makes them hardly
slower, and ``make test``'s two worker processes then share two cores; with an engine
thread per core in each, the engines' waiting threads spin against each other and the
suite runs slower in two processes than in one.

``STRATA_TEST_EVENT_LOOP=uvloop`` runs the async tests, and the servers they run in their
own process, on uvloop, the loop ``strata-serve run`` uses by default. ``make test`` runs
its main suite on asyncio's own loop and its other Pythons' subset on uvloop, so the
server's code runs under both in the tests' own process (a server a test starts as a
process of its own takes the default).
"""

import os
import site
import sys
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("LLAMA_ARG_THREADS", "1")

TEST_PLUGINS = Path(sys.prefix) / "test-plugins"
if TEST_PLUGINS.is_dir():
    site.addsitedir(str(TEST_PLUGINS))


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    skipped = reporter.stats.get("skipped", []) if reporter is not None else []
    if skipped and session.exitstatus == 0:
        reporter.write_line(f"[strata] {len(skipped)} test(s) skipped: treated as a failure", red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


_TEST_LOOP = os.environ.get("STRATA_TEST_EVENT_LOOP", "asyncio")
if _TEST_LOOP not in ("asyncio", "uvloop"):
    raise pytest.UsageError(f"STRATA_TEST_EVENT_LOOP={_TEST_LOOP!r}: asyncio or uvloop")
if _TEST_LOOP == "uvloop":

    def pytest_asyncio_loop_factories(config: pytest.Config, item: pytest.Item) -> dict[str, Any]:
        """Every async test, and the async fixtures it uses, on a loop of uvloop's."""
        import uvloop

        return {"uvloop": uvloop.new_event_loop}
