"""Log how many prompt tokens each request reused: a plugin with a sync and an async hook."""

import logging

from pydantic import BaseModel, ConfigDict

import strata_serve

log = logging.getLogger("token_log")
settings_seen = {}


class TokenLogConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")  # an unknown key stops the start, named
    prefix: str = "tokens"


@strata_serve.hookimpl
def on_config(settings):
    settings_seen["config"] = settings.plugin_config("token_log", TokenLogConfig)


@strata_serve.hookimpl
def pre_request(request):
    request.state["token_log"] = {"key": request.conversation_key}


@strata_serve.hookimpl
async def post_request(request, outcome):
    if outcome.timings:
        prefix = settings_seen["config"].prefix
        log.info("%s: %s reused %d of %d prompt tokens", prefix, request.state["token_log"]["key"],
                 outcome.timings["cache_n"], outcome.prompt_tokens)
