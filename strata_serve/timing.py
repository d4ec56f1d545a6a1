"""Where a request's time goes outside the engine: named spans, per request and in total.

Between one answer's end and the engine starting the next request, the line is held by
work of strata-serve's own: choosing the slot, asking the engine what its slots hold, the
plugins' steps (a save and its fsyncs, a restore), then after the answer the plugins'
``post_request``. Each part is timed as a *span* on the request it is done for:

- the core's: ``read`` (the body read and checked), ``key`` (the keying plugins choosing
  the conversation's key), ``queue`` (waiting for the line), ``ready`` (the engine up, the slot chosen),
  ``pre_request`` and ``post_request`` (every plugin's step, in all), ``slots`` (the engine's
  ``GET /slots``), ``engine_save``, ``engine_restore`` and ``engine_erase`` (the engine's slot
  calls), ``gap``: the time from the engine's previous answer in that slot ending to
  this request being sent, for a request that was already waiting then (the time the
  engine stood idle because of strata-serve), and ``engine``: the engine's answer as the
  relay waited for it, from the request sent to the answer's end (for a request sent
  ahead of its turn, that includes the answer before it);
- a plugin's own, with :func:`span` (auto-sessions: ``commit``, ``fsync``, ``prune``, ...).

Spans nest: ``pre_request`` includes the plugins' spans and the engine calls they made.
A request's spans are sent back in its ``Server-Timing`` header (as far as known when the
headers leave: a stream's before its answer, so without ``engine``) and added up per service
(:class:`PhaseTotals`, in ``GET /stats`` as ``phases``). ``bench.gap`` reads them.
"""

from __future__ import annotations

import contextlib
import functools
import re
import time
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field

__all__ = ["PhaseTotals", "Timeline", "current_timeline", "read_server_timing", "span"]

#: A span's name: what ``Server-Timing`` takes as a metric name (an HTTP token), kept short.
_NAME = re.compile(r"[A-Za-z0-9_.-]{1,40}")
#: Names already found valid: a request adds a dozen spans, most often the same names.
_VALID_NAMES: set[str] = set()
#: At most this many are remembered (names are the code's own, but a plugin could make many).
_VALID_NAMES_KEPT = 1024
#: The hooks whose implementations are timed one by one, as ``<hook>.<plugin>``.
TIMED_HOOKS = frozenset({"pre_request", "post_request"})


@functools.lru_cache(maxsize=256)
def span_name(text: str) -> str:
    """``text`` made a span's name: characters a name cannot hold become ``_``, cut to 24."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", text)[:24] or "_"


@dataclass
class Timeline:
    """One request's spans: milliseconds and count per name, in the order first seen."""

    spans: dict[str, list[float]] = field(default_factory=dict)

    def add(self, name: str, ms: float) -> None:
        if name not in _VALID_NAMES:
            if not _NAME.fullmatch(name):
                raise ValueError(f"a span's name is 1-40 of [A-Za-z0-9_.-], not {name!r}")
            if len(_VALID_NAMES) < _VALID_NAMES_KEPT:
                _VALID_NAMES.add(name)
        entry = self.spans.setdefault(name, [0.0, 0])
        entry[0] += ms
        entry[1] += 1

    def ms(self, name: str) -> float:
        entry = self.spans.get(name)
        return entry[0] if entry else 0.0

    def server_timing(self) -> str:
        """The ``Server-Timing`` header's value: ``name;dur=ms`` for each span."""
        return ", ".join(f"{name};dur={ms:.2f}" for name, (ms, _) in self.spans.items())


def read_server_timing(header: str) -> dict[str, float]:
    """A ``Server-Timing`` header read back: {name: ms} (for clients, tests and benchmarks)."""
    spans = {}
    for item in header.split(","):
        name, _, ms = item.strip().partition(";dur=")
        if ms:
            spans[name] = float(ms)
    return spans


_current: ContextVar[Timeline | None] = ContextVar("strata_timeline", default=None)


def current_timeline() -> Timeline | None:
    """The timeline of the request being worked for, None outside one (an idle save)."""
    return _current.get()


@contextlib.contextmanager
def timeline_of(timeline: Timeline) -> Iterator[None]:
    """Spans made within count on ``timeline`` (the core sets it around a request)."""
    token = _current.set(timeline)
    try:
        yield
    finally:
        _current.reset(token)


@contextlib.contextmanager
def span(name: str) -> Iterator[None]:
    """Time the block as ``name`` on the request it is done for; nothing outside a request.

    A plugin names its own steps with it (``with strata_serve.span("myplugin.fetch"): ...``)
    and they show in the request's ``Server-Timing`` and in ``GET /stats``. It costs two
    clock reads.
    """
    timeline = _current.get()
    if timeline is None:
        yield
        return
    began = time.perf_counter()
    try:
        yield
    finally:
        timeline.add(name, (time.perf_counter() - began) * 1000)


class PhaseTotals:
    """Every request's spans added up, since the start: ``snapshot()`` for ``GET /stats``."""

    def __init__(self) -> None:
        self._totals: dict[str, list[float]] = {}
        self.requests = 0

    def add(self, timeline: Timeline) -> None:
        self.requests += 1
        for name, (ms, count) in timeline.spans.items():
            entry = self._totals.setdefault(name, [0.0, 0])
            entry[0] += ms
            entry[1] += count

    def snapshot(self) -> dict[str, object]:
        return {"requests": self.requests,
                "ms": {name: round(ms, 3) for name, (ms, _) in self._totals.items()},
                "count": {name: int(count) for name, (_, count) in self._totals.items()}}
