"""OpenAI's API: chat, completions, embeddings, the model list and one model of it.

Chat holds a conversation: its messages open it and make its prompt. A completion's
prompt is its text and names no conversation; embeddings run in the slot (over what it
held: auto-sessions parks that first) and are never keyed, since no conversation is left
in the slot.
"""

from __future__ import annotations

from typing import Any

from strata_serve.api.checks import ENGINE_MEDIA
from strata_serve.api.conversation import Opening, opening_of
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

#: One model of the list, by its id: the OpenAI SDKs' ``models.retrieve`` (answered by
#: :mod:`strata_serve.api.models`).
MODEL_PATH = MODELS.path + "/{model}"
#: Its route: an id may hold slashes (llama-server's is the model file's path unless
#: ``--alias`` names it; ``org/name`` aliases), sent as they are or as ``%2F``.
MODEL_ROUTE = MODELS.path + "/{model:.+}"

