"""The aiohttp application: built from settings and a plugin manager."""

from __future__ import annotations

import hmac
import logging
from contextlib import asynccontextmanager
from typing import AsyncIterator

import pluggy
from aiohttp import web

from strata_serve.api import openai_routes, openapi, slots
from strata_serve.api.errors import error_middleware, error_response
from strata_serve.api.keys import SERVICE, TENANT
from strata_serve.config import Settings
from strata_serve.engine import Engine, LlamaServer
from strata_serve.plugins import broadcast, call_each_sync
from strata_serve.service import Service

log = logging.getLogger("strata_serve.api")

#: Routes anyone may call, even when API keys are configured.
OPEN_PATHS = frozenset({"/health"})


def create_app(settings: Settings, pm: pluggy.PluginManager, engine: Engine | None = None) -> web.Application:
    """The strata-serve application.

    The engine starts with the app (``cleanup_ctx``) and stops after a drained,
    normal shutdown that ran every plugin's ``on_shutdown``. Pass ``engine`` to
    use another backend (tests pass a test double here).
    """
    if engine is None:
        engine = LlamaServer(settings.engine)
    service = Service(settings, pm, engine)

    async def engine_started(restarted: bool) -> None:
        await broadcast(pm, "on_engine_start", service=service, restarted=restarted)

    engine.on_start = engine_started

    app = web.Application(
        middlewares=[error_middleware, _auth_middleware(settings)],
        client_max_size=int(settings.server.max_body_mib * 1024 * 1024),
    )
    app[SERVICE] = service
    app.add_routes(openai_routes.routes)
    app.add_routes(slots.routes)
    app.router.add_get("/health", health)
    app.router.add_get("/openapi.json", openapi.openapi)
    for name, routes in call_each_sync(pm, "register_routes", service=service):
        if routes:
            try:
                app.add_routes(list(routes))
            except (TypeError, ValueError, RuntimeError) as exc:
                log.error("[strata] plugin %s: its routes were refused: %s", name, exc)
    app.cleanup_ctx.append(_engine_lifecycle)
    app.on_shutdown.append(_drain)
    return app


@asynccontextmanager
async def _engine_lifecycle(app: web.Application) -> AsyncIterator[None]:
    service = app[SERVICE]
    await service.engine.start()
    await broadcast(service.pm, "on_startup", service=service)
    try:
        yield
    finally:
        # A normal stop went through _drain already; this covers an app that
        # is cleaned up without a shutdown signal (e.g. a failed start).
        await service.shutdown()
        await service.engine.stop()


async def _drain(app: web.Application) -> None:
    await app[SERVICE].shutdown()


async def health(request: web.Request) -> web.Response:
    service = request.app[SERVICE]
    if service.closing:
        return web.json_response({"status": "stopping"}, status=503)
    # Ready by strata's account (started, hooks run, let through), and answering now.
    engine_ok = service.engine.ready and await service.engine.health()
    return web.json_response(
        {"status": "ok" if engine_ok else "engine_unavailable", "engine": service.engine.info.url},
        status=200 if engine_ok else 503,
    )


def _auth_middleware(settings: Settings):
    keys: dict[str | None, bytes] = {
        name: secret.get_secret_value().encode() for name, secret in settings.server.api_keys.items()
    }
    if settings.server.api_key is not None:
        keys[None] = settings.server.api_key.get_secret_value().encode()

    @web.middleware
    async def check_key(request: web.Request, handler):
        if not keys or request.path in OPEN_PATHS:
            return await handler(request)
        header = request.headers.get("Authorization", "")
        scheme, _, given = header.partition(" ")
        presented = given.strip().encode() if scheme.lower() == "bearer" else b""
        tenant_found = False
        # Compare against every key, in constant time each, so timing tells nothing.
        for tenant, key in keys.items():
            if hmac.compare_digest(presented, key) and not tenant_found:
                tenant_found = True
                request[TENANT] = tenant
        if not tenant_found:
            return error_response(
                401, "missing or invalid API key (Authorization: Bearer <key>)", code="invalid_api_key"
            )
        return await handler(request)

    return check_key
