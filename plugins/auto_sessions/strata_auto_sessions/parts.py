"""What every step of parking works with (:class:`Parts`), and the parts that keep state
between requests, each the one writer of its state.

The steps are modules of functions, one decision each: what is saved (:mod:`saving`), what
is restored (:mod:`restoring`) and, without a file of its own, from which conversation
(:mod:`fallback`), what is pruned (:mod:`pruning`), when an idle slot is saved
(:mod:`idle`), what is shared (:mod:`shared.sync`), whether a state is worth it at all
(:mod:`policy`). Each is given the :class:`Parts`, never the plugin's object
(:class:`~strata_auto_sessions.parking.AutoSessions`, which decides around each request,
builds the parts and is the only one to replace any): a step reads the settings, the
store and the cost rule, adds to the counters, and changes what is kept between requests
through the part that keeps it.

Which part keeps which state, and what changes it:

- the files and the blocks: ``store`` (:class:`~strata_auto_sessions.store.ParkingStore`),
  by its methods, under the slot directory's lock;
- the counters: ``stats``; each step adds to its own;
- whether parking acts: ``status`` (:class:`~strata_auto_sessions.mode.ParkingStatus`), by
  its ``stop``, ``pause`` and ``judge``;
- each key's siblings: ``siblings`` (:class:`~strata_auto_sessions.siblings.SiblingIndex`);
- what the slot holding a key holds: ``prompts`` (:class:`HeldPrompts`): a request ran, a
  file was restored, a conversation was removed;
- the files restored since their sidecar was written: ``restored``
  (:class:`RestoredSinceWritten`): a restore marks, a save or a touch clears;
- each slot's state last found on file: ``saved_states``, by :mod:`saving` alone;
- the engine's fingerprint: ``fingerprint``, by ``AutoSessions`` at start and when the
  engine restarts;
- the fsyncs under way: ``syncs`` (:class:`~strata_auto_sessions.syncing.BackgroundSyncs`);
- what ``sessions rm`` reads as in use: ``in_use`` (:class:`~strata_auto_sessions.in_use.InUseRecord`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from strata_auto_sessions.config import AutoSessionsConfig
from strata_auto_sessions.in_use import InUseRecord
from strata_auto_sessions.parked_blocks import ParkedBlocks
from strata_auto_sessions.mode import ParkingMode, ParkingStatus
from strata_auto_sessions.policy import Costs
from strata_auto_sessions.siblings import SiblingIndex
from strata_auto_sessions.staging import Staging
from strata_auto_sessions.stats import AutoSessionsStats
from strata_auto_sessions.store import ParkingStore, SessionStore
from strata_auto_sessions.syncing import BackgroundSyncs

__all__ = ["HeldPrompts", "Parts", "RestoredSinceWritten", "Uploads"]


class Uploads(Protocol):
    """What saving tells the shared tier (:class:`~strata_auto_sessions.shared.sync.SharedParking`)."""

    def saved(self, name: str) -> None:
        """File ``name`` was saved: upload it in the background."""


class HeldPrompts:
    """By conversation key, the prompt signature (:func:`~strata_auto_sessions.prompts.prompt_signature`)
    of what the slot holding it holds: of the last request that ran there, or of the file
    restored since. Only the held conversation's is needed; a few more are kept."""

    #: Keys kept at most, the least recently changed out first.
    KEPT = 64

    def __init__(self) -> None:
        self._by_key: dict[str, dict[str, Any]] = {}

    def get(self, key: str) -> dict[str, Any] | None:
        return self._by_key.get(key)

    def ran(self, key: str, signature: dict[str, Any]) -> None:
        """A request of ``key`` ran: its slot holds ``signature``'s prompt."""
        self._by_key.pop(key, None)
        self._by_key[key] = signature
        while len(self._by_key) > self.KEPT:
            self._by_key.pop(next(iter(self._by_key)))

    def restored(self, key: str, prompt: dict[str, Any] | None) -> None:
        """A file of ``key`` was restored (or brought back from the engine's RAM): the slot
        holds the prompt it was saved with, when it recorded one."""
        if prompt is not None:
            self._by_key[key] = prompt

    def forget(self, key: str) -> None:
        self._by_key.pop(key, None)


class RestoredSinceWritten:
    """Files restored since their sidecar's ``last_used`` was written, ``(key, sibling)``: a
    save rewrites the sidecar (its last use now); a file that goes back to disk unchanged
    has its sidecar touched then, not on the restore's path."""

    def __init__(self) -> None:
        self._files: set[tuple[str, int]] = set()

    def restored(self, key: str, sibling: int) -> None:
        self._files.add((key, sibling))

    def written(self, key: str, sibling: int) -> None:
        """Its sidecar was written: its last use is recorded."""
        self._files.discard((key, sibling))

    def take(self, key: str, sibling: int) -> bool:
        """Whether the file was restored since its sidecar was written; from now on it was not."""
        if (key, sibling) not in self._files:
            return False
        self._files.discard((key, sibling))
        return True


@dataclass
class Parts:
    """What every step of parking works with (the module's docstring says who changes what)."""

    config: AutoSessionsConfig
    store: ParkingStore | None
    stats: AutoSessionsStats
    status: ParkingStatus
    costs: Costs
    siblings: SiblingIndex
    fingerprint: dict[str, Any]
    syncs: BackgroundSyncs
    in_use: InUseRecord
    prompts: HeldPrompts = field(default_factory=HeldPrompts)
    restored: RestoredSinceWritten = field(default_factory=RestoredSinceWritten)
    #: By slot, the state (:func:`strata_auto_sessions.saving.state_of`) its file was last
    #: found or made current for: the same state later is still on file.
    saved_states: dict[int, tuple[Any, ...]] = field(default_factory=dict)
    #: The shared tier, told of each save (``plugins.auto_sessions.shared``), or None.
    uploads: Uploads | None = None

    @property
    def blocks(self) -> ParkedBlocks | None:
        """Where the store parks conversations in blocks of tokens; None: as whole files
        (``blocks = false``, or a store of a plugin's that is no
        :class:`~strata_auto_sessions.store.SessionStore`: only those park blocks)."""
        return self.store.blocks if isinstance(self.store, SessionStore) else None

    @property
    def staging(self) -> Staging | None:
        """Where the engine's saves are staged in memory and the newest states kept whole
        (:mod:`strata_auto_sessions.staging`); None: nowhere (whole files, or no stage)."""
        return self.store.staging if isinstance(self.store, SessionStore) else None

    @property
    def mode(self) -> ParkingMode:
        """Whether parking acts now (``mode.parks``), and if not, why."""
        return self.status.mode
