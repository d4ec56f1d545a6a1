"""HTTP routes: the APIs (each declared once, :mod:`strata_serve.api.registry`), ``/slots``,
``/health``, and routes added by plugins.

The names below load on first use: the engine's package reads the APIs' declarations
(its route table), and they must not need the app to load.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {"create_app": "strata_serve.api.app", "SERVICE": "strata_serve.api.app_state",
         "TENANT": "strata_serve.api.app_state"}

__all__ = ["create_app", "SERVICE", "TENANT"]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
