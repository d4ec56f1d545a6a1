"""auto-sessions' parts on their own: what a park comes to, the mode, and how the slot
picture is written. On the in-memory engine double, in milliseconds."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import strata_auto_sessions
from strata_auto_sessions import Parked, ParkingMode
from strata_auto_sessions.mode import ParkingStatus
from strata_serve import EngineError
from strata_serve.api import SERVICE
from strata_serve.slot_state import SlotRegistry, SlotState
from strata_serve.testing import conversation


def body(messages):
    return {"messages": messages, "max_tokens": 3, "temperature": 0}


async def test_parking_a_slot_says_what_came_of_it(strata_memory_client_factory, strata_settings_factory,
                                                   monkeypatch):
    settings = strata_settings_factory(plugins={"auto_sessions": {"min_tokens": 100}})
    client = await strata_memory_client_factory(strata_auto_sessions, settings=settings)
    service = client.app[SERVICE]
    parking = service.state["auto_sessions"]
    assert (await client.post("/v1/chat/completions", json=body(conversation("part-a")))).status == 200

    assert await parking.park_slot(service, 0, reason="test") is Parked.SAVED
    assert await parking.park_slot(service, 0, reason="test") is Parked.ALREADY_CURRENT
    assert parking.stats.saves == 1 and parking.stats.save_skips_unchanged == 1

    assert (await client.post("/v1/chat/completions", json=body(conversation("part-b")))).status == 200

    async def refused(filename, slot=0):
        raise EngineError(op="save", message="no room")

    monkeypatch.setattr(service.engine, "save", refused)
    parked = await parking.park_slot(service, 0, reason="test")
    assert parked is Parked.ONLY_IN_SLOT and not parked.on_file and parking.stats.save_failures == 1

    await service.erase_slot(0)
    assert await parking.park_slot(service, 0, reason="test") is Parked.NOTHING_TO_KEEP


def test_the_mode_is_one_answer(monkeypatch):
    now = [1000.0]
    monkeypatch.setattr("strata_auto_sessions.mode.time.monotonic", lambda: now[0])
    status = ParkingStatus()
    assert status.mode is ParkingMode.ON and status.mode.parks

    status.judge("a sliding window without --swa-full")
    assert status.mode is ParkingMode.NOT_SAVING and status.mode.parks, "restores are still tried, and refused"

    status.pause(60, "restores went unused")
    assert status.mode is ParkingMode.PAUSED and not status.mode.parks
    now[0] += 61
    assert status.mode is ParkingMode.NOT_SAVING, "the pause ended; the engine's judgment stands"

    status.judge(None)
    status.pause(60, "restores went unused")
    status.stop("the engine cannot save slots")
    assert status.mode is ParkingMode.OFF
    now[0] += 61
    assert status.mode is ParkingMode.OFF and not status.mode.parks, "a stop is for good"


def test_a_file_is_current_only_while_the_slot_holds_its_conversation():
    picture = SlotRegistry([SlotState(0, key="a", tokens=10)])
    picture.file_written(0, "b")
    assert not picture[0].file_current, "the slot holds another conversation now"
    picture.file_written(0, "a")
    assert picture[0].file_current
    picture.file_gone(0)
    assert not picture[0].file_current


@pytest.mark.parametrize("module", sorted(Path(strata_auto_sessions.__file__).parent.glob("*.py")),
                         ids=lambda path: path.name)
def test_auto_sessions_writes_the_slot_picture_only_through_its_methods(module):
    """No assignment to a field of a slot's record anywhere in auto-sessions: the core's
    named methods (``saved``, ``emptied``, ``file_written``, ...) write it."""
    fields = set(SlotState.__dataclass_fields__)
    writes = []
    for node in ast.walk(ast.parse(module.read_text())):
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
        for target in targets:
            for part in ast.walk(target):
                if isinstance(part, ast.Attribute) and part.attr in fields and isinstance(part.ctx, ast.Store):
                    writes.append(f"line {part.lineno}: .{part.attr}")
    assert not writes, writes
