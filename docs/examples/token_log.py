"""Log how many prompt tokens each request reused: a plugin with a sync and an async hook."""

import logging

from pydantic import BaseModel, ConfigDict

import strata_serve

log = logging.getLogger("token_log")


class TokenLogConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")  # an unknown key stops the start, named
    prefix: str = "tokens"


@strata_serve.hookimpl
def on_config(settings):
    settings.plugin_config("token_log", TokenLogConfig)  # a bad section stops the start, named


@strata_serve.hookimpl
def pre_request(request):
    request.state["token_log"] = {"key": request.conversation_key}


@strata_serve.hookimpl
async def post_request(request, outcome, service):
    if outcome.timings is not None:
        prefix = service.plugin_config("token_log", TokenLogConfig).prefix  # validated once per server
        log.info("%s: %s reused %d of %d prompt tokens", prefix, request.state["token_log"]["key"],
                 outcome.timings.reused, outcome.prompt_tokens)
