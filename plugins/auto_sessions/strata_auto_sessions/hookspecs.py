"""Hooks auto-sessions offers other plugins (added to the plugin manager by the core).

A plugin implements them with ``@strata_serve.hookimpl`` like any strata-serve hook.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    from strata_serve import Service, Verdict
    from strata_auto_sessions.policy import Costs
    from strata_auto_sessions.config import SharedConfig
    from strata_auto_sessions.prefix import ParkedConversation
    from strata_auto_sessions.shared import SharedTier
    from strata_auto_sessions.store import ParkingStore

hookspec = pluggy.HookspecMarker("strata_serve")


@hookspec(firstresult=True)
def auto_sessions_store(directory: Path, service: Service) -> ParkingStore | None:
    """Where parked sessions rest: return a :class:`~strata_auto_sessions.store.ParkingStore`.

    The engine writes and reads slot files only in its slot directory (``directory``),
    so every store works there; one may also keep the files elsewhere (another disk,
    an object store shared by several servers), copying each file out after
    :meth:`~ParkingStore.commit` and back in :meth:`~ParkingStore.stage`. A key may have
    several files, its siblings (conversations that share the key), told apart by the
    ``sibling`` the store's methods take (0, the plain name, by default) and each sidecar
    names; a store whose methods take no ``sibling``, or that has no ``siblings(key)``,
    keeps one file a key. The default
    is :class:`~strata_auto_sessions.store.SessionStore`, the slot directory alone. A
    subclass of it parks whole files (its ``bin_name`` files are there to copy) unless it
    sets ``parks_blocks = True``: then, with ``blocks = true``, a conversation may be a
    sidecar and a manifest in the block store, and no file.
    Stops at the first non-None result; return None to defer.

    :param directory: The engine's slot directory.
    :param service: The running service.
    """


@hookspec(firstresult=True)
def auto_sessions_shared_tier(config: SharedConfig, service: Service) -> SharedTier | None:
    """The tier several servers share their parked conversations through: return a
    :class:`~strata_auto_sessions.shared.SharedTier`, or None to defer to the one
    ``config.url`` names (``file://`` a shared directory, ``s3://`` a bucket).

    Asked at start when ``[plugins.auto_sessions.shared]`` is set. The tier is checked
    before use (:func:`~strata_auto_sessions.shared.check_conditions`): one that accepts a
    conditional write it should refuse is not used. Stops at the first non-None result.

    :param config: ``plugins.auto_sessions.shared``.
    :param service: The running service.
    """


@hookspec(firstresult=True)
def auto_sessions_fallback(
    request: Any, chain: dict[str, list], parked: list[ParkedConversation], costs: Costs, service: Service
) -> str | None:
    """Choose a parked conversation to restore when the incoming one has no file of its own.

    Asked at a switch when ``request.conversation_key`` has no file. auto-sessions
    restores the chosen conversation's file into the slot, which then holds the incoming
    conversation: the engine reuses what the two share, token by token, and re-reads the
    rest; the incoming conversation's own file is written at its next save, the chosen
    one's file is left as it is. Choosing the conversation the slot already holds
    restores nothing (the engine reuses the slot). Must be synchronous.

    Stops at the first non-None result; return None to defer.

    :param request: The incoming request.
    :param chain: The incoming prompt's chain, ``{"chain": [...], "sizes": [...]}``
        (:func:`strata_auto_sessions.message_chain`).
    :param parked: The conversations to choose from: the same tenant's only, each with a
        file this engine can use (:class:`strata_auto_sessions.ParkedConversation`: its
        ``shared_links(chain["chain"])`` counts the messages it shares), newest first; a
        key with several files (siblings) once per file, and choosing the key restores
        the one of them that shares the most with the incoming prompt.
    :param costs: What re-reading and restoring cost on this engine, as measured
        (:class:`strata_auto_sessions.Costs`: ``prefill_seconds(tokens)``,
        ``restore_seconds(size)``, ``worth(tokens, size)``), the rule auto-sessions decides by.
    :param service: The running service.
    :returns: The key of one of ``parked``, or None.
    """


@hookspec(firstresult=True)
def auto_sessions_restore_unused(
    restored: int, reused: int, prompt_tokens: int | None, engine: Any, service: Service
) -> Verdict | None:
    """Say what a restore the next request did not reuse means for this engine.

    Asked after a restore when the next request, which continued the saved conversation,
    reused less than ``reuse_warn_ratio`` of the tokens restored (a request that changed
    the conversation is not asked about). Answer ``Verdict.UNSUPPORTED`` when the engine
    cannot reuse restored state (auto-sessions pauses parking for ``retry_after_s``,
    doubling), None otherwise. A backend quirk plugin implements it with
    ``@strata_serve.hookimpl(optionalhook=True)``, so it loads without auto-sessions too.
    Must be synchronous.

    Stops at the first non-None result; return None to defer.

    :param restored: Tokens the restore put in the slot.
    :param reused: Tokens of them the next request reused.
    :param prompt_tokens: That request's prompt tokens, when the engine said.
    :param engine: The engine backend (its ``info`` tells model, build, flags).
    :param service: The running service (keep per-server state in ``service.state``).
    :returns: A :class:`strata_serve.Verdict`, or None when this plugin has no opinion.
    """
