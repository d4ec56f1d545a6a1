"""The hooks: the whole contract between strata-serve and its plugins.

A plugin is any object (usually a module) with functions named after these hooks
and decorated with ``@strata_serve.hookimpl``. An implementation may accept any
subset of a hook's arguments; arguments may be added to a hook later, never renamed
or removed. Unless a hook says otherwise, an implementation may be ``def`` or
``async def`` (or return an awaitable): the core awaits what it returns.

An implementation that raises is logged with its plugin's name and skipped; the
user's request goes on. The exceptions are ``on_config`` (a plugin may refuse to
start) and the ``firstresult`` hooks, which must stay synchronous.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any
from collections.abc import Iterable

import pluggy

if TYPE_CHECKING:
    import click
    from aiohttp import web

    from strata_serve.api.registry import Api
    from strata_serve.config import Settings
    from strata_serve.engine.base import Engine
    from strata_serve.hook_types import ConversationKey, EngineError, Outcome, StrataRequest, Verdict
    from strata_serve.service import Service
    from strata_serve.slot_state import SlotState

PROJECT = "strata_serve"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def adjust_settings(settings: Settings) -> None:
    """Change the server's settings before they are validated: the one hook that may.

    The order at start: the plugins are loaded, ``adjust_settings`` runs for each
    (change ``settings`` in place, e.g. give the engine a directory your plugin
    needs), then ``on_config`` validates the result, so every plugin's check sees the
    settings the server runs with, whichever plugin changed them. Read your own
    section with ``settings.plugin_config`` here too. Raise
    :class:`strata_serve.config.ConfigError` to refuse to start. Must be synchronous.

    :param settings: The server settings, to change in place.
    """


@hookspec(historic=True)
def on_config(settings: Settings) -> None:
    """Validate this plugin's configuration before the server starts.

    Read your section with ``settings.plugin_config("<name>", YourModel)``, which
    validates ``plugins.<name>`` (minus ``enabled``) into your pydantic model and
    raises an error naming any unknown or wrong-typed key. Raise
    :class:`strata_serve.config.ConfigError` (or let that validation error
    propagate) to refuse to start. Validate only: settings are changed in
    ``adjust_settings``, which has run for every plugin before this hook. Must be
    synchronous. Historic: a plugin registered after the call still receives it.

    :param settings: The complete, validated server settings.
    """


@hookspec(firstresult=True)
def engine_backend(settings: Settings) -> Engine | None:
    """Give the engine backend the server drives (:class:`strata_serve.engine.base.Engine`).

    The built-in ``llama_server`` plugin answers last (``trylast``) with llama.cpp's
    llama-server, started or attached as ``engine.*`` says; a plugin for another
    engine answers first. The backend declares what it can do in
    ``engine.capabilities`` (see :data:`strata_serve.engine.base.CAPABILITIES`);
    plugins check them instead of the backend's type. Must be synchronous; do not
    start anything here (the service calls ``engine.start()``).

    Stops at the first non-None result; return None to defer.

    :param settings: The complete, validated server settings.
    :returns: An engine backend, or None to leave the choice to others.
    """


@hookspec
def on_startup(service: Service) -> Any:
    """Prepare once the engine is up, before the first request is admitted.

    The life cycle, in order: the engine starts (``service.engine.info`` is filled
    in), ``on_startup`` once, ``on_engine_start(restarted=False)``, then requests are
    let through. After a crash and restart of the engine: ``on_engine_start(restarted=True)``
    (requests wait meanwhile). On a normal stop: requests drain, ``on_shutdown``, the
    engine stops.

    Raise :class:`strata_serve.ConfigError` to refuse the start (a resource another
    server holds): the engine stops and the server does not serve. Any other failure is
    logged with the plugin's name and the start goes on.

    :param service: The running service (engine, settings, plugin manager).
    """


@hookspec
def on_engine_start(service: Service, restarted: bool) -> Any:
    """The engine (re)started: whatever it held in its slots and RAM is gone.

    Called after the first start too, with ``restarted=False``, right after
    ``on_startup``: what a plugin built there is ready.

    :param service: The running service.
    :param restarted: True when this start follows a crash of the engine.
    """


@hookspec(firstresult=True)
def conversation_key(request: StrataRequest, service: Service) -> ConversationKey | str | None:
    """Name the conversation a request belongs to.

    Requests with the same key continue the same conversation; plugins such as
    auto-sessions park and restore engine state per key. The built-in default
    (registered ``trylast``) is the first 16 hex digits of the sha1 of the first
    ``role: user`` message's text. Must be synchronous.

    Raise :class:`strata_serve.KeyRefused` to refuse input the client got wrong
    (a malformed session header): the client gets a 400 naming it and the request
    is never queued.

    Answer with a value: a plain ``str`` is a key guessed from the prompt, which several
    conversations may share; a plugin whose key names one conversation because the client
    or the API said so (a session id the client sent) returns
    ``strata_serve.ConversationKey(key, named=True)``: auto-sessions then keeps one file
    for the key, where it would keep one per conversation it finds under a guessed key.
    The core records the answer on the request (``conversation_key``,
    ``conversation_named``); a plugin never sets them. (Setting
    ``request.conversation_named = True`` and returning a ``str``, as before, still works,
    with a warning.)

    Stops at the first non-None result; return None to defer.

    :param request: The incoming request (``route``, ``body``, ``headers``, ``tenant``).
    :param service: The running service (read your settings from ``service.settings``).
    :returns: A key of letters, digits, ``-`` and ``_`` (at most 64) without ``--`` (it
        separates a tenant's name: the core answers such a key with a 400), as a ``str``
        or a :class:`strata_serve.ConversationKey`; or None.
    """


@hookspec
def on_arrival(request: StrataRequest, service: Service) -> None:
    """(sync) A request has arrived, keyed, and has not waited for its turn yet.

    Called once per request that reaches the FIFO, before it waits there. Nothing may
    touch a slot here: start only work that needs none and that the request's own steps
    will want, beside the FIFO (:meth:`strata_serve.Service.tokens_ahead` asks the engine
    which tokens its prompt becomes while the request waits, or while the slot's
    outgoing conversation is saved). Must be synchronous and quick.

    :param request: The request that arrived; ``request.conversation_key`` is set.
    :param service: The running service.
    """


@hookspec
def pre_request(request: StrataRequest, service: Service) -> Any:
    """Act before the request reaches the engine, while holding its slot.

    No other request reaches ``request.slot`` until every ``pre_request`` and
    ``post_request`` implementation has finished, so slot operations done there
    cannot interleave with another conversation. On a multi-slot engine, requests
    run meanwhile in the other slots; a request the engine places itself
    (``request.pinned`` False) holds them all.

    :param request: The request about to be sent; ``request.conversation_key`` is set.
    :param service: The running service.
    """


@hookspec
def post_request(request: StrataRequest, outcome: Outcome, service: Service) -> Any:
    """Act after the engine answered (or failed), still holding its slot (``request.slot``:
    the slot it ran in).

    Always called once per request that reached ``pre_request``, including when
    the client disconnected mid-stream (``outcome.status == "cancelled"``).

    :param request: The request that was sent.
    :param outcome: How it ended, with the engine's ``timings`` when it answered.
    :param service: The running service.
    """


@hookspec
def may_go_ahead(request: StrataRequest, held: SlotState, service: Service) -> bool | None:
    """(sync) Whether ``request`` may reach the engine before the answer running now ends.

    Asked on an engine that runs one request at a time, for a request arriving while the
    request before it is at the engine and no other waits; and for the first request
    waiting in line once the engine has begun its answer to the request at the engine (a
    stream's status has come). Answer True only when your
    ``post_request`` for the request running now and your ``pre_request`` for ``request``
    need nothing done to the slot before the engine reads ``request`` (no save, restore
    or erase; nothing the engine must see first): the slot still holds ``held``'s
    conversation then, grown by the answer. ``request`` goes ahead only when every plugin
    implementing ``pre_request`` or ``post_request`` answers True (not implementing this
    hook, or failing in it, is a no). The engine then runs it right after the answer
    before it; the hooks keep their order and their turn: ``post_request`` of the request
    before, then ``pre_request`` (the engine may be answering ``request`` by then) and
    ``post_request`` of ``request``. Sent ahead, it keeps its turn to its end even if its
    client goes away meanwhile.

    :param request: The request waiting; ``request.conversation_key`` is set.
    :param held: What the slot held as the request now running was sent (its conversation).
    :param service: The running service.
    """


@hookspec
def pre_slot_action(slot: int, action: str, tenant: str | None, service: Service) -> Any:
    """Act before a slot action by hand (``POST /slots/{id}``), holding that slot.

    A slot action is no request: ``pre_request`` and ``post_request`` never see it.
    The slot's state is about to be saved to a file (``save``), replaced by one
    (``restore``) or emptied (``erase``): park what must not be lost, or erase what
    the caller must not reach. No other request or slot action reaches ``slot`` until
    ``post_slot_action`` has finished; requests run meanwhile in the other slots.

    :param slot: The slot acted on.
    :param action: ``save``, ``restore`` or ``erase``.
    :param tenant: The tenant asking (None: the unnamed one).
    :param service: The running service.
    """


@hookspec
def post_slot_action(slot: int, action: str, tenant: str | None, service: Service) -> Any:
    """Act after a slot action by hand, still holding that slot; ``service.slots[slot]``
    records what it holds now.

    Always called once per action that reached ``pre_slot_action``, whether the
    engine did it, refused it, or the client went away.

    :param slot: The slot acted on.
    :param action: ``save``, ``restore`` or ``erase``.
    :param tenant: The tenant asking (None: the unnamed one).
    :param service: The running service.
    """


@hookspec
def on_shutdown(service: Service) -> Any:
    """The server is stopping normally: the FIFO is drained and held, the engine is still up.

    Bounded by ``server.shutdown_save_s`` (cancelled past it, or at once on a second
    signal); the core then logs each conversation held that no file keeps.

    :param service: The running service.
    """


@hookspec(firstresult=True)
def engine_verdict(
    op: str, error: EngineError | None, engine: Engine, held_tokens: int | None, service: Service
) -> Verdict | None:
    """Turn an engine's behaviour into a verdict others act on, without string matching.

    Called in two ways for slot operations (``op`` is ``"save"``, ``"restore"`` or
    ``"erase"``): before the call with ``error=None`` (return ``Verdict.SKIP`` or
    ``Verdict.UNSUPPORTED`` to prevent it), and after a failure with the error
    (return what the failure means; ``Verdict.RETRY`` gets the call made once more).
    Verdicts about what a plugin does with the engine (auto-sessions' restores that
    went unused) are that plugin's own hooks, not ``op`` values here. Backend quirk
    plugins implement this hook; must be synchronous.

    Stops at the first non-None result; return None to defer.

    :param op: The slot operation: ``"save"``, ``"restore"`` or ``"erase"``.
    :param error: The failure, or None when asked before the call.
    :param engine: The engine backend (its ``info`` tells model, build, flags).
    :param held_tokens: Tokens the slot holds (the core's picture, ``service.slots``),
        None when not known.
    :param service: The running service (keep per-server state in ``service.state``).
    :returns: A :class:`strata_serve.Verdict`, or None when this plugin has no opinion.
    """


@hookspec
def register_routes(service: Service) -> Iterable[web.RouteDef] | None:
    """Add HTTP routes to the server (stats, admin pages, ...).

    Return route definitions made with ``aiohttp.web.get(path, handler)`` and
    friends. They sit behind the same API-key check and error handling as the
    built-in routes. A route under ``/health`` (open to anyone) is refused and logged.
    Must be synchronous (routes are added while the app is built).

    :param service: The service the routes will serve.
    :returns: An iterable of ``aiohttp.web.RouteDef``, or None.
    """


@hookspec
def register_apis(settings: Settings) -> Iterable[Api] | None:
    """Add an API the server speaks, relayed to the engine like the built-in ones.

    Return :class:`strata_serve.Api` declarations, one per path: its path, route name,
    schema, format (where the engine's numbers are, how a stream ends, its
    :class:`strata_serve.ErrorShape`), how its conversation opens, its prompt's units and
    its media parts. The core mounts each path behind the same checks as the built-in
    APIs; a request on it is keyed (``conversation_key`` sees ``request.route``, the
    built-in key reads its opening), runs in a slot through the FIFO (so auto-sessions
    parks and restores it), gets its errors in the API's shape and is described in
    ``/openapi.json``. An API whose path is taken (the core's own or another API's), or
    whose route name is, is refused and logged. Must be synchronous (the APIs are added
    while the app is built).

    :param settings: The complete, validated server settings.
    :returns: An iterable of :class:`strata_serve.Api`, or None.
    """


@hookspec
def collect_stats(service: Service) -> dict[str, Any] | None:
    """Report this plugin's numbers for others to read (e.g. the stats plugin).

    Must be synchronous and cheap. Return a flat mapping of names to numbers,
    or None.

    :param service: The running service.
    :returns: A dict of counters and gauges, or None.
    """


@hookspec
def collect_metrics(service: Service) -> Any:
    """Publish this plugin's numbers as metrics, each with its name, help, kind and unit.

    Declare the numbers where they are kept: a dataclass whose fields are made with
    ``strata_serve.counter(help, ...)`` or ``strata_serve.gauge(help, ...)``, and
    return the instance; or return ``strata_serve.Metric`` values. A stats plugin reads
    every plugin's answer with ``strata_serve.plugin_metrics(service)`` and exports
    it with no table of your names (``ram_cache_stats`` shows it at ``/metrics`` as
    ``strata_<plugin>_<name>``). Must be synchronous and cheap (it runs on every scrape).

    :param service: The running service.
    :returns: A dataclass instance with declared fields, an iterable of
        ``strata_serve.Metric``, or None.
    """


@hookspec
def collect_degraded(service: Service) -> str | None:
    """Say what this plugin cannot do now though the server still answers: ``/health`` reports it.

    While any plugin gives a reason, ``/health`` answers 200 with
    ``{"status": "degraded", "degraded": {"<plugin>": "<reason>"}}``: the server answers
    every request, less well (a balancer checking for 200 keeps it; one preferring whole
    replicas reads the status). A 503 is kept for what stops answers: the engine down, the
    server stopping. Must be synchronous and cheap (every health check asks); anyone may
    read ``/health``, so name no path, address or secret.

    :param service: The running service.
    :returns: A short reason, or None when all is well.
    """


@hookspec
def register_commands(cli: click.Group) -> None:
    """Add commands to the ``strata-serve`` command line.

    Add them with ``@cli.command()`` or ``@cli.group()`` (click). Called once, the first
    time the command line looks for a command it does not have or lists them (``--help``),
    so ``strata-serve run`` loads nothing more. The plugins asked are those installed,
    less those turned off with ``STRATA_DISABLE_PLUGINS`` (the settings file is read by
    each command, once chosen: take a ``--config`` option of your own). Must be
    synchronous; a plugin that raises is logged and left out, the other commands work.

    :param cli: The ``strata-serve`` command group.
    """
