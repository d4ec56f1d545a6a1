"""Engine backends: one protocol (:class:`Engine`) with results of its own, llama-server first."""

from strata_serve.engine.base import (ContextOverflow, Engine, EngineInfo, EngineUnavailable, JSONAnswer, SlotErased,
                                      SlotReport, SlotRestored, SlotSaved)
from strata_serve.engine.llama_server import LlamaServer

__all__ = ["ContextOverflow", "Engine", "EngineInfo", "EngineUnavailable", "JSONAnswer", "LlamaServer", "SlotErased",
           "SlotReport", "SlotRestored", "SlotSaved"]
