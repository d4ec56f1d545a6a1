"""HTTP routes: the APIs (each declared once, :mod:`strata_serve.api.registry`), ``/slots``,
``/health``, and routes added by plugins.

The package holds two layers (docs/architecture.md): the web layer on top (``app``,
``relay``, ``slots``, ``models``, ``openapi``, ``app_state``) and the APIs' declarations
below the hooks' types (``builtin``, ``openai``, ``anthropic``, ``responses``, ``llama``,
``registry``, ``formats``, ``checks``, ``conversation``, ``errors``, ``schemas``).
"""

from __future__ import annotations

from strata_serve.api.app import create_app
from strata_serve.api.app_state import SERVICE, TENANT

__all__ = ["create_app", "SERVICE", "TENANT"]
