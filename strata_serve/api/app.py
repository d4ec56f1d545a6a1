"""The aiohttp application: built from settings and a plugin manager."""

from __future__ import annotations

import functools
import hmac
import ipaddress
import logging
from contextlib import asynccontextmanager
from collections.abc import AsyncIterator, Iterable
from urllib.parse import urlsplit

import pluggy
from aiohttp import web

from strata_serve.api import models, openai, openapi, slots
from strata_serve.api.app_state import APIS, SERVICE, TENANT
from strata_serve.api.builtin import server_apis
from strata_serve.api.checks import ASK_ENGINE
from strata_serve.api.errors import APIError, error_middleware, shape_protocol_errors
from strata_serve.api.registry import Apis
from strata_serve.api.relay import ask_directly, handler
from strata_serve.config import ConfigError, Settings
from strata_serve.engine.base import Engine
from strata_serve.hook_calls import call_each_sync, first_result
from strata_serve.service import Service

log = logging.getLogger("strata_serve.api")

#: The one path anyone may call (GET and HEAD only), even when API keys are configured.
HEALTH_PATH = "/health"
#: What a request with a body must be: a browser form or ``text/plain`` body is refused, so a
#: cross-site page can only send a body after a CORS preflight that names its origin.
JSON_TYPE = "application/json"


def create_app(settings: Settings, pm: pluggy.PluginManager, engine: Engine | None = None) -> web.Application:
    """The strata-serve application.

    The service starts with the app (``cleanup_ctx``) and stops after a drained,
    normal shutdown that ran every plugin's ``on_shutdown``. The engine backend is
    the ``engine_backend`` hook's answer (llama-server by default); pass ``engine`` to
    use a given one.
    """
    if engine is None:
        engine = first_result(pm, "engine_backend", settings=settings)
        if engine is None:
            raise ConfigError("no engine backend: the engine_backend hook gave none "
                              "(is the built-in llama_server plugin disabled?)")
    service = Service(settings, pm, engine)
    apis = server_apis(pm, settings)

    open_routes: set[web.AbstractRoute] = set()
    app = web.Application(
        middlewares=[error_middleware(apis.errors_at), _browser_guard(settings),
                     _auth_middleware(settings, open_routes), _bodies_budget(settings)],
        client_max_size=int(settings.server.max_body_mib * 1024 * 1024),
    )
    shape_protocol_errors(app)
    app[SERVICE] = service
    app[APIS] = apis
    app[ASK_ENGINE] = ask_directly
    _add_api_routes(app, engine, apis)
    app.add_routes(slots.routes)
    # Open by route, not by path: another method on /health is never open.
    open_routes.update(app.router.add_route(method, HEALTH_PATH, health) for method in ("GET", "HEAD"))
    app.router.add_get("/openapi.json", openapi.openapi)
    for name, routes in call_each_sync(pm, "register_routes", service=service):
        if routes:
            try:
                app.add_routes(_plugin_routes(name, routes))
            except (TypeError, ValueError, RuntimeError) as exc:
                log.error("[strata] plugin %s: its routes were refused: %s", name, exc)
    app.on_response_prepare.append(_cors_headers(settings))
    app.cleanup_ctx.append(_engine_lifecycle)
    app.on_shutdown.append(_drain)
    return app


def _add_api_routes(app: web.Application, engine: Engine, apis: Apis) -> None:
    """Every API's path, with its handler if the backend serves the engine's path it is
    relayed to (its ``routes``), else one answering 404 ``not_supported``. Mounted either
    way: the client learns that this server's engine lacks the route, not that the path
    is wrong."""
    served = getattr(engine, "routes", None)
    for api in apis:
        serves = served is None or api.engine_path in served
        app.router.add_route(api.method, api.path, handler(api) if serves else _not_served(engine, api.path))
        if api is openai.MODELS and serves:
            app.router.add_get(openai.MODEL_ROUTE, models.retrieve_model)


def _not_served(engine: Engine, path: str):
    name = engine.info.model_path or type(engine).__name__

    async def not_served(request: web.Request) -> web.Response:
        raise APIError(404, f"{request.method} {path} is not supported by this server's engine ({name}): "
                       "its backend does not serve that route", code="not_supported")

    return not_served


