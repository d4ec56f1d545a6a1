"""Calling hooks so that one plugin's failure stays its own.

The service and the app call the plugins' hooks through these, one implementation at a
time: an implementation that raises is logged with its plugin's name and the others run.
The plugin manager itself is built in :mod:`strata_serve.plugins`, above the hooks'
specifications; this module needs neither, so the service below them can call hooks.
"""

from __future__ import annotations

import inspect
import logging
import time
import weakref
from typing import Any
from collections.abc import Iterable

import pluggy

from strata_serve.timing import TIMED_HOOKS, current_timeline, span_name

log = logging.getLogger("strata_serve.plugins")


#: Plugin managers with STRATA_TRACE_PLUGINS on; our own dispatch logs for them too.
_traced: weakref.WeakSet[pluggy.PluginManager] = weakref.WeakSet()


def _trace(pm: pluggy.PluginManager, hook_name: str, plugin: str, result: Any) -> None:
    # Called for every implementation of every hook: asking the (most often empty) set
    # first spares the weak reference a membership test makes.
    if _traced and pm in _traced:
        log.info("[trace] %s -> %s returned %r", hook_name, plugin, result)


def call_impl(impl: pluggy.HookImpl, kwargs: dict[str, Any]) -> Any:
    return impl.function(*[kwargs[name] for name in impl.argnames])


async def broadcast(pm: pluggy.PluginManager, hook_name: str, *,
                    passthrough: tuple[type[Exception], ...] = (), **kwargs: Any) -> list[tuple[str, Any]]:
    """Call every implementation of a hook in pluggy's order, awaiting async ones.

    Unlike ``pm.hook.<name>(...)``, an implementation that raises is logged with its
    plugin's name and the others still run; exceptions of the ``passthrough`` types
    are a plugin's answer, not its failure: they propagate. Returns ``(plugin name,
    result)`` for each implementation that succeeded.
    """
    results = []
    hook = getattr(pm.hook, hook_name)
    # A request's own steps are timed per plugin (strata_serve.timing), outside one not at all.
    timeline = current_timeline() if hook_name in TIMED_HOOKS else None
    # pluggy calls the last registered first (tryfirst/trylast already sorted in).
    for impl in reversed(hook.get_hookimpls()):
        name = impl.plugin_name
        began = time.perf_counter()
        try:
            result = call_impl(impl, kwargs)
            # Most implementations are plain functions that return None: await only what
            # needs it, without a coroutine of our own around every call.
            if result is not None and inspect.isawaitable(result):
                result = await result
            if timeline is not None:
                timeline.add(f"{hook_name}.{span_name(name)}", (time.perf_counter() - began) * 1000)
            _trace(pm, hook_name, name, result)
            results.append((name, result))
        except passthrough:
            raise
        except Exception:
            log.exception("plugin %s failed in %s; carrying on without it", name, hook_name)
    return results


def call_each_sync(pm: pluggy.PluginManager, hook_name: str, **kwargs: Any) -> list[tuple[str, Any]]:
    """Synchronous :func:`broadcast`, for hooks that must not be async."""
    return list(_iter_sync(pm, hook_name, kwargs))


def first_result(
    pm: pluggy.PluginManager,
    hook_name: str,
    *,
    order: Iterable[str] = (),
    passthrough: tuple[type[Exception], ...] = (),
    **kwargs: Any,
) -> Any:
    """A firstresult hook, called so that a raising plugin is logged and skipped.

    ``order`` names plugins to ask first, in that order; the others follow in
    pluggy's order. Exceptions of the ``passthrough`` types are a plugin's answer,
    not its failure: they propagate.
    """
    for _name, result in _iter_sync(pm, hook_name, kwargs, order, passthrough):
        if result is not None:
            return result
    return None


def _iter_sync(
    pm: pluggy.PluginManager,
    hook_name: str,
    kwargs: dict[str, Any],
    order: Iterable[str] = (),
    passthrough: tuple[type[Exception], ...] = (),
):
    hook = getattr(pm.hook, hook_name)
    impls = list(reversed(hook.get_hookimpls()))
    if order:
        rank = {name: index for index, name in enumerate(order)}
        # sorted() is stable: plugins not named keep pluggy's order, after the named ones.
        impls.sort(key=lambda impl: rank.get(impl.plugin_name, len(rank)))
    for impl in impls:
        name = impl.plugin_name
        try:
            result = call_impl(impl, kwargs)
        except passthrough:
            raise
        except Exception:
            log.exception("plugin %s failed in %s; carrying on without it", name, hook_name)
            continue
        if inspect.isawaitable(result):
            _close_awaitable(result)
            log.error("plugin %s: %s must be synchronous; its result is ignored", name, hook_name)
            continue
        _trace(pm, hook_name, name, result)
        yield name, result


def _close_awaitable(value: Any) -> None:
    close = getattr(value, "close", None)
    if close is not None:
        close()
