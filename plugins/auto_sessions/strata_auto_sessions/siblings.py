"""Siblings: the conversations parked under one key, a file each.

A key guessed from the prompt (the opening's hash, by default) is shared by every
conversation that opens alike: Aider's sessions all begin with the same worked example,
Codex's in one directory with the same instructions, chat UIs with "hi". Each such
conversation gets a file of its own under the key, its *sibling*
(``auto-<key>.bin``, then ``auto-<key>.1.bin``...), so none overwrites another's.

Which sibling a request is, from the prompts the siblings were saved with (their digests,
kept here in memory, so a turn under a known key lists no directory):

1. the one whose whole saved prompt the request's prompt starts with (the longest, if
   several): the request continues it;
2. else, when the key names one conversation (``request.conversation_named``: a session id
   the client sent), that one: the sibling sharing the longest opening with the request
   (then the most recent) is restored and saved over;
3. else a new sibling, started from the sibling sharing the longest opening, at least one
   message (its reuse is still worth it); no sibling is changed.

A key keeps at most ``plugins.auto_sessions.siblings`` of them, the least recently used
pruned first (:meth:`ParkingStore.prune_siblings`).
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from strata_serve import StrataRequest, prompt_units

from strata_auto_sessions.prefix import message_chain, shared_links
from strata_auto_sessions.prompts import continues
from strata_auto_sessions.sidecar import Sidecar

log = logging.getLogger("strata_auto_sessions")

#: Keys whose siblings are kept in memory (the most recently asked); another is read again.
KEYS_KEPT = 256


@dataclass(frozen=True)
class Sibling:
    """One file of a key, as its choice needs it."""

    sibling: int
    #: The prompt it was saved with (:func:`strata_auto_sessions.prompts.prompt_signature`).
    prompt: dict[str, Any] | None
    last_used: float


@dataclass(frozen=True)
class Choice:
    """Which sibling a request is, and which one its state comes from."""

    #: The sibling the request is: its state is saved there.
    sibling: int
    #: The sibling restored for it (None: none of the key's; a fallback may choose another key's).
    source: int | None
    #: Whether the request continues ``source``'s whole saved prompt.
    continued: bool
    #: Messages the request shares with ``source`` from the start.
    shared: int = 0
    #: Whether ``sibling`` is a new one beside the key's others (the request continues none).
    new: bool = False


class SiblingIndex:
    """The siblings of each key, read from the store once and kept current as files of the
    key are written and removed."""

    def __init__(self, store: Any):
        self.store = store
        self._keys: OrderedDict[str, dict[int, Sibling]] = OrderedDict()
        #: Times a key's siblings were read from the store.
        self.reads = 0

    def of(self, key: str) -> dict[int, Sibling]:
        """``key``'s siblings by number."""
        known = self._keys.get(key)
        if known is None:
            known = self._read(key)
            self._keys[key] = known
            while len(self._keys) > KEYS_KEPT:
                self._keys.popitem(last=False)
        self._keys.move_to_end(key)
        return known

    def _read(self, key: str) -> dict[int, Sibling]:
        self.reads += 1
        try:
            sidecars = self.store.siblings(key)
        except OSError as exc:
            log.warning("[strata] auto sessions: cannot list %s's files: %s", key, exc)
            return {}
        return {sidecar.sibling: _entry(sidecar) for sidecar in sidecars if sidecar.key == key}

    def written(self, key: str, sidecar: Sidecar) -> None:
        """A file of ``key`` was written with ``sidecar``."""
        self.of(key)[sidecar.sibling] = _entry(sidecar)

    def used(self, key: str, sibling: int) -> None:
        """A sibling was restored: it is the most recently used."""
        known = self._keys.get(key, {}).get(sibling)
        if known is not None:
            self._keys[key][sibling] = Sibling(sibling, known.prompt, time.time())

    def removed(self, key: str, sibling: int) -> None:
        """A file of ``key`` is gone."""
        self._keys.get(key, {}).pop(sibling, None)

    def forget(self, key: str) -> None:
        """Files of ``key`` changed in a way not followed here: read them again when asked."""
        self._keys.pop(key, None)

    def choose(self, key: str, request: StrataRequest, held: Sibling | None, one: bool = False) -> Choice:
        """Which sibling of ``key`` the request is (see the module's text). ``held`` is the
        sibling a slot holds now, with the prompt it holds (its file may be older); ``one``:
        the key keeps one conversation whatever the request (its client named it, or
        ``siblings`` is 1)."""
        siblings = dict(self.of(key))
        if held is not None:
            siblings[held.sibling] = held
        continued = [s for s in siblings.values() if continues(s.prompt, request)]
        if continued:
            best = max(continued, key=lambda s: (s.prompt["units"], s.last_used))  # type: ignore[index]
            return Choice(best.sibling, best.sibling, True, len((best.prompt or {}).get("chain") or ()))
        units = prompt_units(request)
        chain = message_chain(request.body, units)["chain"] if isinstance(units, list) else []
        ranked = sorted(siblings.values(), reverse=True,
                        key=lambda s: (shared_links((s.prompt or {}).get("chain") or [], chain), s.last_used))
        best_shared = ranked[0] if ranked else None
        shared = shared_links((best_shared.prompt or {}).get("chain") or [], chain) if best_shared else 0
        unknown = [s for s in siblings.values() if s.prompt is None]
        if unknown and shared == 0:
            # A file saved before prompts were recorded: nothing tells it from this
            # request's conversation, so it is taken for it, as it always was.
            best = max(unknown, key=lambda s: s.last_used)
            return Choice(best.sibling, best.sibling, False)
        if one or request.conversation_named:
            # The client's id names one conversation: its prompt changed (a resumed session
            # re-sent differently), it is no other one.
            if best_shared is None:
                return Choice(0, None, False)
            return Choice(best_shared.sibling, best_shared.sibling, False, shared)
        new = next(n for n in range(len(siblings) + 1) if n not in siblings)
        if best_shared is None or shared == 0:
            return Choice(new, None, False, new=bool(siblings))
        return Choice(new, best_shared.sibling, False, shared, new=True)


def _entry(sidecar: Sidecar) -> Sibling:
    return Sibling(sidecar.sibling, sidecar.prompt, sidecar.last_used)
