"""prefix-restore: a conversation without a file of its own starts from the parked
conversation that shares its longest opening, counted in whole messages.

auto-sessions asks through its ``auto_sessions_fallback`` hook when the incoming
conversation has no file; this plugin compares the chains of digests (one per message
boundary) auto-sessions records for each parked file with the incoming prompt's, and
names the parked conversation that shares the longest opening among those worth their
restore: reading the shared tokens again must take longer than restoring the file, by
``min_gain_s`` (with speeds measured on this engine; until they are, any opening of
``min_shared_tokens`` or more is worth it). The engine then reuses the shared tokens
and reads the rest. auto-sessions offers only the same tenant's files, and only those
this engine can use.
"""

from __future__ import annotations

import logging
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

import strata_serve

log = logging.getLogger("strata_prefix_restore")

NAME = "prefix_restore"
#: The plugin's name when registered by hand (tests); the entry point gives the same.
strata_name = NAME


class PrefixRestoreConfig(BaseModel):
    """``plugins.prefix_restore.*``."""

    model_config = ConfigDict(extra="forbid")

    #: A shared opening shorter than this many tokens (estimated) is never worth a restore.
    min_shared_tokens: int = Field(256, ge=1)
    #: Once speeds are measured: the seconds of prefill the shared opening saves, less the
    #: restore's own, must be at least this.
    min_gain_s: float = Field(0.2, ge=0)


@strata_serve.hookimpl
def on_config(settings):
    settings.plugin_config(NAME, PrefixRestoreConfig)


@strata_serve.hookimpl(optionalhook=True)
def auto_sessions_fallback(request, chain, parked, costs, service) -> str | None:
    config = service.plugin_config(NAME, PrefixRestoreConfig)
    # The longest shared opening wins (a longer one holds every shorter one), among those
    # worth their restore; between equal openings, the cheaper restore.
    best: tuple[tuple[int, float], Any, int] | None = None
    for candidate in parked:
        links = candidate.shared_links(chain["chain"])
        if links == 0:
            continue
        tokens = candidate.shared_tokens(links)
        if tokens < config.min_shared_tokens:
            continue
        prefill_s = costs.prefill_seconds(tokens)
        if prefill_s is None:
            gain = -float(candidate.bytes)  # speeds not measured yet: any opening this long is worth it
        else:
            restore_s = costs.restore_seconds(candidate.bytes) or 0.0
            gain = prefill_s - restore_s
            if gain < config.min_gain_s:
                log.info("[strata] prefix restore: %s shares its opening (about %s tokens) with %s, not worth "
                         "a restore: reading it takes about %.2f s here, restoring %.2f s (min_gain_s %g)",
                         request.conversation_key, f"{tokens:,}", candidate.key, prefill_s, restore_s,
                         config.min_gain_s)
                continue
        if best is None or (links, gain) > best[0]:
            best = ((links, gain), candidate, tokens)
    if best is None:
        return None
    _gain, chosen, tokens = best
    log.info("[strata] prefix restore: %s shares its opening (about %s tokens) with %s",
             request.conversation_key, f"{tokens:,}", chosen.key)
    return chosen.key

