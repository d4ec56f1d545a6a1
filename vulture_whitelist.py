"""What vulture (``make lint``) cannot see used in the core, each with where it is used.

vulture reads ``strata_serve`` alone: the plugin API is used by the plugins and their tests,
hooks by pluggy, settings sources by pydantic. Naming a member here marks it used; a member
nothing uses at all is removed instead of named here.
"""

import logging

from strata_serve.api.builtin import ENGINE_ROUTES
from strata_serve.config import Settings, _FileSource
from strata_serve.engine.base import CAPABILITIES, EngineInfo, StateLayout
from strata_serve.engine.llama_server import LlamaServer
from strata_serve.engine.results import Timings
from strata_serve.files import PRIVATE_FILE_MODE
from strata_serve.hook_types import Outcome, StrataRequest, Verdict
from strata_serve.measures import EngineMeasures
from strata_serve.memory_engine import MemoryEngine
from strata_serve.metrics import counter, gauge, plugin_metrics
from strata_serve.service import Service
from strata_serve.slot_state import SlotRegistry
from strata_serve.tenants import in_tenant
from strata_serve.testing import (KeyRecorder, ask, assert_openai_error, chat_body, conversation, llama_server_factory,
                                  until, until_idle)
from strata_serve.timing import PhaseTotals

_ = (
    # The plugin API (strata_serve.__all__): used by the bundled plugins, examples and tests.
    ENGINE_ROUTES, CAPABILITIES, PRIVATE_FILE_MODE, in_tenant, counter, gauge, plugin_metrics,
    Verdict.PROVISIONAL, Verdict.UNSUPPORTED, Verdict.RETRY, Verdict.SKIP, Outcome.duration_ms, Timings.generate_ms,
    EngineInfo.multimodal, StateLayout.cache_type_k, StateLayout.cache_type_v, StateLayout.flash_attn,
    StateLayout.n_gpu_layers,  # auto-sessions' compat.py: a file's layout against the engine's
    # What a backend declares, read by plugins (auto-sessions checks capabilities and state_format).
    LlamaServer.capabilities, LlamaServer.state_format, MemoryEngine.capabilities, MemoryEngine.state_format,
    # The service and its picture, as plugins use them: auto-sessions (when_idle, verdict, the
    # registry's four methods of its own), ram-cache-stats (the measures, phases' snapshot),
    # docs/examples/uptime_route.py (started_at), tests (corrections).
    Service.when_idle, Service.verdict, Service.started_at, SlotRegistry.file_written, SlotRegistry.holds_sibling,
    SlotRegistry.nothing_durable, SlotRegistry.file_gone, SlotRegistry.corrections, EngineMeasures.prefill_seconds,
    EngineMeasures.restore_seconds, EngineMeasures.bytes_per_token, PhaseTotals.snapshot,
    # Read by the plugins acting around a request sent ahead of its turn (auto-sessions' pre_request).
    StrataRequest.sent_ahead,
    # strata_serve.testing, the pytest plugin: its fixtures and helpers are for plugins' tests.
    KeyRecorder, ask, assert_openai_error, chat_body, conversation, llama_server_factory, until, until_idle,
    # pydantic-settings calls these on a settings source (config.py).
    _FileSource.get_field_value, Settings.settings_customise_sources,
    # logging's record, rewritten by cli.py's filter.
    logging.LogRecord.msg, logging.LogRecord.levelname, logging.LogRecord.levelno,
)
