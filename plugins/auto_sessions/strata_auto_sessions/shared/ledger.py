"""The shared tier's ledger: which head each local file's conversation has, which generation the file holds.

A file's name says nothing of its conversation's head (sibling numbers are chosen by
each server): the head found for it is remembered here, beside the files
(``auto-.shared.json``, a name no conversation file takes), with the generation the file
was made from and whether it was saved since, so that an upload pending at a stop is
tried again at the next start. It holds the files present alone, and is written only
when it changes.
"""

from __future__ import annotations

import json
import threading
import uuid
from dataclasses import dataclass
from pathlib import Path

from strata_auto_sessions.naming import PREFIX, SESSION_NAME, TEMP_PREFIX
from strata_auto_sessions.sidecar import write_private

__all__ = ["LEDGER_NAME", "Ledger", "LedgerEntry", "sidecar_name", "temp_for"]

#: Which generation of the shared tier each local file holds, beside the files.
LEDGER_NAME = f"{PREFIX}.shared.json"


def sidecar_name(name: str) -> str:
    """The sidecar of conversation file ``name`` (``auto-x.bin`` -> ``auto-x.json``, and
    ``auto-x.1.bin`` -> ``auto-x.1.json`` for a sibling)."""
    return name[: -len(".bin")] + ".json"


def temp_for(name: str, suffix: str) -> str:
    """A temporary's name in the slot directory for file ``name``: one the next start sweeps."""
    return f"{TEMP_PREFIX}{name[len(PREFIX):].split('.')[0]}-{uuid.uuid4().hex[:8]}{suffix}"


@dataclass
class LedgerEntry:
    """What the ledger says of a local file: the head in the shared tier that is its
    conversation's (``shared``; None while it has none), and the generation of that head
    the file is, or was made from (``dirty``: saved here since, not uploaded yet)."""

    generation: int
    dirty: bool = False
    shared: str | None = None


class Ledger:
    """``auto-.shared.json``: local file name -> :class:`LedgerEntry`.

    It holds the files present here alone: an entry whose file went (pruned, removed) is
    dropped at load and at each save, and the file is written only when what it says
    changed."""

    def __init__(self, path: Path):
        self.path = path
        self.entries: dict[str, LedgerEntry] = {}
        #: What the file holds now (None: not read or written yet), and its rendering's number.
        self._written: str | None = None
        self._written_number = 0
        self._rendered = 0
        self._writing = threading.Lock()

    def load(self) -> None:
        try:
            text = self.path.read_text()
            raw = json.loads(text)
        except (OSError, ValueError):
            return
        if isinstance(raw, dict):
            for name, entry in raw.items():
                if SESSION_NAME.fullmatch(name) is None or not name.endswith(".bin"):
                    continue
                if isinstance(entry, dict) and type(entry.get("generation")) is int:
                    # An earlier version's entry names no head: its file's own name was its head's.
                    shared = entry.get("shared", name)
                    self.entries[name] = LedgerEntry(entry["generation"], entry.get("dirty") is True,
                                                     shared if isinstance(shared, str) else None)
        self._written = text
        self.drop_gone()

    def drop_gone(self) -> None:
        """Forget the files no longer here."""
        for name, entry in list(self.entries.items()):
            # (a conversation parked in blocks has its sidecar and no file)
            if not (self.path.parent / name).is_file() and not (self.path.parent / sidecar_name(name)).is_file() \
                    and self.entries.get(name) is entry:
                del self.entries[name]

    def render(self) -> tuple[int, str]:
        """What the file is to hold now, numbered: taken where the entries change (the
        event loop), so a write in a thread never reads them half-changed."""
        self.drop_gone()
        self._rendered += 1
        return self._rendered, json.dumps({name: {"generation": e.generation, "dirty": e.dirty,
                                                  "shared": e.shared}
                                           for name, e in sorted(self.entries.items())})

    def write(self, number: int, text: str) -> None:
        """Write what :meth:`render` gave, unless the file holds it already or a later
        rendering was written first (writes in threads may finish out of order: the
        file never goes back to an older one)."""
        with self._writing:
            if number <= self._written_number or text == self._written:
                return
            write_private(self.path, self.path.with_name(temp_for(f"{PREFIX}ledger", ".json")), text.encode())
            self._written, self._written_number = text, number

    def save(self) -> None:
        self.write(*self.render())

    def pending(self) -> list[str]:
        """The files saved here and not uploaded yet."""
        return sorted(name for name, entry in self.entries.items() if entry.dirty)
