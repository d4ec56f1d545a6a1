"""Where a local state stands against a head of the shared tier: of the same conversation or not, newer or older.

A conversation's identity is what its state holds, not a file's name: a head records the
prompt its state was made from (its chain of message digests), and two states are of
one conversation when one's prompt continues the other's. These tests, on a head, a
local state's sidecar or a request, are all the shared tier's bookkeeping needs to tell
which head is a file's, and whether to upload, fetch or leave a state as it is.
"""

from __future__ import annotations

from enum import Enum
from typing import TYPE_CHECKING, Any

from strata_auto_sessions.prefix import shared_links
from strata_auto_sessions.prompts import continues
from strata_auto_sessions.shared.tier import Head
from strata_auto_sessions.sidecar import Sidecar

if TYPE_CHECKING:
    from strata_serve import StrataRequest

__all__ = ["Standing", "continued_by", "continued_by_prompt", "removed_since", "prompt_units", "standing"]


class Standing(Enum):
    """Where a local state stands against a head (:func:`standing`)."""

    #: The same conversation; the local state holds more of it (a later turn).
    AHEAD = "ahead"
    #: The same conversation at the same point (the same prompt, as many tokens).
    SAME = "same"
    #: The same conversation; the head holds more of it.
    BEHIND = "behind"
    #: Another conversation (or one that cannot be told from another: a head without its prompt).
    APART = "apart"


def _prompt_parts(prompt: Any) -> tuple[int, str, list[str] | None] | None:
    """A recorded prompt's units, digest and chain (None where it has none), or None when
    it is not one."""
    if not isinstance(prompt, dict):
        return None
    units, digest, chain = prompt.get("units"), prompt.get("digest"), prompt.get("chain")
    if type(units) is not int or not isinstance(digest, str):
        return None
    if not (isinstance(chain, list) and chain and all(isinstance(link, str) for link in chain)):
        chain = None
    return units, digest, chain


def standing(prompt: Any, tokens: int, head: Head) -> Standing:
    """How a local state made from ``prompt`` (a sidecar's) holding ``tokens`` stands
    against ``head``, by what each holds: one conversation's states are those whose
    prompts continue one another (their chains of message digests, one the start of the
    other); the longer prompt, then the more tokens, is the newer state."""
    mine, theirs = _prompt_parts(prompt), _prompt_parts(head.prompt)
    if mine is None or theirs is None:
        return Standing.APART
    (my_units, my_digest, my_chain), (units, digest, chain) = mine, theirs
    if my_chain is not None and chain is not None:
        shared = shared_links(my_chain, chain)
        if shared < min(len(my_chain), len(chain)):
            return Standing.APART
        if len(my_chain) != len(chain):
            return Standing.AHEAD if len(my_chain) > len(chain) else Standing.BEHIND
        if my_units != units:  # alike as far as chains are recorded (MAX_LINKS)
            return Standing.AHEAD if my_units > units else Standing.BEHIND
        if my_digest != digest:
            return Standing.APART
    elif (my_units, my_digest) != (units, digest):
        return Standing.APART
    if tokens != head.tokens:
        return Standing.AHEAD if tokens > head.tokens else Standing.BEHIND
    return Standing.SAME


def removed_since(head: Head, sidecar: Sidecar) -> bool:
    """Whether ``head`` is a tombstone of a removal by hand made since ``sidecar``'s state began."""
    return head.tombstone and head.removed is not None and head.removed >= sidecar.created


def prompt_units(prompt: Any) -> int:
    parts = _prompt_parts(prompt)
    return parts[0] if parts is not None else -1


def continued_by_prompt(prompt: Any, request: StrataRequest) -> bool:
    return _prompt_parts(prompt) is not None and continues(prompt, request)


def continued_by(head: Head, request: StrataRequest) -> bool:
    """Whether ``request``'s prompt starts with the whole prompt ``head``'s state was made from."""
    return continued_by_prompt(head.prompt, request)
