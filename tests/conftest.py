"""Shared helpers for the framework's own tests."""

from __future__ import annotations

import pytest

import strata_serve


class Recorder:
    """A throwaway plugin that writes down every hook call it sees."""

    strata_name = "recorder"

    def __init__(self) -> None:
        self.events: list[tuple] = []
        self.outcomes = []
        self.active = 0
        self.max_active = 0

    @property
    def keys(self) -> list:
        """The conversation key of each request, in the order they reached the engine."""
        return [event[2] for event in self.events if event[0] == "pre"]

    @strata_serve.hookimpl
    def pre_request(self, request):
        self.active += 1
        self.max_active = max(self.max_active, self.active)
        self.events.append(("pre", request.id, request.conversation_key))

    @strata_serve.hookimpl
    async def post_request(self, request, outcome):
        self.events.append(("post", request.id, outcome.status))
        self.outcomes.append(outcome)
        self.active -= 1

    @strata_serve.hookimpl
    def pre_slot_action(self, slot, action, service):
        self.events.append(("pre_slot_action", slot, action, service.fifo.slot_free(slot)))

    @strata_serve.hookimpl
    def post_slot_action(self, slot, action, service):
        self.events.append(("post_slot_action", slot, action, service.slots[slot].tokens))

    @strata_serve.hookimpl
    async def on_startup(self, service):
        self.events.append(("startup", await service.engine.health()))

    @strata_serve.hookimpl
    def collect_stats(self):
        return {"requests": len(self.outcomes)}

    @strata_serve.hookimpl
    def on_engine_start(self, restarted):
        self.events.append(("engine_start", restarted))

    @strata_serve.hookimpl
    async def on_shutdown(self, service):
        self.events.append(("shutdown", await service.engine.health(), service.fifo.holders))


@pytest.fixture
def recorder() -> Recorder:
    return Recorder()
