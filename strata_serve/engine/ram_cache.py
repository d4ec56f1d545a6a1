"""A model of what llama-server's RAM prompt cache (``--cache-ram``) holds, by conversation.

The engine says nothing about this cache through its API, so it is inferred from the
requests. Its behaviour, read from the engine's verbose log on this project's build:
when a request for another conversation arrives, the engine first parks the slot's
state in the cache (dropping the oldest entries while the cache is over its budget),
then looks there for the incoming prompt and moves the best match into the slot, out
of the cache. A slot restore from disk bypasses all of this: nothing is parked.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

#: llama-server's ``--cache-ram`` when started without the flag.
ENGINE_DEFAULT_CACHE_RAM_MIB = 8192
MIB = 1024 * 1024


def budget_bytes(cache_ram_mib: int | None) -> int | None:
    """The RAM cache's budget in bytes: 0 when off, None when unlimited (``--cache-ram -1``)."""
    mib = ENGINE_DEFAULT_CACHE_RAM_MIB if cache_ram_mib is None else cache_ram_mib
    return None if mib < 0 else mib * MIB


@dataclass
class EngineRamModel:
    """Conversations most likely parked in the engine's RAM cache, oldest first.

    Sizes are kept in tokens; the budget, in bytes, is applied once the engine's
    bytes per token are known (measured from slot saves).
    """

    #: The cache's budget in bytes, None when unlimited.
    budget: int | None
    #: The most entries kept, so an unlimited cache cannot grow this model without bound.
    max_entries: int
    entries: collections.OrderedDict[str, int] = field(default_factory=collections.OrderedDict)

    @property
    def tokens(self) -> int:
        return sum(self.entries.values())

    def estimated_bytes(self, bytes_per_token: float | None) -> int | None:
        return None if bytes_per_token is None else int(self.tokens * bytes_per_token)

    def park(self, key: str, tokens: int, bytes_per_token: float | None) -> list[str]:
        """The engine parks the outgoing conversation, then makes room within its budget.

        :returns: the conversations evicted to make room, oldest first.
        """
        self.entries.pop(key, None)
        self.entries[key] = tokens
        evicted = []
        while self.entries and (len(self.entries) > self.max_entries
                                or self._over_budget(bytes_per_token)):
            evicted.append(self.entries.popitem(last=False)[0])
        return evicted

    def holds(self, key: str) -> bool:
        return key in self.entries

    def holds_after_parking(self, key: str, outgoing: str | None, tokens: int,
                            bytes_per_token: float | None) -> bool:
        """Whether ``key`` is still cached once the engine has parked ``outgoing``.

        The engine parks (and evicts) before it looks for the incoming conversation,
        so parking the outgoing one can push the incoming one out first.
        """
        trial = self._copy()
        if outgoing is not None and tokens > 0:
            trial.park(outgoing, tokens, bytes_per_token)
        return trial.holds(key)

    def evictions_if_parked(self, key: str, tokens: int, bytes_per_token: float | None) -> list[str]:
        """What parking ``key`` would push out of the cache (``key`` itself if it cannot fit)."""
        return self._copy().park(key, tokens, bytes_per_token)

    def _copy(self) -> EngineRamModel:
        return EngineRamModel(self.budget, self.max_entries, collections.OrderedDict(self.entries))

    def take(self, key: str) -> bool:
        """The engine moves a returning conversation into the slot; True if it was held here."""
        return self.entries.pop(key, None) is not None

    def clear(self) -> None:
        self.entries.clear()

    def _over_budget(self, bytes_per_token: float | None) -> bool:
        if self.budget is None or bytes_per_token is None:
            return False
        return self.tokens * bytes_per_token > self.budget
