"""Writes to a client never hold the engine: an answer is held for a client that reads
slowly, for a bounded time and within a bounded memory (the relay's :class:`ClientWrites`)."""

from __future__ import annotations

import asyncio
import logging
import os

from aiohttp import web

log = logging.getLogger("strata_serve.api")


#: The most of its answer held for a client that reads slower than the engine writes: a
#: bound against runaway memory far above any answer (8,192 tokens, each with 20
#: ``logprobs``, are about 25 MB).
CLIENT_BUFFER_BYTES = 256 * 1024 * 1024
#: The most held at once, over every connection, for clients still reading answers whose
#: turn has ended: a client whose unread answer would pass it is cut off at once (without
#: it, clients that never read could each leave an answer in memory, turn after turn).
CLIENTS_HELD_BYTES = 512 * 1024 * 1024


def let_the_client_read() -> None:
    """An answer's last bytes are written: give up the CPU once, so that the client they woke
    reads them now, not after the work that follows them here.

    A socket's write wakes its reader synchronously: Linux puts the reader on the writer's
    CPU, counting on the writer to wait next. strata-serve does not wait there: the plugins'
    ``post_request`` steps and the handler's end run on (about 0.3 ms after a plain answer,
    measured on a 2-core machine), and a client woken on that CPU waited for all of it
    before it read its answer. With nothing else ready on the CPU, the yield comes
    straight back.
    """
    if _sched_yield is not None:
        _sched_yield()


_sched_yield = getattr(os, "sched_yield", None)  # on every Unix


class ClientWrites:
    """The engine never waits for a client: writes to it never block while the turn is held.

    While the request holds its FIFO turn, the connection's write buffer takes the whole
    answer (up to :data:`CLIENT_BUFFER_BYTES`), so a client that stops reading never stops
    the relay reading the engine's answer, nor holds the FIFO past the engine's end. Once
    the turn is over, :meth:`drained` waits for the client to take what is left, for
    ``server.client_write_timeout_s`` at most; a client that does not is cut off.
    """

    #: Bytes held now for clients in :meth:`drained`, over every connection.
    held = 0

    def __init__(self, request: web.Request) -> None:
        transport = request.transport
        self._request = request
        self._transport: asyncio.WriteTransport | None = None
        self._limits: tuple[int, int] | None = None
        if transport is not None and not transport.is_closing():
            self._transport = transport
            self._limits = transport.get_write_buffer_limits()
            transport.set_write_buffer_limits(high=CLIENT_BUFFER_BYTES)

    def restore(self, high: int | None = None, low: int | None = None) -> None:
        """The connection's own limits again (or these)."""
        transport = self._transport
        if transport is None or self._limits is None or transport.is_closing():
            return
        if high is None:
            low, high = self._limits
        transport.set_write_buffer_limits(high=high, low=low)

    async def drained(self, timeout: float, request_id: int) -> None:
        """Wait until the client has taken the whole answer, for ``timeout`` seconds at most;
        then its connection is closed, and logged."""
        transport = self._transport
        if transport is None or transport.is_closing() or not transport.get_write_buffer_size():
            self.restore()
            return
        unread = transport.get_write_buffer_size()
        if ClientWrites.held + unread > CLIENTS_HELD_BYTES:
            log.warning("[strata] request %d: %s bytes of its answer unread, and answers of %s bytes are "
                        "already held for clients that read slowly; its connection is closed",
                        request_id, f"{unread:,}", f"{ClientWrites.held:,}")
            transport.abort()
            return
        ClientWrites.held += unread
        self.restore(high=0, low=0)  # writing pauses until every byte is gone, so a drain waits for them
        try:
            async with asyncio.timeout(timeout):
                await self._request.writer.drain()
        except TimeoutError:
            log.warning("[strata] request %d: the client did not read its answer within %g s "
                        "(server.client_write_timeout_s): %s bytes unread; its connection is closed",
                        request_id, timeout, f"{transport.get_write_buffer_size():,}")
            transport.abort()
            return
        except ConnectionError:
            return  # it went away: nothing more to send
        finally:
            ClientWrites.held -= unread
        self.restore()
