"""HTTP routes: OpenAI-compatible, ``/slots``, ``/health``, and routes added by plugins."""

from strata_serve.api.app import create_app
from strata_serve.api.app_state import SERVICE, TENANT

__all__ = ["create_app", "SERVICE", "TENANT"]
