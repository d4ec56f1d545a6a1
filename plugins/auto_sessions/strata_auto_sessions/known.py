"""What the store has read or checked already, kept while the file on disk is unchanged.

Pruning, counting and listing read every sidecar in the slot directory, several times a
save; a restore reads up to 4 MiB of its file for the digest the save computed a moment
before. Both are kept here, each under the file's identity (:func:`identity`): a file
changed in any way since (written, truncated, replaced by a rename, its times set by
hand) has another identity, and is read again.
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

from strata_auto_sessions.sidecar import DamagedSidecar, Sidecar

#: More entries than this and the memory is dropped whole (files come and go; the next
#: reads fill it again).
MOST_KEPT = 4096

Identity = tuple[int, int, int, int, int]


def identity(stat: os.stat_result) -> Identity:
    """What changes whenever a file does: a rename over it changes the inode; a write, a
    truncation, a change of mode or links the change time (which no one sets by hand, as
    they can the modification time)."""
    return stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns


class KnownFiles:
    """Sidecars read, and digests of state files checked, by the file's identity."""

    def __init__(self) -> None:
        self._sidecars: dict[Path, tuple[Identity, Sidecar | DamagedSidecar]] = {}
        self._digests: dict[Path, tuple[Identity, str]] = {}

    def sidecar(self, path: Path) -> Sidecar:
        """:meth:`Sidecar.load`, read again only when the file changed.

        :raises OSError: when it cannot be read (missing, among others).
        :raises DamagedSidecar: when it is not a sidecar.
        """
        its = identity(os.stat(path))
        known = self._sidecars.get(path)
        if known is not None and known[0] == its:
            found = known[1]
        else:
            try:
                found = Sidecar.load(path)
            except DamagedSidecar as exc:
                found = exc
            self._keep(self._sidecars, path, (its, found))
        if isinstance(found, DamagedSidecar):
            raise DamagedSidecar(str(found))
        return replace(found)  # the caller's to change (a touch sets its last use)

    def digest_known(self, path: Path, stat: os.stat_result, digest: str) -> bool:
        """Whether ``path``, as ``stat`` found it, is the very file whose digest was
        found to be ``digest`` (:meth:`remember_digest`)."""
        known = self._digests.get(path)
        return known is not None and known == (identity(stat), digest)

    def remember_digest(self, path: Path, digest: str) -> None:
        """``path``'s digest is ``digest`` (computed from it, or checked against it), as
        the file is now."""
        try:
            its = identity(os.stat(path))
        except OSError:
            return
        self._keep(self._digests, path, (its, digest))

    @staticmethod
    def _keep(memory: dict, path: Path, entry: tuple) -> None:
        if len(memory) >= MOST_KEPT:
            memory.clear()
        memory[path] = entry
