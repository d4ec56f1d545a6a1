"""Meta-tests: every hook documented and tested, the docs in step with the code."""

import inspect
import re
import sys
from pathlib import Path

import pytest

from strata_serve import hookspecs
from strata_serve.config import EngineSettings, ServerSettings

ROOT = Path(__file__).resolve().parent.parent
HOOKS = [
    (name, fn) for name, fn in vars(hookspecs).items()
    if inspect.isfunction(fn) and hasattr(fn, "strata_serve_spec")
]
GUIDE = (ROOT / "docs" / "writing-plugins.md").read_text()
README = (ROOT / "README.md").read_text()


def test_there_are_hooks():
    assert {name for name, _ in HOOKS} >= {
        "on_config", "pre_request", "post_request", "on_shutdown", "conversation_key",
        "engine_verdict", "register_routes",
    }


@pytest.mark.parametrize("name, spec", HOOKS, ids=[name for name, _ in HOOKS])
def test_hook_documented_in_hookspecs(name, spec):
    doc = inspect.getdoc(spec)
    assert doc and len(doc.splitlines()[0]) > 10, f"{name} needs a summary line"
    for arg in inspect.signature(spec).parameters:
        assert f":param {arg}:" in doc, f"{name}: document {arg}"
    if spec.strata_serve_spec["firstresult"]:
        assert "Stops at the first non-None result; return None to defer." in doc


@pytest.mark.parametrize("name, spec", HOOKS, ids=[name for name, _ in HOOKS])
def test_hook_documented_in_the_guide_by_signature(name, spec):
    signature = f"{name}({', '.join(inspect.signature(spec).parameters)})"
    assert f"### `{signature}`" in GUIDE, f"docs/writing-plugins.md needs a section for {signature}"


@pytest.mark.parametrize("name, spec", HOOKS, ids=[name for name, _ in HOOKS])
def test_hook_has_an_implementation_under_test(name, spec):
    test_files = list((ROOT / "tests").glob("**/*.py")) + list((ROOT / "plugins").glob("*/tests/**/*.py"))
    test_files += list((ROOT / "docs" / "examples").glob("*.py"))  # run by test_doc_examples.py
    pattern = re.compile(rf"^\s*(async )?def {name}\(", re.M)
    assert any(pattern.search(f.read_text()) for f in test_files), f"no test implements {name}"


def test_guide_examples_are_the_tested_files():
    sys.path.insert(0, str(ROOT / "docs"))
    try:
        import sync_examples
    finally:
        sys.path.pop(0)
    assert sync_examples.main(["--check"]) == 0, "run: python docs/sync_examples.py"


@pytest.mark.parametrize("section, model", [("server", ServerSettings), ("engine", EngineSettings)])
def test_readme_configuration_table_covers_every_setting(section, model):
    for field in model.model_fields:
        assert f"| `{section}.{field}` |" in README, f"README: document {section}.{field}"


async def test_readme_python_example_runs(strata_client_factory, capsys):
    client = await strata_client_factory()
    code = re.search(r"```python\n(.*?)```", README, re.S).group(1)
    code = code.replace("http://127.0.0.1:8080/v1", str(client.make_url("/v1")))
    import asyncio

    # The example is synchronous (the plain OpenAI client): run it off the event loop.
    await asyncio.to_thread(exec, compile(code, "README.md", "exec"), {})
    out = capsys.readouterr().out
    assert "cache_n" in out and "prompt_n" in out
