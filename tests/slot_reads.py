"""How much of its prompt the engine read for each request, counted in the slot it ran in.

The engine-wide counter (``/metrics`` ``prompt_tokens_total``) mixes the slots: a request
that ran beside another cannot be told apart from it. ``GET /slots`` has per-slot counts
(``n_prompt_tokens_processed``, ``n_prompt_tokens_cache``) only while a task runs: the
engine resets them when the task ends (measured), and a client that left early leaves no
timings either. What stays is the slot's last task (``id_task``) and the engine's own
log, which at verbosity 4 (``-lv 4``) says for each task as it starts, per slot, how
many tokens its prompt has and how many of them the slot already held:

    slot   operator(): id  0 | task 5 | new prompt, n_ctx_slot = 2048, n_keep = 0, task.n_tokens = 770
    slot   operator(): id  0 | task 5 | cached n_tokens = 744, memory_seq_rm [744, end)

and when it ends (``release: ... | task 5 | stop processing``). A request holds its slot
from ``pre_request`` to ``post_request``, so a task that is the slot's (current or last)
at the end and was not at the start is the request's own, whatever ran in the other
slots meanwhile.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from dataclasses import dataclass
from typing import Any

import pytest

import strata_serve
from strata_serve import SlotReport

#: The engine's flags for its per-task lines.
ENGINE_ARGS = ["-lv", "4"]
ENGINE_LOGGER = "strata_serve.engine.output"
_LINE = re.compile(r"\bid +(?P<slot>\d+) \| task (?P<task>\d+) \| (?:new prompt, .*task\.n_tokens = (?P<prompt>\d+)"
                   r"|cached n_tokens = (?P<cached>\d+)|(?P<end>stop processing))")


@dataclass
class Read:
    #: The request's conversation key, the slot it ran in, its id (in arrival order).
    key: str
    slot: int
    request: int
    #: The engine's task (None: the request never reached the engine's slot).
    task: int | None
    #: Prompt tokens the engine read for it (None: the engine's log said nothing of its
    #: task), and those it took from what the slot held (or had restored into it).
    tokens: int | None
    cached: int


async def slot_entry(service: strata_serve.Service, slot: int) -> SlotReport:
    return next(report for report in await service.engine.slots() if report.id == slot)


class SlotReads:
    """Test plugin: each keyed request's read, by the engine's account for its own slot.

    ``SlotReads(caplog)``; the engine must run with :data:`ENGINE_ARGS`. Registered, it
    writes a :class:`Read` for every request with a conversation key that got a slot.
    """

    strata_name = "slot_reads"

    def __init__(self, caplog: pytest.LogCaptureFixture) -> None:
        caplog.set_level(logging.DEBUG, logger=ENGINE_LOGGER)
        self.caplog = caplog
        self.reads: list[Read] = []
        self._last_task: dict[int, Any] = {}

    def _task_lines(self, slot: int, task: int) -> dict[str, int]:
        found: dict[str, int] = {}
        for record in self.caplog.records:
            if record.name != ENGINE_LOGGER:
                continue
            match = _LINE.search(record.getMessage())
            if match and int(match["slot"]) == slot and int(match["task"]) == task:
                for field in ("prompt", "cached", "end"):
                    # The first of each: a prompt read in several batches (the engine fills
                    # one batch from every slot's work) gets a "cached" line per batch,
                    # each with what the slot holds by then; the first says what it held.
                    if match[field] is not None and field not in found:
                        found[field] = int(match[field]) if field != "end" else 1
        return found

    @strata_serve.hookimpl(trylast=True)
    async def pre_request(self, request, service):
        # After every other plugin's steps (auto-sessions' save and restore of this slot).
        if request.conversation_key is not None:
            self._last_task[request.id] = (await slot_entry(service, request.slot)).task

    @strata_serve.hookimpl(tryfirst=True)
    async def post_request(self, request, outcome, service):
        if request.id not in self._last_task:
            return
        before = self._last_task.pop(request.id)
        # The task's prompt lines come as its prompt is read: a task the engine still runs
        # (its client left, the engine has not noticed yet) is counted without waiting for
        # its end. A request whose task never started leaves the slot's last task as it was;
        # one that was sent and cut before the engine began it may still start (the engine
        # takes it from its queue after the client left): it is given a few seconds.
        deadline = time.monotonic() + 30
        # (The core's picture says so: what the slot holds is not known.)
        cut = outcome.status == "cancelled" and service.slots[request.slot].tokens is None
        may_start = time.monotonic() + (5 if cut else 0)
        while True:
            entry = await slot_entry(service, request.slot)
            task = entry.task
            lines = self._task_lines(request.slot, task) if task is not None and task != before else {}
            if "cached" in lines or "end" in lines:
                break
            if not entry.processing and task == before and time.monotonic() >= may_start:
                break
            if time.monotonic() >= deadline:
                break  # no word from the engine on this task: unmeasured (None)
            if service.closing:
                # The server stops (a test's end: the log capture may be gone already, and
                # its lines would never come): unmeasured, and the stop does not wait.
                break
            await asyncio.sleep(0.01)
        prompt, cached = lines.get("prompt"), lines.get("cached", 0)
        if task == before:
            task, tokens = None, 0
        else:
            tokens = prompt - cached if prompt is not None else (0 if "end" in lines else None)
        self.reads.append(Read(key=request.conversation_key, slot=request.slot, request=request.id, task=task,
                               tokens=tokens, cached=cached))

    def of(self, key: str) -> list[Read]:
        return sorted((read for read in self.reads if read.key == key), key=lambda read: read.request)

    def rereads(self, opening: int) -> dict[str, list[Read]]:
        """Per conversation, its requests that read at least ``opening`` tokens after its first such."""
        whole: dict[str, list[Read]] = {}
        for read in sorted(self.reads, key=lambda read: read.request):
            if read.tokens is not None and read.tokens >= opening:
                whole.setdefault(read.key, []).append(read)
        return {key: reads[1:] for key, reads in whole.items() if len(reads) > 1}
