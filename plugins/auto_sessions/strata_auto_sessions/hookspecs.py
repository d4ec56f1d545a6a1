"""Hooks auto-sessions offers other plugins (added to the plugin manager by the core).

A plugin implements them with ``@strata_serve.hookimpl`` like any strata-serve hook.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    from strata_auto_sessions.store import ParkingStore

hookspec = pluggy.HookspecMarker("strata_serve")


@hookspec(firstresult=True)
def auto_sessions_store(directory: Path, service: Any) -> ParkingStore | None:
    """Where parked sessions rest: return a :class:`~strata_auto_sessions.store.ParkingStore`.

    The engine writes and reads slot files only in its slot directory (``directory``),
    so every store works there; one may also keep the files elsewhere (another disk,
    an object store shared by several servers), copying each file out after
    :meth:`~ParkingStore.commit` and back in :meth:`~ParkingStore.stage`. The default
    is :class:`~strata_auto_sessions.store.SessionStore`, the slot directory alone.
    Stops at the first non-None result; return None to defer.

    :param directory: The engine's slot directory.
    :param service: The running service.
    """
