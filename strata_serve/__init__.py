"""strata-serve: a server in front of llama.cpp's llama-server, with plugins that act between requests.

Plugins import this package and decorate their hook implementations with
``@strata_serve.hookimpl``; the hooks themselves are documented in
:mod:`strata_serve.hookspecs`. Everything a plugin may use is exported here (and,
for tests, from :mod:`strata_serve.testing`); other modules are the core's own and
may change. The heavier names load on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from strata_serve.hook_types import ConversationKey, EngineError, KeyRefused, Outcome, StrataRequest, Timings, Verdict
from strata_serve.hookspecs import hookimpl

__version__ = "0.1.0"

if TYPE_CHECKING:  # the names below, as mypy and an IDE see them (loaded on first use)
    from strata_serve.api.app_state import SERVICE, TENANT  # noqa: F401
    from strata_serve.api.builtin import ENGINE_ROUTES  # noqa: F401
    from strata_serve.api.conversation import Opening, message_text, text_key  # noqa: F401
    from strata_serve.api.errors import APIError, ErrorShape  # noqa: F401
    from strata_serve.api.formats import ApiFormat  # noqa: F401
    from strata_serve.api.prompts import api_of, opening, prompt_units  # noqa: F401
    from strata_serve.api.registry import Api  # noqa: F401
    from strata_serve.config import ConfigError, Settings, load_settings  # noqa: F401
    from strata_serve.engine.base import CAPABILITIES, ContextOverflow, Engine, EngineInfo  # noqa: F401
    from strata_serve.engine.base import EngineUnavailable, SlotErased, SlotReport, SlotRestored  # noqa: F401
    from strata_serve.engine.base import SlotSaved, StateLayout  # noqa: F401
    from strata_serve.engine.llama_server import LlamaServer  # noqa: F401
    from strata_serve.engine.state_blocks import CutState, StateBlock, StateFormat, StateRefusal  # noqa: F401
    from strata_serve.files import PRIVATE_FILE_MODE, make_private_dir  # noqa: F401
    from strata_serve.hook_calls import call_each_sync, first_result  # noqa: F401
    from strata_serve.measures import EngineMeasures, StateSource, state_source  # noqa: F401
    from strata_serve.metrics import Metric, counter, gauge, metrics_of, plugin_metrics  # noqa: F401
    from strata_serve.service import Service  # noqa: F401
    from strata_serve.slot_state import SlotState  # noqa: F401
    from strata_serve.tenants import in_tenant, tenant_key, tenant_of  # noqa: F401
    from strata_serve.timing import Timeline, span  # noqa: F401

#: The rest of the plugin API: name -> the module that defines it, imported on first use.
_LAZY = {
    "ConfigError": "strata_serve.config",
    "Settings": "strata_serve.config",
    "load_settings": "strata_serve.config",
    "Engine": "strata_serve.engine.base",
    "EngineInfo": "strata_serve.engine.base",
    "StateLayout": "strata_serve.engine.base",
    "SlotReport": "strata_serve.engine.base",
    "SlotSaved": "strata_serve.engine.base",
    "SlotRestored": "strata_serve.engine.base",
    "SlotErased": "strata_serve.engine.base",
    "ContextOverflow": "strata_serve.engine.base",
    "EngineUnavailable": "strata_serve.engine.base",
    "CAPABILITIES": "strata_serve.engine.base",
    "ENGINE_ROUTES": "strata_serve.api.builtin",
    "StateFormat": "strata_serve.engine.state_blocks",
    "StateBlock": "strata_serve.engine.state_blocks",
    "CutState": "strata_serve.engine.state_blocks",
    "StateRefusal": "strata_serve.engine.state_blocks",
    "LlamaServer": "strata_serve.engine.llama_server",
    "SlotState": "strata_serve.slot_state",
    "EngineMeasures": "strata_serve.measures",
    "StateSource": "strata_serve.measures",
    "state_source": "strata_serve.measures",
    "Service": "strata_serve.service",
    "APIError": "strata_serve.api.errors",
    "Api": "strata_serve.api.registry",
    "ApiFormat": "strata_serve.api.formats",
    "ErrorShape": "strata_serve.api.errors",
    "Opening": "strata_serve.api.conversation",
    "prompt_units": "strata_serve.api.prompts",
    "api_of": "strata_serve.api.prompts",
    "SERVICE": "strata_serve.api.app_state",
    "TENANT": "strata_serve.api.app_state",
    "first_result": "strata_serve.hook_calls",
    "call_each_sync": "strata_serve.hook_calls",
    "message_text": "strata_serve.api.conversation",
    "opening": "strata_serve.api.prompts",
    "text_key": "strata_serve.api.conversation",
    "Metric": "strata_serve.metrics",
    "counter": "strata_serve.metrics",
    "gauge": "strata_serve.metrics",
    "metrics_of": "strata_serve.metrics",
    "plugin_metrics": "strata_serve.metrics",
    "tenant_key": "strata_serve.tenants",
    "tenant_of": "strata_serve.tenants",
    "in_tenant": "strata_serve.tenants",
    "PRIVATE_FILE_MODE": "strata_serve.files",
    "make_private_dir": "strata_serve.files",
    "span": "strata_serve.timing",
    "Timeline": "strata_serve.timing",
}

__all__ = ["hookimpl", "ConversationKey", "EngineError", "KeyRefused", "Outcome", "StrataRequest", "Timings", "Verdict",
           *_LAZY]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'strata_serve' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
