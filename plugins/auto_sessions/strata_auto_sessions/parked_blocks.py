"""Parked conversations as blocks of tokens: the slot directory's block store, as the
session store sees it.

A conversation parked in blocks is its sidecar (``auto-<name>.json``, as for a whole file)
and a manifest in the block store (``<slot dir>/blocks``: its chain of blocks and its
tail, see :mod:`strata_auto_sessions.blocks.store`); no ``auto-<name>.bin`` is kept. A
block two conversations of one tenant share is stored once. A state the engine's format
refuses (:class:`strata_serve.StateRefusal`) is parked as a whole file, as earlier versions
did; the reason is counted (:attr:`ParkedBlocks.refusals`).

Every write and removal here runs under the slot directory's lock (the session store's),
so the block store is given no grace for saves under way elsewhere: none can be.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from strata_serve import CutState, StateBlock, StateRefusal

from strata_auto_sessions.blocks import BlockStore, Chain, CorruptBlock, Manifest, PruneReport, SaveReport

__all__ = ["BLOCKS_DIR", "BlockHolding", "CorruptBlock", "ParkedBlocks", "ReadOnlyFormat", "manifest_key"]

log = logging.getLogger("strata_auto_sessions")

#: The block store's directory, inside the slot directory.
BLOCKS_DIR = "blocks"


def manifest_key(key: str, sibling: int) -> str:
    """The name of the manifest of ``key``'s conversation ``sibling`` (the tenant's prefix
    of ``key`` stays first: the store salts the blocks' names with it)."""
    return f"{key}#{sibling}"


def _of_manifest(name: str) -> tuple[str, int] | None:
    key, sep, sibling = name.rpartition("#")
    return (key, int(sibling)) if sep and sibling.isdigit() else None


class ReadOnlyFormat:
    """A state format for reading a store without an engine (``strata-serve sessions``):
    listing, removing and pruning need no cutting or joining."""

    version = ""

    def cut(self, path: Path, block_tokens: int) -> CutState | StateRefusal:
        return StateRefusal("unreadable", "no engine here to read the state")

    def tokens(self, path: Path) -> tuple[int, ...] | StateRefusal:
        return StateRefusal("unreadable", "no engine here to read the state")

    def join(self, layout: bytes, blocks: Sequence[StateBlock], dest: Path, *, n_stream: int = 1,
             window: StateBlock | None = None) -> int:
        raise ValueError("no engine here to write a state")


@dataclass(frozen=True)
class BlockHolding:
    """What one parked conversation holds of the store."""

    tokens: int
    #: Bytes of the objects no other conversation holds.
    own: int
    #: Bytes of the objects it shares with at least one other.
    shared: int
    #: When it was saved or last restored (its manifest's mtime).
    used: float