@asynccontextmanager
async def _engine_lifecycle(app: web.Application) -> AsyncIterator[None]:
    service = app[SERVICE]
    await service.start()
    try:
        yield
    finally:
        # A normal stop went through _drain already (shutdown runs once); this also
        # covers an app cleaned up without a shutdown signal (e.g. a failed start).
        await service.stop()


async def _drain(app: web.Application) -> None:
    await app[SERVICE].shutdown()


def _plugin_routes(plugin: str, routes: Iterable[web.AbstractRouteDef]) -> list[web.AbstractRouteDef]:
    """A plugin's routes, minus any under ``/health``: that path stays open, terse and read-only."""
    kept = []
    for route in routes:
        path = getattr(route, "path", getattr(route, "prefix", ""))
        if path == HEALTH_PATH or path.startswith((HEALTH_PATH + "/", HEALTH_PATH + "{")):
            log.error("[strata] plugin %s: route %s %s refused: nothing may be added under %s",
                      plugin, getattr(route, "method", "*"), path, HEALTH_PATH)
            continue
        kept.append(route)
    return kept


async def health(request: web.Request) -> web.Response:
    """Open to anyone, so it says whether the server can answer and nothing else."""
    service = request.app[SERVICE]
    if service.closing:
        return web.json_response({"status": "stopping"}, status=503)
    # Ready by strata's account (started, hooks run, let through), and answering now.
    engine_ok = service.engine.ready and await service.engine.health()
    if not engine_ok:
        return web.json_response({"status": "engine_unavailable"}, status=503)
    # Answering, less well (a plugin's store hung): 200, so a balancer keeps the replica.
    degraded = {name: str(reason) for name, reason in call_each_sync(service.pm, "collect_degraded", service=service)
                if reason}
    return web.json_response({"status": "degraded", "degraded": degraded} if degraded else {"status": "ok"})


def _host_name(request: web.Request) -> str:
    """The name in the Host header, without the port (from its text: building
    ``request.url`` from a hostile Host can raise)."""
    host = request.host.lower()
    return host[1:].partition("]")[0] if host.startswith("[") else host.rpartition(":")[0] or host


@functools.lru_cache(maxsize=256)  # asked on every request, most often of the same few names
def _unrebindable(name: str) -> bool:
    """An address no DNS answer can make point elsewhere: an IP literal or localhost."""
    if name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def _same_origin(request: web.Request, origin: str) -> bool:
    """A page served by this very server, reached by an address no DNS answer can rebind.

    A name (``evil.example`` made to resolve to 127.0.0.1) would look same-origin to
    the browser; only an IP literal or ``localhost`` is trusted here. Any other name
    goes in ``server.allowed_origins``.
    """
    return origin.lower() == f"{request.scheme}://{request.host}".lower() and _unrebindable(_host_name(request))


def _origin_allowed(request: web.Request, origin: str, allowed: frozenset[str]) -> bool:
    return origin.lower() in allowed or _same_origin(request, origin)


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return host == "localhost"


def _browser_guard(settings: Settings):
    """Keep web pages from driving the server: Origin checked, JSON bodies only, CORS preflights answered."""
    allowed = frozenset(settings.server.allowed_origins)
    # Listening on loopback, the server is reached by a loopback address. A request naming
    # another host reached it through a name resolved to this machine: DNS rebinding, where
    # a page's same-origin GETs carry no Origin at all. The allowed origins' names pass.
    trusted_names = (frozenset(urlsplit(origin).hostname for origin in allowed)
                     if _loopback(settings.server.host) else None)

    @web.middleware
    async def guard(request: web.Request, handler):
        if trusted_names is not None and "Host" in request.headers:  # browsers always send one
            name = _host_name(request)
            if not (_unrebindable(name) or name in trusted_names):
                raise APIError(
                    403, f"this server listens on a loopback address, and the request names the host "
                    f"{name!r}: a web page whose name was made to resolve here is refused "
                    "(server.allowed_origins lists the names that may be used)", code="host_not_allowed"
                )
        origin = request.headers.get("Origin")
        if origin is not None:
            if not _origin_allowed(request, origin, allowed):
                raise APIError(
                    403, f"requests from the web page at {origin!r} are not allowed "
                    "(server.allowed_origins lists the origins that are)", code="origin_not_allowed"
                )
            if request.method == "OPTIONS" and "Access-Control-Request-Method" in request.headers:
                return _preflight(request, origin)
        if request.body_exists and request.content_type != JSON_TYPE:
            raise APIError(
                415, f"the request body must be JSON (Content-Type: {JSON_TYPE}), "
                f"not {request.headers.get('Content-Type', 'unnamed')!r}", code="unsupported_media_type"
            )
        return await handler(request)

    return guard


