"""llama-server's field names are read in its backend alone.

The core and the plugins read what an engine says through strata-serve's own types
(:class:`~strata_serve.SlotReport`, :class:`~strata_serve.SlotSaved`,
:class:`~strata_serve.SlotRestored`, :class:`~strata_serve.SlotErased`,
:class:`~strata_serve.Timings`), which each backend fills from its own answers: a second
engine never has to imitate llama-server's JSON.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BACKEND = ROOT / "strata_serve" / "engine" / "llama_server"
#: The fields of llama-server's answers that an engine's results are made of: ``GET /slots``,
#: the slot calls, the ``timings`` of an answer, ``GET /props``.
LLAMA_FIELDS = frozenset({
    "n_prompt_tokens", "is_processing", "id_task",
    "n_saved", "n_written", "n_restored", "n_read", "n_erased",
    "timings", "cache_n", "prompt_n", "predicted_n", "prompt_ms", "predicted_ms",
    "default_generation_settings", "total_slots", "build_info",
})
#: The core's code and every bundled plugin's (their tests talk to the engine on purpose).
SOURCES = sorted(
    path for pattern in ("strata_serve/**/*.py", "plugins/*/strata_*/**/*.py")
    for path in ROOT.glob(pattern) if BACKEND not in path.parents
)


def llama_fields_in(source: str) -> list[tuple[int, str]]:
    """``(line, field)`` for every string constant that names a llama-server field: the
    name itself (a key read or written) or, in bytes, the name in quotes (a marker looked
    for in the engine's raw answer). Prose (docstrings, help texts) is never equal to one."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Constant):
            continue
        if isinstance(node.value, str) and node.value in LLAMA_FIELDS:
            found.append((node.lineno, node.value))
        elif isinstance(node.value, bytes):
            found += [(node.lineno, name) for name in LLAMA_FIELDS if f'"{name}"'.encode() in node.value]
    return sorted(found)


def test_the_scan_finds_a_field_read_and_a_marker_and_leaves_prose_alone():
    source = ('"""The engine counts ``n_prompt_tokens``."""\n'
              'tokens = entry.get("n_prompt_tokens")\n'
              "markers = (b'\"timings\"', b'\"usage\"')\n")
    assert llama_fields_in(source) == [(2, "n_prompt_tokens"), (3, "timings")]


def test_the_scan_covers_the_core_and_the_plugins_but_not_the_backend():
    names = {path.relative_to(ROOT).as_posix() for path in SOURCES}
    assert {"strata_serve/service.py", "strata_serve/slot_state.py", "strata_serve/api/formats.py",
            "strata_serve/memory_engine.py", "plugins/auto_sessions/strata_auto_sessions/parking.py"} <= names
    assert not any(name.startswith("strata_serve/engine/llama_server/") for name in names)
    backend = (BACKEND / "answers.py").read_text()
    assert {field for _, field in llama_fields_in(backend)} >= {"n_prompt_tokens", "n_saved", "cache_n"}, \
        "the backend is where they are read"


def test_llama_server_field_names_stay_inside_its_backend():
    found = [f"{path.relative_to(ROOT)}:{line}: {field!r}"
             for path in SOURCES for line, field in llama_fields_in(path.read_text())]
    assert not found, ("llama-server's field names outside its backend (read the engine's results "
                       "through strata-serve's types instead):\n" + "\n".join(found))


def test_the_backend_reads_its_answers_into_the_cores_types():
    from strata_serve import ContextOverflow, SlotErased, SlotReport, SlotRestored, SlotSaved
    from strata_serve.engine.llama_server.answers import (read_overflow, slot_erased, slot_reports, slot_restored,
                                                          slot_saved)

    busy = {"id": 0, "id_task": 7, "n_prompt_tokens": 12, "is_processing": True, "n_ctx": 4096}
    assert slot_reports([busy, {"id": 1, "id_task": -1}, "junk", {"id": True}]) == [
        SlotReport(id=0, processing=True, task=7, tokens=12, raw=busy),
        SlotReport(id=1, task=-1, raw={"id": 1, "id_task": -1})], "a slot that never ran a task says no count"
    saved = {"id_slot": 0, "filename": "a.bin", "n_saved": 5, "n_written": 640}
    assert slot_saved(saved) == SlotSaved(tokens=5, bytes=640, raw=saved)
    assert slot_restored({"n_restored": 5, "n_read": 640}).bytes == 640
    assert isinstance(slot_restored({}), SlotRestored) and slot_erased({"n_erased": 5}) == SlotErased(5, {"n_erased": 5})
    overflow = {"type": "exceed_context_size_error", "n_prompt_tokens": 20000, "n_ctx": 4096}
    assert read_overflow(overflow) == ContextOverflow(prompt_tokens=20000, context_tokens=4096)
    assert read_overflow({**overflow, "n_ctx": 0}) == ContextOverflow(prompt_tokens=20000), "no size: none told"
    assert read_overflow({"type": "invalid_request_error"}) is None
