"""llama.cpp's llama-server: its known slot-file quirks, turned into verdicts.

The rules are in :mod:`strata_quirks_llama_cpp.quirks`. They apply to engines
driven by strata-serve's llama-server backend (:class:`strata_serve.engine.LlamaServer`),
started or attached; another backend is not llama.cpp and gets no answer.

Each server has its own rules object (it counts restores and remembers what it
said), made at ``on_startup`` with this plugin's settings and kept in
``service.state["quirks_llama_cpp"]``.
"""

from __future__ import annotations

import strata_serve
from strata_serve import LlamaServer

from strata_quirks_llama_cpp.quirks import NAME, LlamaCppQuirks, LlamaCppQuirksConfig

__all__ = ["LlamaCppQuirks", "LlamaCppQuirksConfig"]

#: The plugin's name when registered by hand (tests); the entry point gives the same.
strata_name = NAME


@strata_serve.hookimpl
def on_config(settings):
    settings.plugin_config(NAME, LlamaCppQuirksConfig)


@strata_serve.hookimpl
def on_startup(service):
    if isinstance(service.engine, LlamaServer):
        service.state[NAME] = LlamaCppQuirks(service.plugin_config(NAME, LlamaCppQuirksConfig))


def _quirks(service) -> LlamaCppQuirks:
    quirks = service.state.get(NAME)
    if quirks is None:  # asked before on_startup: the default settings
        quirks = service.state.setdefault(NAME, LlamaCppQuirks(LlamaCppQuirksConfig()))
    return quirks


@strata_serve.hookimpl
def engine_verdict(op, error, engine, held_tokens, service):
    if not isinstance(engine, LlamaServer):
        return None  # not llama.cpp: these quirks are not its quirks
    return _quirks(service).verdict(op, error, engine.info, held_tokens)


@strata_serve.hookimpl(optionalhook=True)  # auto-sessions' hook: this plugin also loads without it
def auto_sessions_restore_unused(engine, service):
    if not isinstance(engine, LlamaServer):
        return None
    return _quirks(service).restore_not_reused(engine.info.model_path)
