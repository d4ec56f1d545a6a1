"""Building the plugin manager: plugins loaded, checked, configured.

Hooks are called through :mod:`strata_serve.hook_calls` (its names are also here, as
before).
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
from dataclasses import dataclass
from typing import Any
from collections.abc import Callable, Iterable

import pluggy

from strata_serve import hookspecs
from strata_serve.config import ConfigError, Settings
from strata_serve.hook_calls import _traced, broadcast, call_each_sync, call_impl, first_result

log = logging.getLogger("strata_serve.plugins")

__all__ = ["ENTRY_POINT_GROUP", "DEFAULT_PLUGINS", "PluginInfo", "add_plugin_commands", "broadcast", "call_each_sync",
           "call_impl", "first_result", "get_plugin_manager", "list_plugins"]

ENTRY_POINT_GROUP = "strata_serve"
#: The version of strata-serve the built-in plugins come with (its distribution's).
_OWN_VERSION = importlib.metadata.version("strata-serve")

DEFAULT_PLUGINS = (
    "strata_serve.default_plugins.llama_server",
    "strata_serve.default_plugins.opening_key",
    "strata_serve.default_plugins.tenant_isolation",
)


def get_plugin_manager(
    settings: Settings,
    *,
    entrypoints: bool = True,
    plugins: Iterable[object] = (),
    defaults: bool = True,
) -> pluggy.PluginManager:
    """Build the plugin manager for one server.

    Disabled plugins are blocked before anything loads, so a broken plugin can be
    turned off without uninstalling it. Tests pass ``entrypoints=False`` and the
    exact ``plugins`` they want.

    :raises ConfigError: when a plugin refuses the configuration (``on_config``).
    """
    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    for name in settings.disable_plugins:
        pm.set_blocked(name)
    for name in settings.plugins:
        if not settings.plugin_enabled(name):
            pm.set_blocked(name)
    if entrypoints:
        pm.load_setuptools_entrypoints(ENTRY_POINT_GROUP)
    if defaults:
        for module_name in DEFAULT_PLUGINS:
            short = module_name.rsplit(".", 1)[-1]
            if not pm.is_blocked(short):
                pm.register(importlib.import_module(module_name), name=short)
    for plugin in plugins:
        name = getattr(plugin, "__name__", None) or type(plugin).__name__
        name = getattr(plugin, "strata_name", name)
        if not pm.is_blocked(name):
            pm.register(plugin, name=name)
    _add_plugin_hookspecs(pm)
    _refuse_wrappers(pm)
    pm.check_pending()
    _check_sections(settings, pm)
    loaded = {name for name, plugin in pm.list_name_plugin() if plugin is not None}
    for name in settings.server.conversation_key_order:
        if name not in loaded:
            log.warning("[strata] server.conversation_key_order names %r, which is not loaded", name)
    if os.environ.get("STRATA_TRACE_PLUGINS"):
        pm.trace.root.setwriter(lambda text: log.info("[trace] %s", text.rstrip()))
        pm.enable_tracing()
        _traced.add(pm)
    # Settings are changed first, by the hook meant for it, then validated: every
    # on_config sees the settings the server will run with, whatever the plugins' order.
    _configure(pm, "adjust_settings", lambda: pm.hook.adjust_settings(settings=settings))
    _configure(pm, "on_config", lambda: pm.hook.on_config.call_historic(kwargs={"settings": settings}))
    return pm


def _configure(pm: pluggy.PluginManager, hook_name: str, call: Callable[[], Any]) -> None:
    """Run a hook whose failure stops the start, naming the plugin that raised."""
    try:
        call()
    except ConfigError:
        raise
    except Exception as exc:  # a plugin refusing to start with its own exception type
        name = _raised_by(pm, hook_name, exc)
        raise ConfigError(f"plugin {name or '(unknown)'} refused the configuration: {exc}") from exc


def add_plugin_commands(cli: Any, pm: pluggy.PluginManager | None = None) -> None:
    """Let plugins add commands to ``cli`` (``register_commands``). Without ``pm``: the
    installed plugins, less those ``STRATA_DISABLE_PLUGINS`` turns off. A plugin that
    fails to load or to register is logged; the other commands stay."""
    if pm is None:
        try:
            from strata_serve.config import load_settings

            pm = get_plugin_manager(load_settings())
        except Exception as exc:  # a broken plugin or environment must not take the CLI down
            log.warning("[strata] plugin commands not loaded: %s", exc)
            return
    call_each_sync(pm, "register_commands", cli=cli)


def _add_plugin_hookspecs(pm: pluggy.PluginManager) -> None:
    """Hooks a plugin offers others: its ``strata_hookspecs`` module or class (as pytest's
    ``pytest_addhooks`` does). Added before pending implementations are checked."""
    for _name, plugin in pm.list_name_plugin():
        specs = getattr(plugin, "strata_hookspecs", None)
        if specs is not None:
            pm.add_hookspecs(specs)


def _refuse_wrappers(pm: pluggy.PluginManager) -> None:
    """Hooks are called one implementation at a time, so each plugin's failure stays its
    own; a wrapper (``wrapper=True``, ``hookwrapper=True``) would never see the others run.
    Refused at start rather than silently broken."""
    for hook_name in dir(pm.hook):
        caller = getattr(pm.hook, hook_name)
        if not isinstance(caller, pluggy.HookCaller):
            continue
        for impl in caller.get_hookimpls():
            if impl.hookwrapper or getattr(impl, "wrapper", False):
                raise ConfigError(
                    f"plugin {impl.plugin_name}: {hook_name} is a hook wrapper; strata-serve calls "
                    "each implementation on its own (one plugin's failure never stops the others), "
                    "so wrappers are not supported: implement the hook plainly"
                )


def _raised_by(pm: pluggy.PluginManager, hook_name: str, exc: BaseException) -> str | None:
    """The plugin whose implementation of ``hook_name`` raised ``exc`` (pluggy does not say)."""
    owners = {getattr(impl.function, "__code__", None): impl.plugin_name
              for impl in getattr(pm.hook, hook_name).get_hookimpls()}
    name, frame = None, exc.__traceback__
    while frame is not None:
        name = owners.get(frame.tb_frame.f_code, name)
        frame = frame.tb_next
    return name


def _check_sections(settings: Settings, pm: pluggy.PluginManager) -> None:
    """A ``plugins.<name>`` section must name a known plugin (typos would pass silently)."""
    known = {name for name, _ in pm.list_name_plugin()}
    known |= {ep.name for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)}
    known |= {m.rsplit(".", 1)[-1] for m in DEFAULT_PLUGINS}
    for name in settings.plugins:
        if name not in known and settings.plugin_enabled(name):
            raise ConfigError(f"plugins.{name}: no plugin named {name!r} is installed")


@dataclass
class PluginInfo:
    name: str
    distribution: str | None
    version: str | None
    hooks: list[str]
    enabled: bool


def list_plugins(settings: Settings) -> list[PluginInfo]:
    """Every plugin that would load, and every installed one that is turned off."""
    pm = get_plugin_manager(settings)
    dists = {
        ep.name: ep.dist for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)
    }
    infos = []
    for name, plugin in pm.list_name_plugin():
        if plugin is None:
            continue
        dist = dists.get(name)
        hooks = sorted(h.name for h in pm.get_hookcallers(plugin) or [])
        infos.append(
            PluginInfo(
                name=name,
                distribution=dist.metadata["Name"] if dist else "strata-serve (built in)",
                version=dist.version if dist else _OWN_VERSION,
                hooks=hooks,
                enabled=True,
            )
        )
    loaded = {info.name for info in infos}
    for name, dist in dists.items():
        if name not in loaded:
            infos.append(
                PluginInfo(name, dist.metadata["Name"] if dist else None,
                           dist.version if dist else None, [], False)
            )
    for module_name in DEFAULT_PLUGINS:
        short = module_name.rsplit(".", 1)[-1]
        if short not in loaded:
            infos.append(PluginInfo(short, "strata-serve (built in)", _OWN_VERSION, [], False))
    return sorted(infos, key=lambda info: info.name)
