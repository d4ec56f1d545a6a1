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


def test_the_tenant_format_is_the_cores_to_read():
    key = strata_serve.tenant_key("alice", "3f2a")
    assert key == "alice--3f2a" and strata_serve.tenant_of(key) == "alice"
    assert strata_serve.tenant_key(None, "3f2a") == "3f2a" and strata_serve.tenant_of("3f2a") is None
    assert strata_serve.in_tenant(key, "alice") and not strata_serve.in_tenant(key, "bob")
    assert not strata_serve.in_tenant(key, None) and strata_serve.in_tenant("3f2a", None)
    assert not strata_serve.in_tenant("alicex--3f2a", "alice"), "a tenant name is matched whole"


async def test_the_core_names_a_tenants_conversation_with_tenant_key(strata_memory_client_factory,
                                                                   strata_settings_factory):
    from strata_serve.api import SERVICE
    from strata_serve.testing import chat_body

    settings = strata_settings_factory(server={"api_keys": {"alice": "key-of-alice"}})
    client = await strata_memory_client_factory(settings=settings)
    resp = await client.post("/v1/chat/completions", json=chat_body("tenant format"),
                             headers={"Authorization": "Bearer key-of-alice"})
    assert resp.status == 200, await resp.text()
    key = resp.headers["X-Strata-Conversation"]
    assert strata_serve.tenant_of(key) == "alice"
    assert client.app[SERVICE].slots[0].key == key
    plain = strata_serve.StrataRequest(route="chat", body=chat_body("tenant format"))
    assert key == strata_serve.tenant_key("alice", client.app[SERVICE].conversation_key(plain))




def test_no_bundled_plugin_rebuilds_the_tenant_format():
    """A ``--`` in a plugin's string (other than a command-line option) is the tenant format rebuilt."""
    import re

    from strata_serve.tenants import TENANT_SEPARATOR

    separator = re.compile(re.escape(TENANT_SEPARATOR) + "(?![a-z])")
    found = set()
    for path in PLUGIN_SOURCES:
        tree = ast.parse(path.read_text())
        docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                      if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                      and node.body and isinstance(node.body[0], ast.Expr)}
        for node in ast.walk(tree):
            if (isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings
                    and separator.search(node.value)):
                found.add(str(path.relative_to(ROOT)))
    assert found == set(), "use strata_serve.tenant_key, tenant_of or in_tenant"
