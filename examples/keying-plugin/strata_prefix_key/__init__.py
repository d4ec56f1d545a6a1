"""prefix_key: the opening characters of the first user message name the conversation.

Some agents re-render their first message every turn: a fixed instruction, then a
file listing or a date that changes. The built-in key hashes the whole message, so
each turn looks like a new conversation. This key hashes only its first ``chars``
characters (``plugins.prefix_key.chars``), so the turns stay one conversation while
the instruction stays the same. A message no longer than ``chars`` gets the built-in
key, since the same text is hashed.

Every API that holds a conversation is understood (OpenAI chat, Anthropic's Messages,
the Responses API), through the built-in key's ``opening``; images in the first user
message count as they do there.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

import strata_serve
from strata_serve import opening, text_key

NAME = "prefix_key"
#: The plugin's name when registered by hand (tests); the entry point gives the same.
strata_name = NAME


class PrefixKeyConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")  # a misspelt key stops the start, named

    #: How many opening characters of the first user message name the conversation.
    chars: int = Field(200, ge=1)


@strata_serve.hookimpl
def on_config(settings):
    settings.plugin_config(NAME, PrefixKeyConfig)  # refuse a bad section before the start


@strata_serve.hookimpl
def conversation_key(request, service):
    start = opening(request)
    if start is None or start.user is None:
        return None  # defer: another plugin, or in the end the built-in default, decides
    chars = service.plugin_config(NAME, PrefixKeyConfig).chars
    return text_key(start.user[:chars], start.media)
