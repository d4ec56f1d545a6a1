"""Whether auto-sessions parks now: one answer, :class:`ParkingMode`, kept by :class:`ParkingStatus`."""

from __future__ import annotations

import logging
import time
from enum import Enum

log = logging.getLogger("strata_auto_sessions")


class ParkingMode(Enum):
    """What auto-sessions does around requests now."""

    #: Conversations are saved and restored.
    ON = "on"
    #: No state of this engine is worth a file (its model uses a sliding window and it
    #: runs without ``--swa-full``): nothing is saved, and each file is refused, counted.
    NOT_SAVING = "not saving"
    #: Restores of continued conversations went unused: nothing is done until it resumes.
    PAUSED = "paused"
    #: For good: there is no store, or the engine said it cannot save or restore slots.
    OFF = "off"

    @property
    def parks(self) -> bool:
        """Whether auto-sessions acts around requests (saves, restores, idle saves)."""
        return self in (ParkingMode.ON, ParkingMode.NOT_SAVING)


class ParkingStatus:
    """The mode and why it is not :attr:`ParkingMode.ON`.

    A stop is for good; a pause ends by itself; the engine's judgment (whether its
    state is worth a file) is taken again when the engine restarts. A stop outranks a
    pause, which outranks the judgment.
    """

    def __init__(self, *, stopped: str | None = None):
        #: Why parking stopped for good, or None.
        self._stopped = stopped
        #: While paused, the monotonic time parking resumes.
        self._resumes_at: float | None = None
        #: Why no state of this engine is worth a file (``store.swa_unusable``), or None.
        self._not_saving: str | None = None

    @property
    def mode(self) -> ParkingMode:
        """The mode now (a pause whose time is up ends here, logged)."""
        if self._stopped is not None:
            return ParkingMode.OFF
        if self._resumes_at is not None:
            if time.monotonic() < self._resumes_at:
                return ParkingMode.PAUSED
            self._resumes_at = None
            log.info("[strata] auto sessions: parking resumes")
        return ParkingMode.ON if self._not_saving is None else ParkingMode.NOT_SAVING

    def stop(self, why: str) -> None:
        """Parking stops for good (said once)."""
        if self._stopped is None:
            log.warning("[strata] auto sessions: parking stopped: %s", why)
            self._stopped = why

    def pause(self, seconds: float, why: str) -> None:
        """Parking pauses for ``seconds``."""
        self._resumes_at = time.monotonic() + seconds
        log.warning("[strata] auto sessions: parking paused for %.0f s: %s", seconds, why)

    def judge(self, not_saving: str | None) -> None:
        """The engine's state is worth no file for the reason ``not_saving`` (None: it is
        worth one); said once, when it changes."""
        if not_saving is not None and not_saving != self._not_saving:
            log.warning("[strata] auto sessions: conversations are neither saved nor restored: %s. Start the "
                        "engine with --swa-full (engine.extra_args) to park them: its cache then keeps the "
                        "whole context for the sliding layers too, which takes more memory", not_saving)
        elif not_saving is None and self._not_saving is not None:
            log.info("[strata] auto sessions: the engine now keeps its whole context: parking resumes")
        self._not_saving = not_saving
