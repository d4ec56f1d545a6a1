"""The protocols, held to every implementation in the tree by the type checker.

Not a test module: ``make lint`` has mypy read it (``[tool.mypy] files``). Each function
returns an implementation where its protocol is expected, so a missing member or a
member of another type is a type error naming both.
"""

from __future__ import annotations

from strata_auto_sessions.shared import DirectoryTier, S3Tier, SharedTier
from strata_auto_sessions.store import ParkingStore, SessionStore
from strata_serve.engine.base import Engine
from strata_serve.engine.llama_server import LlamaServer
from strata_serve.memory_engine import MemoryEngine


def llama_server_is_an_engine(engine: LlamaServer) -> Engine:
    return engine


def the_memory_engine_is_an_engine(engine: MemoryEngine) -> Engine:
    return engine


def the_session_store_is_a_parking_store(store: SessionStore) -> ParkingStore:
    return store


def the_directory_tier_is_a_shared_tier(tier: DirectoryTier) -> SharedTier:
    return tier


def the_s3_tier_is_a_shared_tier(tier: S3Tier) -> SharedTier:
    return tier
