"""Times another run wrote (a sidecar's, a file's modification time), as this run takes
them: a clock set wrong must not keep its files the newest for ever."""

from __future__ import annotations

#: A time at most this far ahead of the clock is taken as now (a clock corrected by a
#: few seconds since); farther ahead, as written by a clock set wrong.
CLOCK_SLACK_S = 300.0


def as_of(stamp: float, now: float) -> float | None:
    """A time a run wrote (a sidecar's, a file's modification time) as this run takes it:
    never later than ``now``; None when more than :data:`CLOCK_SLACK_S` ahead of it."""
    return None if stamp > now + CLOCK_SLACK_S else min(stamp, now)


def last_use(*stamps: float, now: float) -> float | None:
    """When a file was last used, from its times (its modification time, its sidecar's
    ``last_used``): the latest not stamped ahead (:func:`as_of`); None when all are.

    A run with its clock ahead (a year, say) leaves files that would otherwise stay the
    newest, never pruned, until the clock caught up: they count as the oldest instead,
    and a later use (a restore touches the sidecar) makes them current again.
    """
    taken = [value for value in (as_of(stamp, now) for stamp in stamps) if value is not None]
    return max(taken) if taken else None
