"""A slot's saved state as blocks of tokens: what a backend that can cut its state offers.

An engine writes a slot's state as one file. A backend that knows that file's layout can
cut it into blocks of ``B`` tokens (each block: its tokens and the bytes the engine keeps
for them) and a tail (the tokens past the last whole block), and join blocks back into a
file the engine restores. The first ``k`` blocks joined alone are the state of the first
``k * B`` tokens: a prefix the engine restores and then reads the rest of a prompt on.

The bytes of a block depend only on the tokens up to its end and on the state's
``layout`` (what the bytes mean: the cache's types, row sizes, how values are laid out),
which a store of blocks puts into their names. Some bytes belong to the state's end
alone: a sliding-window model's window cache holds only the cells of the last window, so
it is kept as the state's ``window``, and such a state joins only whole, with its window.
What the format does not cover it refuses with a :class:`StateRefusal` naming the
reason; such a state is kept whole.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

__all__ = ["StateBlock", "CutState", "StateRefusal", "StateFormat"]


@dataclass(frozen=True)
class StateBlock:
    """Tokens and the engine's bytes for them (``cells`` of them hold state)."""

    tokens: tuple[int, ...]
    #: The engine's bytes (a store may hand a view of a file it mapped).
    data: bytes | memoryview
    #: How many of the tokens the data holds state for: a tail may end on a token the
    #: engine has not read yet (the last one it generated).
    cells: int

    def __post_init__(self) -> None:
        if not 0 <= self.cells <= len(self.tokens):
            raise ValueError(f"a block of {len(self.tokens)} tokens cannot hold {self.cells} cells")


@dataclass(frozen=True)
class CutState:
    """A state file cut into whole blocks of ``block_tokens`` tokens and a tail."""

    #: What the bytes mean, as the format writes it down (stable for one model, cache
    #: types and attention kernel): blocks cut under one layout join only under it.
    layout: bytes
    #: The engine's number of KV streams when the file was written (a join writes as many).
    n_stream: int
    block_tokens: int
    #: The whole blocks. A format may build a block's data when it is first read (a
    #: store reads only those it lacks): ``tokens`` and ``state_bytes`` need none of them.
    blocks: Sequence[StateBlock]
    #: The tokens past the last whole block (possibly none).
    tail: StateBlock
    #: Every token, the blocks' then the tail's (from the blocks when not given).
    tokens: tuple[int, ...] = ()
    #: The engine's bytes of the state, the blocks' and the tail's (from the blocks when not given).
    state_bytes: int = -1
    #: Bytes that belong to the state's end alone, for the tokens just before it (a
    #: sliding-window model's window cache): the state joins only whole, with them.
    window: StateBlock | None = None

    def __post_init__(self) -> None:
        if not self.tokens:
            object.__setattr__(self, "tokens", tuple(t for b in [*self.blocks, self.tail] for t in b.tokens))
        if self.state_bytes < 0:
            object.__setattr__(self, "state_bytes", sum(len(b.data) for b in [*self.blocks, self.tail]))


@dataclass(frozen=True)
class StateRefusal:
    """Why a state is not cut into blocks (it is then kept whole).

    ``reason`` is one of a small set of words a caller may count (``state_version``,
    ``tokens_format``, ``media``, ``streams``, ``cells``, ``shifted``, ``swa``, ``recurrent``,
    ``layout``, ``empty``, ``unreadable``); ``detail`` says what was found.
    """

    reason: str
    detail: str = ""

    def __str__(self) -> str:
        return f"{self.reason}: {self.detail}" if self.detail else self.reason


class StateFormat(Protocol):
    """A backend's knowledge of its engine's state file (``Engine.state_format``)."""

    #: Names the engine's state version and this format's own; part of every block's name.
    version: str

    def cut(self, path: Path, block_tokens: int) -> CutState | StateRefusal:
        """Read the state file at ``path`` and cut it; a :class:`StateRefusal` for a state the
        format does not cover or a file it cannot read (never an exception)."""
        ...

    def tokens(self, path: Path) -> tuple[int, ...] | StateRefusal:
        """The tokens the state file at ``path`` holds, read from its head alone (its cells
        are not read); a :class:`StateRefusal` for a file it cannot read (never an exception)."""
        ...

    def join(self, layout: bytes, blocks: Sequence[StateBlock], dest: Path, *, n_stream: int = 1,
             window: StateBlock | None = None) -> int:
        """Write ``blocks`` (whole blocks, the last one possibly partial), cut under
        ``layout``, as one state file at ``dest``, with the ``window`` cut with them when
        the layout has one; returns the bytes written.

        :raises ValueError: when the blocks do not fit the layout or one another, or a
            window is missing, given where the layout has none, or cut at another end.
        """
        ...
