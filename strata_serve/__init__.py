"""strata-serve: an OpenAI-compatible server in front of llama.cpp's llama-server.

Plugins import this package and decorate their hook implementations with
``@strata_serve.hookimpl``; the hooks themselves are documented in
:mod:`strata_serve.hookspecs`.
"""

from strata_serve.hookspecs import hookimpl
from strata_serve.exchange import EngineError, KeyRefused, Outcome, StrataRequest, Verdict

__all__ = ["hookimpl", "EngineError", "KeyRefused", "Outcome", "StrataRequest", "Verdict"]
__version__ = "0.1.0"
