"""Prompts as chains of digests, one per message boundary, and the parked conversations
a fallback plugin may choose from (the ``auto_sessions_fallback`` hook).

The chain of a prompt made of units ``u1 .. un`` (its instructions or system prompt, then
its messages) is ``d1 .. dn`` with ``di = H(d(i-1), ui)``, the first link seeded with what
the chat template renders before the messages (the tools). Two prompts share their
first ``k`` messages exactly when their chains share their first ``k`` digests: the
longest shared opening is found without keeping any text.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

#: Longest chain recorded: a conversation longer than this shares at most its first
#: this many messages (a sidecar stays a few KB).
MAX_LINKS = 512
#: Bytes of each digest (16 hex digits): enough to tell messages apart, short to keep.
LINK_BYTES = 8


def _canonical(value: Any) -> bytes:
    return json.dumps(value, sort_keys=True, ensure_ascii=False, separators=(",", ":")).encode("utf-8", "replace")


def message_chain(body: dict[str, Any], units: list[Any]) -> dict[str, list]:
    """``{"chain": [digest per boundary], "sizes": [characters up to each boundary]}``.

    ``sizes`` lets a reader estimate how much of a saved state a shared opening is.
    """
    link = hashlib.blake2b(_canonical({"tools": body.get("tools")}), digest_size=LINK_BYTES).digest()
    chain, sizes, total = [], [], 0
    for unit in units[:MAX_LINKS]:
        data = _canonical(unit)
        link = hashlib.blake2b(link + data, digest_size=LINK_BYTES).digest()
        total += len(data)
        chain.append(link.hex())
        sizes.append(total)
    return {"chain": chain, "sizes": sizes}


def shared_links(one: list[str], other: list[str]) -> int:
    """How many message boundaries two chains share from their start."""
    shared = 0
    for mine, theirs in zip(one, other):
        if mine != theirs:
            break
        shared += 1
    return shared


@dataclass(frozen=True)
class ParkedConversation:
    """A parked conversation a fallback may restore: same tenant, a file the engine can use."""

    key: str
    tokens: int
    bytes: int
    last_used: float
    #: Its prompt's chain and sizes when it was saved (see :func:`message_chain`).
    chain: list[str]
    sizes: list[int]
    #: Which of its key's files it is (one per conversation under the key; 0 the first).
    #: A key may be offered once per sibling: choosing the key takes the one of them
    #: that shares the most with the incoming prompt.
    sibling: int = 0

    def shared_links(self, chain: list[str]) -> int:
        """How many message boundaries its chain shares from the start with ``chain`` (the
        incoming prompt's ``chain["chain"]``, as the ``auto_sessions_fallback`` hook gets it)."""
        return shared_links(self.chain, chain)

    def shared_tokens(self, links: int) -> int:
        """About how many of its tokens the first ``links`` messages make (by their share
        of the prompt's characters; the saved answer counts with the last message)."""
        if links <= 0 or not self.sizes:
            return 0
        if links >= len(self.sizes):
            return self.tokens
        return int(self.tokens * self.sizes[links - 1] / self.sizes[-1])