class ParkedBlocks:
    """The block store of a slot directory, by conversation key and sibling."""

    def __init__(self, store: BlockStore):
        self.store = store
        #: Saves kept whole because the format refused their state, by reason.
        self.refusals: Counter[str] = Counter()
        #: What each conversation's last save did, until the saving step takes it for its
        #: counters (:meth:`take_report`): by conversation, saves of several slots being
        #: committed at once, each in a thread.
        self._reports: dict[tuple[str, int], SaveReport] = {}

    @classmethod
    def open(cls, directory: Path, state_format: Any, *, fingerprint: dict[str, Any], block_tokens: int,
             fsync: bool) -> ParkedBlocks:
        return cls(BlockStore(directory / BLOCKS_DIR, state_format, fingerprint=fingerprint,
                              block_tokens=block_tokens, fsync=fsync, grace_s=0.0))

    @classmethod
    def existing(cls, directory: Path) -> ParkedBlocks | None:
        """The store of ``directory`` for reading and removing, when there is one."""
        if not (directory / BLOCKS_DIR).is_dir():
            return None
        return cls(BlockStore(directory / BLOCKS_DIR, ReadOnlyFormat(), fingerprint={}, grace_s=0.0))

    # -- saving ------------------------------------------------------------------------

    def save(self, key: str, sibling: int, staged: Path) -> SaveReport:
        """Cut the engine's file ``staged`` and keep it as the conversation's manifest
        (only the blocks the store lacks are written); a refused state is left whole,
        its reason counted and logged the first time."""
        report = self.store.save(manifest_key(key, sibling), staged)
        self._reports[(key, sibling)] = report
        if report.refused is not None:
            reason = report.refused.reason
            if not self.refusals[reason]:
                log.info("[strata] auto sessions: a state kept as a whole file, not in blocks (%s); "
                         "said once for this reason", report.refused)
            self.refusals[reason] += 1
        return report

    def take_report(self, key: str, sibling: int) -> SaveReport | None:
        """What the conversation's last :meth:`save` did, once (None: none since taken)."""
        return self._reports.pop((key, sibling), None)

    # -- reading -------------------------------------------------------------------------

    def manifest(self, key: str, sibling: int) -> Manifest | None:
        return self.store.manifest(manifest_key(key, sibling))

    def parked(self) -> set[tuple[str, int]]:
        """``(key, sibling)`` of every conversation with a manifest."""
        return {found for m in self.store.manifests() if (found := _of_manifest(m.key)) is not None}

    def intact(self, key: str, sibling: int, tokens: int) -> bool:
        """Whether the conversation's manifest is the one its sidecar describes and every
        object it names is there (each is checked against its digest when joined)."""
        m = self.manifest(key, sibling)
        return m is not None and m.tokens == tokens and all(self.store.has(name) for name in m.objects())

    def join_into(self, key: str, sibling: int, dest: Path) -> int:
        """The conversation's state as one engine file at ``dest``; its bytes.

        :raises CorruptBlock: a block missing or damaged (removed, so a next save writes it again).
        :raises ValueError: when there is no manifest, or the blocks do not fit the layout.
        """
        chain = self.store.chain_of(manifest_key(key, sibling))
        if chain is None:
            raise ValueError(f"{key} (sibling {sibling}) has no manifest")
        return self.join_chain(chain, dest)

    def longest_prefix(self, tenant: str | None, tokens: Sequence[int]) -> Chain | None:
        """The longest chain of stored blocks of ``tenant`` that prefixes ``tokens``, from any
        conversation's manifest (:meth:`BlockStore.longest_prefix`)."""
        return self.store.longest_prefix(tenant, tokens)

    def matched(self, key: str, sibling: int, tokens: Sequence[int]) -> int:
        """How many of ``tokens``, from the first, the conversation's own manifest holds."""
        return self.store.matched(manifest_key(key, sibling), tokens)

    def join_chain(self, chain: Chain, dest: Path) -> int:
        """``chain``'s blocks as one engine file at ``dest``; its bytes.

        :raises CorruptBlock: a block missing or damaged.
        """
        try:
            return self.store.materialize(chain, dest)
        except BaseException:
            dest.unlink(missing_ok=True)
            raise

    def holdings(self) -> dict[tuple[str, int], BlockHolding]:
        """Per conversation: its tokens, its own and its shared bytes."""
        manifests = [(found, m) for m in self.store.manifests() if (found := _of_manifest(m.key)) is not None]
        sizes = self._sizes()
        holders: Counter[str] = Counter(name for _f, m in manifests for name in set(m.objects()))
        result = {}
        for found, m in manifests:
            names = set(m.objects())
            own = sum(sizes.get(n, 0) for n in names if holders[n] == 1)
            shared = sum(sizes.get(n, 0) for n in names if holders[n] > 1)
            result[found] = BlockHolding(tokens=m.tokens, own=own, shared=shared, used=self._used(m.key))
        return result

    def objects_of(self, key: str, sibling: int) -> set[str]:
        m = self.manifest(key, sibling)
        return set(m.objects()) if m is not None else set()

    def sizes(self) -> dict[str, int]:
        """Bytes of each object in the store."""
        return self._sizes()

    def _sizes(self) -> dict[str, int]:
        return self.store.object_sizes()

    def _used(self, name: str) -> float:
        try:
            return self.store._manifest_path(name).stat().st_mtime
        except FileNotFoundError:
            return 0.0

    def bytes(self) -> int:
        """Bytes of every object, each counted once."""
        return sum(self.store.object_sizes().values())

    # -- removing ------------------------------------------------------------------------

    def remove(self, key: str, sibling: int) -> bool:
        """Forget the conversation's manifest (its blocks go at :meth:`free_unheld`)."""
        return self.store.remove(manifest_key(key, sibling))

    def free_unheld(self, keep: set[tuple[str, int]] | None = None) -> PruneReport:
        """Remove the manifests of conversations not in ``keep`` (when given: those without
        a sidecar), then every object no manifest holds (and temporaries a killed save left)."""
        if keep is not None:
            for found in self.parked() - keep:
                self.remove(*found)
        report = self.store.prune()
        if report.objects_removed:
            log.debug("[strata] auto sessions: freed %d block(s) no conversation holds", report.objects_removed)
        return report
