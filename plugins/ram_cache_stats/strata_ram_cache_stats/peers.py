"""Other plugins' numbers, read through the ``collect_stats`` hook."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from strata_serve import call_each_sync

if TYPE_CHECKING:
    from strata_serve import Service


def plugin_numbers(service: Service) -> dict[str, dict[str, Any]]:
    """Every plugin's ``collect_stats`` answer, by plugin name (None answers left out)."""
    return {
        name: numbers
        for name, numbers in call_each_sync(service.pm, "collect_stats", service=service)
        if isinstance(numbers, dict)
    }
