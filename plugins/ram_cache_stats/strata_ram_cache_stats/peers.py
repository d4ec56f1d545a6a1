"""Other plugins' numbers, read through the ``collect_stats`` hook."""

from __future__ import annotations

from typing import Any

from strata_serve import call_each_sync

from strata_ram_cache_stats.ledger import AUTO_SESSIONS


def plugin_numbers(service: Any) -> dict[str, dict[str, Any]]:
    """Every plugin's ``collect_stats`` answer, by plugin name (None answers left out)."""
    return {
        name: numbers
        for name, numbers in call_each_sync(service.pm, "collect_stats", service=service)
        if isinstance(numbers, dict)
    }


def bytes_per_token(numbers: dict[str, dict[str, Any]]) -> float | None:
    """The engine's bytes per token of state, from auto-sessions' slot saves (None before one)."""
    saves = numbers.get(AUTO_SESSIONS) or {}
    tokens, size = saves.get("saved_tokens") or 0, saves.get("saved_bytes") or 0
    return size / tokens if tokens and size else None
