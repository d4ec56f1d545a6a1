"""auto-sessions: park a conversation's engine slot on disk around a conversation switch.

On a switch (a request whose conversation key differs from the one the slot holds,
as the core's picture of the slot says), while holding the service FIFO:

1. save the held conversation to ``auto-<key>.bin`` unless its file is current (an
   idle save made it so) or it is not worth a file (``min_prefill_s``, ``min_tokens``);
2. restore the incoming conversation from its file, unless the save failed (the
   held state is still the better one).

A request without a conversation key, and a slot restore or erase by hand, park the
held conversation first too.

Its numbers are in :class:`AutoSessionsStats`, reported through ``collect_stats``
(a dict) and ``collect_metrics`` (declared metrics), and kept at
``service.state["auto_sessions"].stats``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import strata_serve
from strata_serve import ConfigError

from strata_auto_sessions import hookspecs
from strata_auto_sessions.config import NAME, AutoSessionsConfig
from strata_auto_sessions.mode import ParkingMode
from strata_auto_sessions.parking import AutoSessions
from strata_auto_sessions.policy import Costs
from strata_auto_sessions.prefix import ParkedConversation, message_chain
from strata_auto_sessions.saving import Parked
from strata_auto_sessions.stats import AutoSessionsStats
from strata_auto_sessions.store import ParkingStore, SessionStore

if TYPE_CHECKING:
    from strata_serve import Service

__all__ = ["AutoSessions", "AutoSessionsConfig", "AutoSessionsStats", "Costs", "Parked", "ParkedConversation",
           "ParkingMode", "ParkingStore", "SessionStore", "message_chain"]

#: How long a stop waits for the uploads to the shared tier under way.
SHARED_STOP_WAIT_S = 30.0
#: How long a stop spends saving the conversations left to the engine's RAM cache.
RAM_STOP_WAIT_S = 30.0
#: The plugin's name when registered by hand (tests); the entry point gives the same.
strata_name = NAME
#: The hooks this plugin offers others (``auto_sessions_store``); the core adds them.
strata_hookspecs = hookspecs


def _parking(service: Service) -> AutoSessions | None:
    return service.state.get(NAME)


@strata_serve.hookimpl
def adjust_settings(settings):
    config = settings.plugin_config(NAME, AutoSessionsConfig)
    if config.slot_dir is not None and settings.engine.slot_save_path is None:
        # The engine must write where we look: give it our directory.
        settings.engine.slot_save_path = config.slot_dir


@strata_serve.hookimpl
def on_config(settings):
    config = settings.plugin_config(NAME, AutoSessionsConfig)
    engine_dir = settings.engine.slot_save_path
    if config.slot_dir is not None:
        if engine_dir is None or engine_dir.resolve() != config.slot_dir.resolve():
            raise ConfigError(
                f"plugins.{NAME}.slot_dir ({config.slot_dir}) must be the engine's slot directory "
                f"(engine.slot_save_path = {engine_dir})"
            )


@strata_serve.hookimpl
async def on_startup(service):
    config = service.plugin_config(NAME, AutoSessionsConfig)
    service.state[NAME] = await AutoSessions.start(config, service)


@strata_serve.hookimpl
def on_engine_start(service, restarted):
    parking = _parking(service)
    if parking is not None and restarted:
        parking.engine_restarted(service)


@strata_serve.hookimpl
def on_arrival(request, service):
    parking = _parking(service)
    if parking is not None and parking.mode.parks and parking.restores_by_tokens(request, service):
        service.tokens_ahead(request)  # beside the FIFO: the switch's step finds them asked


@strata_serve.hookimpl
async def pre_request(request, service):
    parking = _parking(service)
    if parking is not None and parking.mode.parks:
        with parking.syncs_held():
            await parking.before(request, service)


@strata_serve.hookimpl
async def post_request(request, outcome, service):
    parking = _parking(service)
    if parking is not None and parking.mode.parks:
        parking.after(request, outcome, service)
        await parking.idle_saves.save_if_emptied_when_idle(service, request.slot)
        parking.idle_saves.schedule(service, request.slot)
        parking.record_in_use(service)


@strata_serve.hookimpl
def may_go_ahead(request, held, service):
    parking = _parking(service)
    return parking is None or parking.may_go_ahead(request, held, service)


@strata_serve.hookimpl
async def pre_slot_action(slot, action, service):
    parking = _parking(service)
    if parking is not None and parking.mode.parks:
        await parking.before_slot_action(service, slot, action)


@strata_serve.hookimpl
def post_slot_action(slot, service):
    parking = _parking(service)
    if parking is not None and parking.mode.parks:
        parking.idle_saves.schedule(service, slot)
        parking.record_in_use(service)


@strata_serve.hookimpl
async def on_shutdown(service):
    parking = _parking(service)
    if parking is not None:
        # An idle save not started was cancelled by the stop; one that ran is done.
        if parking.mode.parks:
            for slot in range(len(service.slots)):
                await parking.park_slot(service, slot, reason="shutdown")
            await parking.save_left_in_ram(service, RAM_STOP_WAIT_S)
        await parking.synced()  # every save's fsyncs, before the server says it stopped
        if parking.shared is not None:
            await parking.shared.close(min(parking.shared.config.transfer_timeout_s, SHARED_STOP_WAIT_S))
        parking.stop()


@strata_serve.hookimpl
def collect_stats(service):
    parking = _parking(service)
    if parking is None:
        return None
    return parking.stats.snapshot()


@strata_serve.hookimpl
def collect_metrics(service):
    parking = _parking(service)
    return None if parking is None else parking.stats  # its fields declare name, help and unit


@strata_serve.hookimpl
def collect_degraded(service):
    parking = _parking(service)
    return None if parking is None or parking.shared is None else parking.shared.degraded()


@strata_serve.hookimpl
def register_commands(cli):
    from strata_auto_sessions.commands import register

    register(cli)
