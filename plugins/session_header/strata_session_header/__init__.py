"""session_header: the client names its conversation, and the name becomes the key.

Where the name is looked for, in the configured order (``plugins.session_header.sources``):

- ``header``: the ``X-Session-Id`` header (or the one named by ``plugins.session_header.header``);
- ``metadata``: ``metadata.session_id`` in the body;
- ``user``: the OpenAI ``user`` field, only when listed in ``sources`` (it is not by
  default: ``user`` names a person, and chat UIs send the same one with every
  conversation, which would give all of them one key and one file).

A session id is 1 to 64 of letters, digits, ``-`` and ``_`` (a key names a file). A
header or ``metadata.session_id`` that breaks the rule is refused with a 400: the
client sent it for us and would otherwise lose its session without knowing. ``user``
is OpenAI's end-user id, which clients fill for their own reasons (often an email):
one that is not a usable id is passed over, so installing this plugin never breaks
such a client. Without a usable name the plugin defers to the next keying plugin.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

import strata_serve
from strata_serve import StrataRequest

NAME = "session_header"
#: The plugin's name when registered by hand (tests); the entry point gives the same.
strata_name = NAME

MAX_LENGTH = 64
SESSION_ID = re.compile(rf"[A-Za-z0-9_-]{{1,{MAX_LENGTH}}}")

Source = Literal["header", "metadata", "user"]


class SessionHeaderConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    #: The header that carries the session id.
    header: str = Field("X-Session-Id", min_length=1)
    #: Where to look, first to last. ``user`` is not a default: it names a person, not a
    #: conversation. Add it last, for clients that put a conversation id there.
    sources: list[Source] = Field(default_factory=lambda: ["header", "metadata"])


@strata_serve.hookimpl
def on_config(settings):
    settings.plugin_config(NAME, SessionHeaderConfig)  # refuse a bad section before the start


@strata_serve.hookimpl
def conversation_key(request: StrataRequest, service) -> str | None:
    config = service.plugin_config(NAME, SessionHeaderConfig)
    for source in config.sources:
        if source == "header":
            value = request.headers.get(config.header)
            if value is not None:
                return checked(value, config.header)
        elif source == "metadata":
            metadata = request.body.get("metadata")
            if isinstance(metadata, dict) and "session_id" in metadata:
                return checked(metadata["session_id"], "metadata.session_id")
        else:
            user = request.body.get("user")
            if isinstance(user, str) and SESSION_ID.fullmatch(user):
                return user
    return None


def checked(value: object, param: str) -> str:
    """``value`` if it is a usable session id.

    :raises strata_serve.KeyRefused: naming ``param`` and what is wrong with it.
    """
    if not isinstance(value, str):
        raise strata_serve.KeyRefused(f"{param} must be a string", param=param)
    if len(value) > MAX_LENGTH:
        raise strata_serve.KeyRefused(
            f"{param} is {len(value)} characters long; a session id has at most {MAX_LENGTH}", param=param
        )
    if not SESSION_ID.fullmatch(value):
        raise strata_serve.KeyRefused(
            f"{param} must be 1 to {MAX_LENGTH} of letters, digits, '-' and '_'", param=param
        )
    return value
