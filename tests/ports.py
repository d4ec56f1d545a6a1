"""Ports for the servers a test starts as processes, which bind them seconds later.

A port the kernel offers (bound to port 0, then closed) comes from the range it also gives
every outgoing connection its local port from; in the seconds before the server binds it,
any connection on the machine may take it ("address already in use"). A port below that
range is never taken that way.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

#: Where the kernel says its range for outgoing connections begins (Linux).
_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_LOWEST = 10000


def _outgoing_from() -> int:
    try:
        return int(_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def listen_port(host: str = "127.0.0.1") -> int:
    """A port free on ``host`` now, below the range outgoing connections take theirs from."""
    top = _outgoing_from()
    choose = random.SystemRandom().randrange
    for _ in range(200):
        port = choose(_LOWEST, top)
        with socket.socket() as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
        return port
    raise OSError(f"no free port on {host} in {_LOWEST}-{top - 1}")
