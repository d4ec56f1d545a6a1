"""The engine's output, read line by line to its end, whatever it writes."""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import AsyncIterator

engine_log = logging.getLogger("strata_serve.engine.output")

#: Of one line of the engine's output, at most this many bytes are kept (logged, remembered).
LOG_LINE_MAX_BYTES = 8192
#: How much of the engine's output is read at once.
READ_CHUNK_BYTES = 64 * 1024


async def read_line_batches(stream: asyncio.StreamReader,
                            max_bytes: int = LOG_LINE_MAX_BYTES) -> AsyncIterator[list[str]]:
    """The lines of ``stream`` until its end, as many at a time as each read completes,
    each cut to ``max_bytes`` (what is cut is counted).

    Reads chunks and splits them here: ``StreamReader.readline`` fails on a line longer
    than the reader's limit (64 KiB), and a reader that stops leaves the writer blocked
    once the pipe is full. A batch per read rather than a step per line: the engine
    writes several lines for every request.
    """
    kept = bytearray()
    cut = 0

    def finish() -> str:
        line = kept.decode("utf-8", "replace").rstrip()
        if cut:
            line += f" [... {cut:,} more bytes not shown]"
        return line

    while chunk := await stream.read(READ_CHUNK_BYTES):
        *ended, rest = chunk.split(b"\n")
        lines = []
        for piece in ended:
            room = max_bytes - len(kept)
            kept += piece[:room]
            cut += max(0, len(piece) - room)
            lines.append(finish())
            kept.clear()
            cut = 0
        room = max_bytes - len(kept)
        kept += rest[:room]
        cut += max(0, len(rest) - room)
        if lines:
            yield lines
    if kept or cut:
        yield [finish()]


async def forward_output(stream: asyncio.StreamReader, level: int, tail: collections.deque[str]) -> None:
    """Log the engine's output line by line at ``level``, to its end, keeping the last
    lines in ``tail``.

    It must read to the end: an engine whose output nobody reads blocks once the
    pipe is full, and its process is not reaped before its output is closed.
    """
    async for batch in read_line_batches(stream):
        lines = [line for line in batch if line]
        tail.extend(lines)
        if engine_log.isEnabledFor(level):  # asked once a batch, not once a line
            for line in lines:
                try:
                    engine_log.log(level, "[strata] engine: %s", line)
                except Exception:  # a broken log handler must not stop the reading
                    pass
