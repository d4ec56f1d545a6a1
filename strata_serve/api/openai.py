"""OpenAI's API: chat, completions, embeddings, the model list and one model of it.

Chat holds a conversation: its messages open it and make its prompt. A completion's
prompt is its text and names no conversation; embeddings run in the slot (over what it
held: auto-sessions parks that first) and are never keyed, since no conversation is left
in the slot.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from strata_serve.api.checks import ENGINE_MEDIA
from strata_serve.api.conversation import Opening, opening_of
from strata_serve.api.errors import APIError
from strata_serve.api.registry import Api
from strata_serve.api.schemas import ChatCompletionRequest, CompletionRequest, EmbeddingsRequest


def chat_opening(body: dict[str, Any]) -> Opening:
    return opening_of(body.get("messages") or [], [])


def chat_units(body: dict[str, Any]) -> list[Any]:
    messages = body.get("messages")
    return list(messages) if isinstance(messages, list) else []


def prompt_text(body: dict[str, Any]) -> list[Any] | str:
    """A bare prompt's units: its text (a prompt of token ids or of several texts makes none)."""
    prompt = body.get("prompt")
    return prompt if isinstance(prompt, str) else []


#: The engine reads ``n_predict`` first, then ``max_completion_tokens``, then ``max_tokens``.
SAMPLING_LIMIT = ("max_tokens", "max_completion_tokens", "n_predict")

CHAT = Api("/v1/chat/completions", "Chat completion (stream with SSE or not)", schema=ChatCompletionRequest,
           route="chat", opening=chat_opening, prompt_units=chat_units, media=ENGINE_MEDIA,
           generation_limit=SAMPLING_LIMIT)
COMPLETION = Api("/v1/completions", "Text completion", schema=CompletionRequest, route="completion",
                 prompt_units=prompt_text, generation_limit=SAMPLING_LIMIT)
EMBEDDINGS = Api("/v1/embeddings", "Embeddings (the engine started with --embeddings)", schema=EmbeddingsRequest,
                 route="embeddings", keyed=False)
MODELS = Api("/v1/models", "The engine's models", method="GET")

APIS = (CHAT, COMPLETION, EMBEDDINGS, MODELS)

#: One model of the list, by its id: the OpenAI SDKs' ``models.retrieve``.
MODEL_PATH = MODELS.path + "/{model}"
#: Its route: an id may hold slashes (llama-server's is the model file's path unless
#: ``--alias`` names it; ``org/name`` aliases), sent as they are or as ``%2F``.
MODEL_ROUTE = MODELS.path + "/{model:.+}"


async def retrieve_model(request: web.Request) -> web.Response:
    """One entry of the engine's model list, as OpenAI answers ``GET /v1/models/{model}``;
    404 ``model_not_found`` when no entry has that id. The engine has no such route: its
    list is asked, outside the FIFO."""
    from strata_serve.api.relay import ask_directly, engine_answer  # relay reads the registry, which reads this

    wanted = request.match_info["model"]
    status, listed = await ask_directly(request, "GET", MODELS.engine_path)
    if status >= 400:
        return engine_answer(status, listed)  # raises the engine's refusal
    models = listed.get("data") if isinstance(listed, dict) else None
    for model in models if isinstance(models, list) else []:
        if isinstance(model, dict) and model.get("id") == wanted:
            return web.json_response(model)
    raise APIError(404, f"the model {wanted!r} does not exist: GET {MODELS.path} lists what this server serves",
                   param="model", code="model_not_found")
