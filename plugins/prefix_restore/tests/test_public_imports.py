"""prefix-restore uses auto-sessions through its published API alone: what the
``auto_sessions_fallback`` hook passes, and the names ``strata_auto_sessions`` exports."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import strata_auto_sessions

PLUGIN = Path(__file__).resolve().parent.parent
SOURCES = sorted(PLUGIN.glob("strata_prefix_restore/**/*.py")) + sorted(PLUGIN.glob("tests/*.py"))


def auto_sessions_uses(path: Path) -> list[str]:
    """What ``path`` takes from auto-sessions: ``module:name`` of each import from it, and
    ``strata_auto_sessions.<name>`` of each attribute read off the package."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("strata_auto_sessions"):
            found += [f"{node.module}:{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Import):
            found += [f"{alias.name}:" for alias in node.names
                      if alias.name.startswith("strata_auto_sessions.")]
        elif (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
              and node.value.id == "strata_auto_sessions" and not node.attr.startswith("__")):
            found.append(f"strata_auto_sessions:{node.attr}")
    return found


def test_there_are_sources():
    assert PLUGIN / "strata_prefix_restore" / "__init__.py" in SOURCES


@pytest.mark.parametrize("path", SOURCES, ids=[str(p.relative_to(PLUGIN)) for p in SOURCES])
def test_prefix_restore_takes_only_what_auto_sessions_exports(path):
    public = {f"strata_auto_sessions:{name}" for name in strata_auto_sessions.__all__}
    private = [use for use in auto_sessions_uses(path) if use not in public]
    assert private == [], f"{path.relative_to(PLUGIN)}: use only names in strata_auto_sessions.__all__"


def test_the_hook_gives_what_a_fallback_compares():
    """A parked conversation tells how much of its opening it shares with the incoming one."""
    opening = [{"role": "system", "content": "S"}, {"role": "user", "content": "q1"}]
    mine = strata_auto_sessions.message_chain({}, opening + [{"role": "user", "content": "q2"}])
    theirs = strata_auto_sessions.message_chain({}, opening + [{"role": "user", "content": "other"}])
    parked = strata_auto_sessions.ParkedConversation(key="a", tokens=30, bytes=1, last_used=0, **theirs)
    assert parked.shared_links(mine["chain"]) == 2
    assert parked.shared_links(theirs["chain"]) == 3
    assert parked.shared_links([]) == 0
