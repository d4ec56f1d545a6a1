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


def test_every_hook_has_a_scenario_that_reaches_it():
    from tests.hook_scenarios import SCENARIOS

    assert set(SCENARIOS) == {name for name, _ in HOOKS}, "tests/hook_scenarios.py: one scenario per hook"


@pytest.mark.parametrize("name, spec", HOOKS, ids=[name for name, _ in HOOKS])
async def test_hook_is_called_with_every_documented_argument(name, spec, strata_client_factory,
                                                             strata_memory_client_factory,
                                                             strata_settings_factory, recorder):
    # A real run of the server, not a search of the test files: the hook must be reached,
    # and an implementation that asks for every documented argument must get them all
    # (one the core forgot would make the call fail, and the call would not be recorded).
    from tests.hook_scenarios import SCENARIOS, Env, client_factory_for, hook_plugin

    plugin = hook_plugin(name, lambda **arguments: None)
    factory = client_factory_for(name, strata_client_factory, strata_memory_client_factory)
    await SCENARIOS[name](Env(factory, strata_settings_factory, recorder), plugin)
    assert plugin.calls, f"{name} was never called"
    documented = list(inspect.signature(spec).parameters)
    for arguments in plugin.calls:
        assert list(arguments) == documented
    required = {"settings", "service", "request", "outcome", "engine", "op", "restarted"}
    for argument in required & set(documented):
        assert all(arguments[argument] is not None for arguments in plugin.calls), argument


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


def test_the_readmes_figures_are_those_of_the_committed_results():
    """The README quotes the paragraphs bench/results/README.md wrote from its run's figures,
    word for word; a new run without a new quote fails here."""
    import re

    results = (ROOT / "bench" / "results" / "README.md").read_text()
    section = results.split("## What the project README says", 1)[1]
    quoted = [line[2:] for line in section.splitlines() if line.startswith("> ") and len(line) > 2]
    assert len(quoted) >= 3, "the switch-back, agents and layer-cost paragraphs"
    readme = " ".join(README.split())
    for paragraph in quoted:
        assert " ".join(paragraph.split()) in readme, paragraph
    # The figures in them are the tables': the largest switch-back row, as printed there.
    rows = re.findall(r"^\| (\d+) \| ([^|]+?) \| [^|]+ \| ([\d.]+) \([^|]*\) \| ([\d.]+)x faster \|", results, re.M)
    largest = max(int(size) for size, *_ in rows)
    by_setup = {setup: seconds for size, setup, seconds, _ in rows if int(size) == largest}
    assert f"RAM cache off {by_setup['llama-server, RAM cache off']} s (a full re-read)" in quoted[0]
    assert f"with auto-sessions, {by_setup['strata + auto-sessions, RAM cache off']} s" in quoted[0]


#: A test docs/reliability.md names: ``path::name`` (``…::name``: the file named before it).
RELIABILITY_REF = re.compile(r"`((?:[\w./-]+\.py|…)::[\w\[\]\- .,=]+?)`")


def test_every_test_reliability_md_names_exists_where_it_says():
    """Each claim of docs/reliability.md names the tests that show it: each name must be a
    test of the file it is given in (``…`` stands for the file named just before), so a
    test renamed or moved leaves no claim pointing at nothing."""
    text = (ROOT / "docs" / "reliability.md").read_text()
    current, named, missing = None, 0, []
    for ref in RELIABILITY_REF.findall(text):
        path, name = ref.split("::", 1)
        current = current if path == "…" else path
        name = name.split("[")[0]
        named += 1
        source = ROOT / current if current else None
        if source is None or not source.is_file() or not re.search(rf"def {re.escape(name)}\b", source.read_text()):
            missing.append(f"{current}::{name}")
    assert named > 200, f"only {named} tests named: the pattern no longer reads the table"
    assert not missing, missing
