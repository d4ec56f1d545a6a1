"""strata-serve without its optional dependencies: the test kit without pytest-asyncio, the
server without gguf and numpy (the ``demo`` extra).

Each case runs in a fresh interpreter whose ``sitecustomize`` makes the named modules
impossible to import, as if they were not installed: the real console script and the
real pytest, with nothing else changed.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

BIN = Path(sys.executable).parent


def without(tmp_path: Path, *modules: str) -> dict[str, str]:
    """An environment in which ``modules`` (and their submodules) cannot be imported."""
    blocker = tmp_path / "blocker"
    blocker.mkdir(exist_ok=True)
    (blocker / "sitecustomize.py").write_text(textwrap.dedent(f"""
        import importlib.machinery
        import sys

        BLOCKED = {modules!r}

        class NotInstalled:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in BLOCKED:
                    raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
                return None

        sys.meta_path.insert(0, NotInstalled())

        # Finders put ahead of this one later (pytest's assertion rewriting) look modules
        # up through PathFinder themselves: it does not find the blocked ones either.
        _find_spec = importlib.machinery.PathFinder.find_spec.__func__

        def find_spec(cls, name, path=None, target=None):
            if name.split(".")[0] in BLOCKED:
                return None
            return _find_spec(cls, name, path, target)

        importlib.machinery.PathFinder.find_spec = classmethod(find_spec)
    """))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("STRATA_", "PYTEST_"))}
    env["PYTHONPATH"] = str(blocker)
    return env


def run(args: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(args, env=env, cwd=cwd, capture_output=True, text=True, timeout=120)


def test_the_blocker_blocks(tmp_path):
    done = run([sys.executable, "-c", "import pytest_asyncio"], without(tmp_path, "pytest_asyncio"), tmp_path)
    assert done.returncode == 1 and "ModuleNotFoundError" in done.stderr and "pytest_asyncio" in done.stderr


def test_the_test_kit_loads_in_a_pytest_run_without_pytest_asyncio(tmp_path):
    project = tmp_path / "project"
    project.mkdir()
    (project / "pytest.ini").write_text("[pytest]\n")  # an unrelated project: none of ours
    (project / "test_kit.py").write_text(textwrap.dedent("""
        import pytest

        from strata_serve.testing import chat_body


        def test_the_kit_is_here(pytestconfig):
            assert pytestconfig.pluginmanager.has_plugin("strata_serve")
            assert chat_body("hi")["messages"] == [{"role": "user", "content": "hi"}]
            with pytest.raises(ModuleNotFoundError):
                import pytest_asyncio  # noqa: F401
    """))
    # pytest-asyncio's own plugin, and pytest-aiohttp's that needs it, are what an
    # environment without it would not have: they are not loaded.
    pytest = [sys.executable, "-m", "pytest", "-p", "no:asyncio", "-p", "no:aiohttp", "-q"]
    done = run([*pytest, "test_kit.py"], without(tmp_path, "pytest_asyncio"), project)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "1 passed" in done.stdout and "Error while loading plugin" not in done.stdout + done.stderr
    fixtures = run([*pytest, "--fixtures", "test_kit.py"], without(tmp_path, "pytest_asyncio"), project)
    assert fixtures.returncode == 0, fixtures.stdout + fixtures.stderr
    assert "strata_client_factory" in fixtures.stdout and "strata_memory_client_factory" in fixtures.stdout


def test_the_server_imports_and_runs_without_gguf_and_numpy(tmp_path):
    env = without(tmp_path, "gguf", "numpy")
    code = ("import strata_serve, strata_serve.api.app, strata_serve.testing, sys; "
            "assert 'gguf' not in sys.modules and 'numpy' not in sys.modules; print('imported')")
    done = run([sys.executable, "-c", code], env, tmp_path)
    assert done.returncode == 0 and "imported" in done.stdout, done.stderr
    done = run([str(BIN / "strata-serve"), "run", "--help"], env, tmp_path)
    assert done.returncode == 0, done.stderr
    assert "Usage:" in done.stdout and "--model" in done.stdout


def test_demo_model_names_the_extra_to_install_without_gguf(tmp_path):
    done = run([str(BIN / "strata-serve"), "demo-model", str(tmp_path / "tiny.gguf")],
               without(tmp_path, "gguf", "numpy"), tmp_path)
    assert done.returncode == 1
    assert "pip install 'strata-serve[demo]'" in done.stderr and "gguf" in done.stderr
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "tiny.gguf").exists()
