"""llama.cpp's llama-server: its known slot-file quirks, turned into verdicts.

The rules are in :mod:`strata_quirks_llama_cpp.quirks`. They apply to engines
driven by strata-serve's llama-server backend (:class:`strata_serve.engine.LlamaServer`),
started or attached; another backend is not llama.cpp and gets no answer.

Each engine has its own rules object (it counts restores and remembers what it
said), made at ``on_startup`` with this plugin's settings and looked up by the
engine the hook is asked about.
"""

from __future__ import annotations

import weakref

import strata_serve
from strata_serve.engine import LlamaServer

from strata_quirks_llama_cpp.quirks import NAME, LlamaCppQuirks, LlamaCppQuirksConfig

__all__ = ["LlamaCppQuirks", "LlamaCppQuirksConfig"]

#: The plugin's name when registered by hand (tests); the entry point gives the same.
strata_name = NAME

#: One rules object per engine; it goes when its engine goes.
_quirks: weakref.WeakKeyDictionary[LlamaServer, LlamaCppQuirks] = weakref.WeakKeyDictionary()


@strata_serve.hookimpl
def on_config(settings):
    settings.plugin_config(NAME, LlamaCppQuirksConfig)


@strata_serve.hookimpl
def on_startup(service):
    if isinstance(service.engine, LlamaServer):
        _quirks[service.engine] = LlamaCppQuirks(service.settings.plugin_config(NAME, LlamaCppQuirksConfig))


@strata_serve.hookimpl
def engine_verdict(op, error, engine, held_tokens):
    if not isinstance(engine, LlamaServer):
        return None  # not llama.cpp: these quirks are not its quirks
    quirks = _quirks.get(engine)
    if quirks is None:  # asked before on_startup: the default settings
        quirks = _quirks.setdefault(engine, LlamaCppQuirks(LlamaCppQuirksConfig()))
    return quirks.verdict(op, error, engine.info, held_tokens)