def _preflight(request: web.Request, origin: str) -> web.Response:
    headers = {
        "Access-Control-Allow-Origin": origin,
        "Access-Control-Allow-Methods": "GET, HEAD, POST",
        "Access-Control-Max-Age": "600",
        "Vary": "Origin",
    }
    asked = request.headers.get("Access-Control-Request-Headers")
    if asked:
        headers["Access-Control-Allow-Headers"] = asked
    return web.Response(status=204, headers=headers)


def _cors_headers(settings: Settings):
    """Let an allowed origin's page read the answer (streamed ones too: added as headers go out)."""
    allowed = frozenset(settings.server.allowed_origins)

    async def add(request: web.Request, response: web.StreamResponse) -> None:
        origin = request.headers.get("Origin")
        if origin is not None and origin.lower() in allowed and "Access-Control-Allow-Origin" not in response.headers:
            response.headers["Access-Control-Allow-Origin"] = origin
            response.headers.add("Vary", "Origin")

    return add


def _auth_middleware(settings: Settings, open_routes: set[web.AbstractRoute]):
    keys: dict[str | None, bytes] = {
        name: secret.get_secret_value().encode() for name, secret in settings.server.api_keys.items()
    }
    if settings.server.api_key is not None:
        keys[None] = settings.server.api_key.get_secret_value().encode()

    @web.middleware
    async def check_key(request: web.Request, handler):
        if not keys or request.match_info.route in open_routes:
            return await handler(request)
        presented = _presented_key(request)
        tenant_found = False
        # Compare against every key, in constant time each, so timing tells nothing.
        for tenant, key in keys.items():
            if hmac.compare_digest(presented, key) and not tenant_found:
                tenant_found = True
                request[TENANT] = tenant
        if not tenant_found:
            raise APIError(
                401, "missing or invalid API key (Authorization: Bearer <key>, or X-Api-Key: <key>)",
                code="invalid_api_key",
            )
        return await handler(request)

    return check_key


def _bodies_budget(settings: Settings):
    """Bound the memory request bodies take together, not only each one.

    Each request's body (up to ``server.max_body_mib``) is held from its first byte until
    its answer, waiting in the line included; thirty clients sending large or compressed
    bodies at once took the server past 1.5 GB. A request with a body reserves its
    ``Content-Length`` (the largest body when it is compressed or its length is not given)
    for as long as it runs; past ``server.max_bodies_mib`` in all, it gets a 503 with
    ``Retry-After`` before anything of it is read.
    """
    largest = int(settings.server.max_body_mib * 1024 * 1024)
    budget = int(settings.server.max_bodies_mib * 1024 * 1024)
    held = 0

    @web.middleware
    async def reserve(request: web.Request, handler):
        nonlocal held
        if not request.body_exists:
            return await handler(request)
        length = request.content_length
        size = largest if length is None or request.headers.get("Content-Encoding") else min(length, largest)
        if held + size > budget:
            raise APIError(503, f"the server is busy: request bodies already hold "
                                f"{held / 1024 / 1024:.0f} MiB of server.max_bodies_mib "
                                f"({settings.server.max_bodies_mib:g})",
                           code="bodies_budget", headers={"Retry-After": "1"})
        held += size
        try:
            return await handler(request)
        finally:
            held -= size

    return reserve


def _presented_key(request: web.Request) -> bytes:
    """The key a request presents: ``Authorization: Bearer <key>``, else ``X-Api-Key: <key>``.

    Anthropic's clients send the second (Claude Code with ``ANTHROPIC_API_KEY``); the
    engine takes both as well.
    """
    if "Authorization" in request.headers:
        return _bearer_token(request.headers["Authorization"])
    try:
        return request.headers.get("X-Api-Key", "").strip(" ").encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:
        return b""


def _bearer_token(header: str) -> bytes:
    """The token of ``Bearer <token>`` as the bytes the client sent; empty for anything else.

    Header text may hold bytes that are not UTF-8 (kept as surrogates by the parser):
    they are turned back into those bytes, which then simply match no key.
    """
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer":
        return b""
    try:
        return token.lstrip(" ").encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:  # not text a parser can produce from bytes; matches nothing
        return b""
