"""Typed storage keys for the app and its requests."""

from aiohttp import web

from strata_serve.api.registry import Apis
from strata_serve.service import Service

#: The app's :class:`~strata_serve.service.Service`: ``request.app[SERVICE]``.
SERVICE = web.AppKey("service", Service)
#: Name of the API-key holder that sent a request, when named keys are configured.
TENANT: web.RequestKey[str | None] = web.RequestKey("tenant")
#: The APIs the app speaks (:class:`~strata_serve.api.registry.Apis`): the built-in ones and the plugins'.
APIS = web.AppKey("apis", Apis)
