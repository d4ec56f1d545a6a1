"""Metrics a plugin declares beside its counters, for any stats plugin to export.

A plugin keeps its numbers in a dataclass whose fields are made with :func:`counter`
or :func:`gauge`: the name, help, kind and unit of each sit where the counter is
defined. It returns the dataclass (or :class:`Metric` values) from the
``collect_metrics`` hook; :func:`plugin_metrics` gathers every plugin's answer, so a
stats plugin exports what it never heard of, by name or otherwise.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal
from collections.abc import Iterable, Mapping

from strata_serve.hook_calls import call_each_sync

if TYPE_CHECKING:
    from strata_serve.service import Service

log = logging.getLogger("strata_serve")

Kind = Literal["counter", "gauge"]
_SPEC = "strata_serve.metric"
#: A metric or label name, as Prometheus and OpenMetrics accept it.
_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")


@dataclass(frozen=True)
class MetricSpec:
    """What a number is: kept in a dataclass field's metadata by :func:`counter` and :func:`gauge`."""

    help: str
    kind: Kind
    #: The base unit of the exported value (``seconds``, ``bytes``), "" for a count.
    unit: str = ""
    #: The exported name; None: the field's own. Several fields may share a name
    #: with different ``labels`` (one family, one sample each).
    name: str | None = None
    labels: Mapping[str, str] = field(default_factory=dict)
    #: The field's value times ``scale`` is in ``unit`` (``1e-3`` for milliseconds to seconds).
    scale: float = 1.0
    #: A short label (``"saves"``): a stats plugin may show the number in a one-line
    #: summary as "<value> <label>". None: not in summaries.
    summary: str | None = None


@dataclass(frozen=True)
class Metric:
    """One number, ready to export: ``name`` is the plugin's own (an exporter adds its prefix)."""

    name: str
    help: str
    kind: Kind
    value: float
    unit: str = ""
    labels: Mapping[str, str] = field(default_factory=dict)
    #: See :attr:`MetricSpec.summary`.
    summary: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in ("counter", "gauge"):
            raise ValueError(f"metric {self.name}: kind must be 'counter' or 'gauge', not {self.kind!r}")
        for name in (self.name, *self.labels):
            if not _NAME.fullmatch(name):
                raise ValueError(f"metric {self.name}: {name!r} is not a metric or label name")
        if self.unit and not _NAME.fullmatch(self.unit):
            raise ValueError(f"metric {self.name}: unit {self.unit!r} is not a name")


def counter(help: str, *, unit: str = "", name: str | None = None, labels: Mapping[str, str] | None = None,
            scale: float = 1.0, summary: str | None = None, default: float = 0) -> Any:
    """A dataclass field that counts up from ``default``, declared as a metric.

    ``saves: int = counter("Conversations saved to disk")``
    """
    return _field(MetricSpec(help, "counter", unit, name, dict(labels or {}), scale, summary), default)


def gauge(help: str, *, unit: str = "", name: str | None = None, labels: Mapping[str, str] | None = None,
          scale: float = 1.0, summary: str | None = None, default: float = 0) -> Any:
    """A dataclass field that goes up and down, declared as a metric."""
    return _field(MetricSpec(help, "gauge", unit, name, dict(labels or {}), scale, summary), default)


def _field(spec: MetricSpec, default: float) -> Any:
    return field(default=default, metadata={_SPEC: spec})


def metrics_of(numbers: Any) -> list[Metric]:
    """The declared fields of the dataclass instance ``numbers``, as :class:`Metric` values.

    Fields made without :func:`counter` or :func:`gauge` are not metrics and are left out.
    """
    if not dataclasses.is_dataclass(numbers) or isinstance(numbers, type):
        raise TypeError(f"metrics_of() takes a dataclass instance, not {type(numbers).__name__}")
    found = []
    for f in dataclasses.fields(numbers):
        spec = f.metadata.get(_SPEC)
        if spec is not None:
            found.append(Metric(name=spec.name or f.name, help=spec.help, kind=spec.kind, unit=spec.unit,
                                labels=spec.labels, value=_scaled(getattr(numbers, f.name), spec.scale),
                                summary=spec.summary))
    return found


def _scaled(value: float, scale: float) -> float:
    return value if scale == 1 else value * scale


def plugin_metrics(service: Service) -> dict[str, list[Metric]]:
    """Every plugin's ``collect_metrics`` answer, by plugin name.

    An answer may be a dataclass declared with :func:`counter` and :func:`gauge`, or an
    iterable of :class:`Metric`. A plugin that raises, or answers anything else, is
    logged under its name and left out; None answers are left out silently.
    """
    found: dict[str, list[Metric]] = {}
    for name, answer in call_each_sync(service.pm, "collect_metrics", service=service):
        if answer is None:
            continue
        try:
            metrics = _as_metrics(answer)
        except (TypeError, ValueError) as exc:
            log.warning("[strata] plugin %s: collect_metrics answered something that is not metrics: %s",
                        name, exc)
            continue
        found[name] = metrics
    return found


def _as_metrics(answer: Any) -> list[Metric]:
    if dataclasses.is_dataclass(answer) and not isinstance(answer, type):
        return metrics_of(answer)
    if isinstance(answer, Iterable) and not isinstance(answer, (str, bytes, Mapping)):
        metrics = list(answer)
        wrong = [m for m in metrics if not isinstance(m, Metric)]
        if not wrong:
            return metrics
        raise TypeError(f"{type(wrong[0]).__name__} in the answer, where a strata_serve.Metric was due")
    raise TypeError(f"a {type(answer).__name__}, where a declared dataclass or Metric values were due")
