"""The engine's own routes: ``/infill``, ``/tokenize``, ``/detokenize``, ``/apply-template``, ``/props``.

``/infill`` generates in the slot, so it goes through the FIFO like a chat; the others
read the model's vocabulary and settings only and are answered outside it
(:func:`~strata_serve.api.relay.direct` says why); ``/detokenize``'s check asks the engine
through what the app gives it (:data:`~strata_serve.api.checks.ASK_ENGINE`).

``/infill`` is one conversation, ``infill``: an editor's completions are many small
requests over the same files; keyed, auto-sessions parks the editor's state when a chat
takes the slot and brings it back for the next completion (when it is worth a file),
where unkeyed requests would have it read anew each time.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from strata_serve.api.checks import ASK_ENGINE, ENGINE_MEDIA
from strata_serve.api.errors import APIError
from strata_serve.api.formats import ApiFormat, StreamSeen
from strata_serve.api.openai import prompt_text
from strata_serve.api.registry import Api
from strata_serve.api.schemas import ApplyTemplateRequest, DetokenizeRequest, InfillRequest, TokenizeRequest

#: The key every ``/infill`` request gets from the built-in keying.
INFILL_KEY = "infill"


class LlamaFormat(ApiFormat):
    """The engine's own completion routes (``/infill``): the last event says ``"stop": true``."""

    name = "llama"
    markers = (b'"error"', b'"stop":true', b'"stop": true')

    def read_event(self, event: dict[str, Any], seen: StreamSeen) -> None:
        super().read_event(event, seen)
        if event.get("stop") is True:
            seen.finished = True


LLAMA = LlamaFormat()


async def known_tokens(request: web.Request, body: dict[str, Any]) -> None:
    """Refuse token ids outside the model's vocabulary: the engine looks each id up
    unchecked and answers an unknown one with a 500."""
    tokens = body.get("tokens") or []
    if not tokens:
        return
    n_vocab = await _vocabulary_size(request)
    if n_vocab is None:
        return
    for n, token in enumerate(tokens):
        if token >= n_vocab:
            raise APIError(400, f"tokens.{n}: {token} is not a token id of this model "
                           f"(its vocabulary has {n_vocab})", param=f"tokens.{n}", code="invalid_value")


async def _vocabulary_size(request: web.Request) -> int | None:
    """The model's vocabulary size, from the engine's model list (None: it does not say)."""
    status, answer = await request.app[ASK_ENGINE](request, "GET", "/v1/models")
    models: Any = answer.get("data") if status == 200 and isinstance(answer, dict) else None
    if isinstance(models, list) and models and isinstance(models[0], dict):
        meta = models[0].get("meta")
        if isinstance(meta, dict) and isinstance(meta.get("n_vocab"), int):
            return meta["n_vocab"]
    return None


INFILL = Api("/infill", "Code infill (fill in the middle; stream with SSE or not)", schema=InfillRequest,
             route="infill", format=LLAMA, given_key=lambda body: INFILL_KEY, prompt_units=prompt_text)
TOKENIZE = Api("/tokenize", "Text to token ids (touches no slot)", schema=TokenizeRequest)
DETOKENIZE = Api("/detokenize", "Token ids to text (touches no slot)", schema=DetokenizeRequest,
                 check=known_tokens)
APPLY_TEMPLATE = Api("/apply-template", "The prompt the chat template makes (touches no slot)",
                     schema=ApplyTemplateRequest, media=ENGINE_MEDIA)
# GET only: POST /props changes the engine's settings for every client.
PROPS = Api("/props", "The engine's properties", method="GET")

APIS = (INFILL, TOKENIZE, DETOKENIZE, APPLY_TEMPLATE, PROPS)
