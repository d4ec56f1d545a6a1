"""A shared tier of parked conversations, for several servers behind one address.

Two layers: the engine's slot directory stays where the engine reads and writes; the
shared tier (:class:`SharedTier`, a directory every server mounts or an S3 bucket) holds
a copy of each conversation file and a head per file that says which copy is current,
by generation, written by compare-and-swap. :class:`SharedParking` uploads after a save
commits and fetches before a restore when another server moved a conversation on.
"""

from __future__ import annotations

from pathlib import Path
from urllib.parse import unquote, urlsplit

from strata_auto_sessions.config import SharedConfig
from strata_auto_sessions.shared.directory import DirectoryTier
from strata_auto_sessions.shared.s3 import S3Tier
from strata_auto_sessions.shared.tier import (
    ConditionFailed, ConditionsIgnored, Head, Listed, SharedTier, SharedTierError, check_conditions,
)

__all__ = ["ConditionFailed", "ConditionsIgnored", "DirectoryTier", "Head", "Listed", "S3Tier", "SharedTier",
           "SharedTierError", "check_conditions", "tier_for"]


def tier_for(config: SharedConfig) -> SharedTier:
    """The tier ``config.url`` names: ``file:///path`` or ``s3://bucket/prefix``."""
    parts = urlsplit(config.url)
    if parts.scheme == "file":
        return DirectoryTier(Path(unquote(parts.path)), lock_expiry_s=config.lock_expiry_s,
                             lock_wait_s=min(config.timeout_s, config.lock_expiry_s))
    return S3Tier(parts.netloc, unquote(parts.path), addressing_style=config.addressing_style,
                  timeout_s=config.timeout_s)
