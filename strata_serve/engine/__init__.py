"""Engine backends: one protocol (:class:`Engine`), llama-server first."""

from strata_serve.engine.base import Engine, EngineInfo, EngineUnavailable, JSONAnswer
from strata_serve.engine.llama_server import LlamaServer

__all__ = ["Engine", "EngineInfo", "EngineUnavailable", "JSONAnswer", "LlamaServer"]
