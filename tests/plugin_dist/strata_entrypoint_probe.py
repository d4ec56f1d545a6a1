"""A plugin found only through its entry point: adds a route and validates its section."""

from aiohttp import web
from pydantic import BaseModel, ConfigDict

import strata_serve

GREETING = {"value": "hello"}


class ProbeConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    greeting: str = "hello"


@strata_serve.hookimpl
def on_config(settings):
    GREETING["value"] = settings.plugin_config("entrypoint_probe", ProbeConfig).greeting


async def probe(request):
    return web.json_response({"greeting": GREETING["value"]})


@strata_serve.hookimpl
def register_routes():
    return [web.get("/probe", probe)]
