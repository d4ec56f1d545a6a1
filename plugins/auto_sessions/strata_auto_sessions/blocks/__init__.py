"""Parked state as blocks of tokens: each block stored once, under a name chained over the prefix.

``BlockStore`` (store.py) keeps an engine's state files cut into blocks by the engine's
:class:`strata_serve.StateFormat`; ``names.py`` says how blocks are named, ``objects.py``
how one is written down.
"""

from strata_auto_sessions.blocks.objects import CorruptBlock
from strata_auto_sessions.blocks.store import (BlockStore, Chain, Manifest, PruneReport, SaveReport,
                                               StoreUsage)

__all__ = ["BlockStore", "Chain", "CorruptBlock", "Manifest", "PruneReport", "SaveReport", "StoreUsage"]
