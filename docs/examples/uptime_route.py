"""Add an HTTP route: it sits behind the same API key and error handling as the built-in ones."""

import time

from aiohttp import web

import strata_serve
from strata_serve.api import SERVICE


async def uptime(request):
    service = request.app[SERVICE]
    return web.json_response({"uptime_s": round(time.time() - service.started_at, 3)})


@strata_serve.hookimpl
def register_routes(service):
    return [web.get("/uptime", uptime)]
