"""The default conversation key: the first user message names the conversation.

A heuristic: clients that keep their opening message fixed (chat UIs, most agents)
get one key per conversation. Plugins that know better register their own
``conversation_key`` and win, since this one runs last.

Every API that holds a conversation is understood, as it declares how its conversation
opens (:func:`strata_serve.opening`; a plugin's API too): OpenAI chat (``messages``),
Anthropic's Messages API (top-level ``system``, content blocks) and the Responses API
(``instructions``, and ``input`` as a string or as items). Images, audio and files in
the first user message count too: two conversations that open with the same words and
different pictures get different keys. A first user message of text alone keeps the key
it always had (the sha1 of its text), so existing session files stay valid.

An API may give the key itself (its ``given_key``), which is used as it is:

- ``responses`` with a ``prompt_cache_key`` (Codex CLI sends its conversation's id
  there): the key is that name's hash, since the client said which requests share a
  prompt;
- ``infill``: one conversation, ``infill`` (an editor's completions over the same files).

Such a key names one conversation (answered as ``ConversationKey(key, named=True)``); one
from the opening is a guess several conversations may share (a plain ``str``).

An API without an opening is not keyed: ``completion`` (a bare prompt); ``embeddings``
never is (the core does not ask: no conversation is left in the slot).
"""

from __future__ import annotations

import strata_serve
from strata_serve.api.conversation import Opening, message_media, message_text, text_key
from strata_serve.api.llama import INFILL_KEY
from strata_serve.api.prompts import api_of, opening
from strata_serve.hook_types import ConversationKey, StrataRequest

__all__ = ["INFILL_KEY", "Opening", "conversation_key", "message_media", "message_text", "opening", "text_key"]


@strata_serve.hookimpl(trylast=True)
def conversation_key(request: StrataRequest) -> ConversationKey | str | None:
    api = api_of(request)
    if api is None:
        return None
    if api.given_key is not None:
        given = api.given_key(request.body)
        if given is not None:
            return ConversationKey(given, named=True)  # the client or the API named it
    start = opening(request)
    if start is None or (start.user is None and not start.media):
        return None
    return text_key(start.user or "", start.media)
