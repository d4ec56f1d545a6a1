"""The plugin API is what ``strata_serve`` exports; bundled plugins use nothing else."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import strata_serve

ROOT = Path(__file__).resolve().parent.parent
#: The code of every bundled and example plugin (their tests may use the test kit).
PLUGIN_SOURCES = sorted(p for pattern in ("plugins/*/strata_*/**/*.py", "examples/*/strata_*/**/*.py")
                        for p in ROOT.glob(pattern))


def core_imports(path: Path) -> list[str]:
    """Modules of strata_serve other than the package itself that ``path`` imports."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            continue
        found += [name for name in names if name.startswith("strata_serve.")]
    return found


def test_there_are_plugin_sources():
    assert len(PLUGIN_SOURCES) >= 8


@pytest.mark.parametrize("path", PLUGIN_SOURCES, ids=[str(p.relative_to(ROOT)) for p in PLUGIN_SOURCES])
def test_bundled_plugins_import_only_the_public_api(path):
    assert core_imports(path) == [], f"{path.relative_to(ROOT)}: import these from strata_serve itself"


@pytest.mark.parametrize("name", strata_serve.__all__)
def test_every_exported_name_resolves(name):
    assert getattr(strata_serve, name) is not None
    assert name in dir(strata_serve)


def test_an_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'nothing_here'"):
        strata_serve.nothing_here  # noqa: B018
