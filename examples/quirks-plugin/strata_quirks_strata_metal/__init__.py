"""The Strata Metal engine before its session-file fix: a refused save means "provisional".

That engine keeps a cancelled request's state in the slot as a provisional
checkpoint, and before its session-file fix it refuses to save that state:
the save fails with HTTP 500 ``invalid checkpoint running-state payload``.
Nothing durable is lost by restoring over such a state (the request that made
it never finished), so this plugin answers ``Verdict.PROVISIONAL`` and
auto-sessions goes on to restore the incoming conversation instead of
withholding the restore.

How it knows the engine: by the error's shape alone (a failed save, HTTP 500,
that message). The message is this engine's own; no other engine we serve sends
it, and a fixed build never sends it, so the plugin is inert everywhere else and
may stay installed after the fix. A build string would not help: the fixed and
the unfixed builds differ only in whether the error happens.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

import strata_serve
from strata_serve import Verdict

NAME = "quirks_strata_metal"
#: The plugin's name when registered by hand (tests); the entry point gives the same.
strata_name = NAME

#: The engine's message for a save of a cancelled request's provisional state.
RUNNING_STATE_REFUSED = "invalid checkpoint running-state payload"


class StrataMetalQuirksConfig(BaseModel):
    """``plugins.quirks_strata_metal.*``: no settings but ``enabled``; a typo is refused."""

    model_config = ConfigDict(extra="forbid")


@strata_serve.hookimpl
def on_config(settings):
    settings.plugin_config(NAME, StrataMetalQuirksConfig)


@strata_serve.hookimpl
def engine_verdict(op, error):
    if error is None:
        return None  # nothing to prevent before a call: the refusal is only known once it happens
    if op == "save" and error.status == 500 and RUNNING_STATE_REFUSED in error.message:
        return Verdict.PROVISIONAL
    return None
