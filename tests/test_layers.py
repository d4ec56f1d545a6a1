"""The core's map holds: no import circle, and each piece of shared state has one writer.

The layers themselves are import-linter's contracts (pyproject.toml, ``make lint``); here
the whole graph of ``strata_serve``'s imports, those made for type checking and inside
functions included, is read from the source and must have no circle, and the writers of
the slot registry and of a request's placement and key are the ones their modules name.
"""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
CORE = ROOT / "strata_serve"
#: Code that runs in the server: the core and the bundled plugins (not their tests).
SERVED = [CORE, *sorted(ROOT.glob("plugins/*/strata_*")), *sorted(ROOT.glob("examples/*/strata_*"))]

#: The service's modules: its request path and its slot calls.
SERVICE = {"strata_serve/service.py", "strata_serve/slot_calls.py"}
#: SlotRegistry's recording methods: the service's alone (slot_state.py says so); and
#: EngineMeasures' (measures.py says so).
REGISTRY_RECORDS = {"engine_started", "sent", "finished", "untouched", "saved", "restored", "moved", "emptied",
                    "unknown", "located", "adopt_engine_counts"}
MEASURES_RECORDS = {"answered", "state_file"}
#: A request's fields and the only modules that set them (hook_types.py says so).
REQUEST_WRITERS = {
    "slot": {"strata_serve/service.py"},
    "pinned": {"strata_serve/service.py"},
    "conversation_named": {"strata_serve/service.py"},
    "conversation_key": {"strata_serve/api/relay.py"},
    "found_in_slot": {"strata_serve/service.py"},
    "state_source": {"strata_serve/service.py"},
    "restored_tokens": {"strata_serve/slot_calls.py"},
    "_tokens": {"strata_serve/tokens_ahead.py"},
}


#: auto-sessions' package: its steps (saving, restoring, pruning...) are given the parts
#: they work with (``parts.py``), never the plugin's object (``parking.py``).
AUTO_SESSIONS = ROOT / "plugins" / "auto_sessions" / "strata_auto_sessions"


def _modules(package: pathlib.Path = CORE) -> dict[str, pathlib.Path]:
    modules = {}
    for path in package.rglob("*.py"):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def _imports(name: str, path: pathlib.Path, known: set[str]) -> set[str]:
    """Every module of the core ``name`` imports, wherever the import statement is."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*parent, base] if base else parent)
            # ``from package import module`` imports the module; ``from module import name``, the module.
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in graph[node]:
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return circles


def test_the_core_has_no_import_circle_not_even_one_made_for_type_checking():
    modules = _modules()
    graph = {name: _imports(name, path, set(modules)) for name, path in modules.items()}
    assert graph["strata_serve.hook_types"], "the graph was read"
    assert _circles(graph) == []


def test_auto_sessions_has_no_import_circle_and_no_step_takes_the_plugin_object_back():
    """Before, its steps took the plugin's object (``AutoSessions``) back as their first
    argument: seven modules in one circle (fallback, idle, parking, pruning, restoring,
    saving, shared.sync), closed by imports made for type checking."""
    modules = _modules(AUTO_SESSIONS)
    graph = {name: _imports(name, path, set(modules)) for name, path in modules.items()}
    assert graph["strata_auto_sessions.saving"], "the graph was read"
    assert _circles(graph) == []
    takers = sorted(name for name, imported in graph.items() if "strata_auto_sessions.parking" in imported)
    assert takers == ["strata_auto_sessions"], takers  # the plugin's hooks, which hold it


def test_the_circle_finder_finds_a_circle():
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def _served_files() -> list[pathlib.Path]:
    return [path for root in SERVED for path in root.rglob("*.py") if "tests" not in path.parts]


def _writes(path: pathlib.Path) -> list[tuple[str, str, int]]:
    """(what, name, line) for each call of a registry's recording method and each assignment
    to a request's field in ``path``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr in REGISTRY_RECORDS and isinstance(node.func.value, ast.Attribute | ast.Name)
                and (node.func.value.attr if isinstance(node.func.value, ast.Attribute) else node.func.value.id)
                == "slots"):
            found.append(("registry", node.func.attr, node.lineno))
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr in MEASURES_RECORDS and isinstance(node.func.value, ast.Attribute)
                and node.func.value.attr == "measures"):
            found.append(("measures", node.func.attr, node.lineno))
        targets = node.targets if isinstance(node, ast.Assign) else (
            [node.target] if isinstance(node, ast.AugAssign | ast.AnnAssign) else [])
        for target in targets:
            if (isinstance(target, ast.Attribute) and target.attr in REQUEST_WRITERS
                    and isinstance(target.value, ast.Name) and "request" in target.value.id):
                found.append(("request", target.attr, target.lineno))
    return found


def test_the_service_alone_records_in_the_slot_registry_and_the_measures_and_places_a_request():
    wrong = []
    for path in _served_files():
        where = path.relative_to(ROOT).as_posix()
        for what, name, line in _writes(path):
            allowed = REQUEST_WRITERS[name] if what == "request" else SERVICE
            if where not in allowed:
                wrong.append(f"{where}:{line}: {what} {name}")
    assert wrong == []


def test_the_writer_check_sees_a_plugin_writing(tmp_path):
    plugin = tmp_path / "plugin.py"
    plugin.write_text("def pre_request(request, service):\n"
                      "    service.slots.emptied(request.slot)\n"
                      "    request.conversation_named = True\n"
                      "    service.measures.answered(None)\n")
    assert sorted(_writes(plugin), key=lambda write: write[2]) == [("registry", "emptied", 2),
                                                                   ("request", "conversation_named", 3),
                                                                   ("measures", "answered", 4)]
