"""What a request body asks of the engine, checked before the engine sees it.

**Messages.** llama-server renders the chat template over every message in a time
that grows faster than their number (16,000 one-word messages took 12 s here,
400,000 kept it busy for hours), in a step no closed connection interrupts: one
request could take the engine's CPU from everyone long after its client left. A
message takes at least one token of the prompt, so more messages than the context
has tokens can never be answered; ``server.max_messages`` bounds the rest.

**Media.** llama-server turns every media part of every API (OpenAI chat's ``image_url``,
``input_audio`` and ``input_video``, Anthropic's ``image`` blocks, the Responses API's
``input_image``) into one of its own, then:

- answers a part the model cannot take (no ``--mmproj``, or a projector without
  audio) with an HTTP 500, which would reach the client as our 502 "the engine
  failed", though asking again can never help: here it is the client's 400;
- downloads a part given by an ``http(s)`` URL itself, from the machine it runs on,
  whatever address that URL names (a cloud's metadata service, a router's admin
  page, any service bound to localhost). A client of strata-serve could make the
  engine reach what the client cannot, so such URLs are refused unless
  ``server.fetch_media_urls`` allows them. Media sent inline (``data:`` URLs,
  base64) is what chat UIs and coding agents send.
"""

from __future__ import annotations

import re
from typing import Any
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping

from aiohttp import web

from strata_serve.api.errors import APIError
from strata_serve.config import ServerSettings
from strata_serve.engine.base import EngineInfo

#: How a check that needs the engine (``Api.check``: ``/detokenize``'s token ids) asks it,
#: outside the FIFO: ``await ask(request, method, path)`` gives the engine's status and
#: answer. The app passes it down (``app[ASK_ENGINE]``, the relay's ``ask_directly``).
AskEngine = Callable[[web.Request, str, str], Awaitable[tuple[int, Any]]]
ASK_ENGINE: web.AppKey[AskEngine] = web.AppKey("ask_engine")

#: What a media part names: the modality it needs and the URL (or inline data) it gives.
MediaReader = Callable[[dict[str, Any]], tuple[str, Any]]


def _chat_image(part: dict[str, Any]) -> tuple[str, Any]:
    image = part.get("image_url")  # OpenAI chat: {"image_url": {"url": ...}}
    return "vision", image.get("url") if isinstance(image, dict) else None


def _responses_image(part: dict[str, Any]) -> tuple[str, Any]:
    return "vision", part.get("image_url")  # Responses: {"image_url": "..."}


def _anthropic_image(part: dict[str, Any]) -> tuple[str, Any]:
    source = part.get("source")  # Anthropic: {"source": {"type": "base64"|"url", ...}}
    if isinstance(source, dict) and source.get("type") == "url":
        return "vision", source.get("url")
    return "vision", None


def _clip(part: dict[str, Any]) -> tuple[str, Any]:
    # The engine reads "data", else "url", from either, and fetches an http one.
    kind = part["type"]
    media = part.get(kind)
    url = (media.get("data") or media.get("url")) if isinstance(media, dict) else None
    return ("audio" if kind == "input_audio" else "video"), url


#: Every kind of media part llama-server reads, by its ``type``, whichever API it comes from.
#: The engine turns each API's body into one format of its own before reading it, so
#: the built-in APIs check every kind it reads, not only their own: none reaches it
#: unchecked through another API's body.
ENGINE_MEDIA: dict[str, MediaReader] = {
    "image_url": _chat_image, "input_audio": _clip, "input_video": _clip, "video_url": _clip,
    "input_image": _responses_image,
    "image": _anthropic_image,
}


def media_parts(body: dict[str, Any], fields: Iterable[str],
                readers: Mapping[str, MediaReader] = ENGINE_MEDIA) -> Iterator[tuple[str, Any]]:
    """Each media part of a request as (modality, URL or data), at any depth of its
    messages or items (in ``fields``; tool results carry images too), read by the
    ``readers`` of its API, by the part's ``type``."""
    stack: list[Any] = [body.get(field) for field in fields]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
        elif isinstance(node, dict):
            kind = node.get("type")
            reader = readers.get(kind) if isinstance(kind, str) else None
            if reader is not None:
                yield reader(node)
            for value in node.values():
                if isinstance(value, (list, dict)):
                    stack.append(value)


def is_fetched(url: Any) -> bool:
    """Whether the engine would download this URL (it does for any text starting ``http``)."""
    return isinstance(url, str) and url.startswith("http")


def check_messages(body: dict[str, Any], fields: tuple[str, ...], info: EngineInfo,
                   server: ServerSettings) -> None:
    """Refuse more messages (in ``fields``) than the context could hold or
    ``server.max_messages`` allows.

    :raises APIError: 400 ``too_many_messages``.
    """
    for field in fields:
        items = body.get(field)
        if not isinstance(items, list):
            continue
        count = len(items)
        if info.n_ctx and count > info.n_ctx:
            raise APIError(400, f"{count:,} {field}: more than the {info.n_ctx:,} tokens of the context, and each "
                                "takes at least one", param=field, code="too_many_messages")
        if count > server.max_messages:
            raise APIError(400, f"{count:,} {field}: more than server.max_messages ({server.max_messages:,})",
                           param=field, code="too_many_messages")


def media_words(readers: Iterable[str]) -> re.Pattern[bytes]:
    """What :func:`might_hold_media` looks for: the part types of an API's readers (less
    those another one is part of: ``image`` finds ``image_url`` too)."""
    kinds = sorted(set(readers), key=len)
    kept = [kind for n, kind in enumerate(kinds) if not any(shorter in kind for shorter in kinds[:n])]
    return re.compile(b"|".join(re.escape(kind.encode()) for kind in kept) or b"(?!)")


def might_hold_media(raw: bytes, words: re.Pattern[bytes]) -> bool:
    """Whether a JSON body's bytes could hold a media part of a type in ``words`` (if
    not, :func:`check_media` has nothing to find). A letter of a JSON string is either
    itself or a ``\\u`` escape, so a type spelled with escapes is still caught."""
    return b"\\u" in raw or words.search(raw) is not None


def check_media(body: Any, fields: Iterable[str], readers: Mapping[str, MediaReader], info: EngineInfo,
                server: ServerSettings) -> None:
    """Refuse, as the client's error, media the engine cannot take or must not fetch: the
    parts ``readers`` know in the body's ``fields`` (its API's).

    :raises APIError: 400 ``not_supported`` for a modality the model does not take (when
        the engine has said which it takes), 400 ``media_url_refused`` for a URL the
        engine would download, unless ``server.fetch_media_urls`` allows that.
    """
    if not isinstance(body, dict):
        return
    for modality, url in media_parts(body, fields, readers):
        if info.modalities is not None and modality not in info.modalities:
            raise APIError(
                400,
                f"the model takes no {modality} input: start the engine with a projector "
                "that gives it (engine.mmproj), or send text only",
                code="not_supported",
            )
        if is_fetched(url) and not server.fetch_media_urls:
            raise APIError(
                400,
                "media given by an http(s) URL is not fetched: send it inline (a data: URL, "
                "base64), or let the engine download it with server.fetch_media_urls = true",
                code="media_url_refused",
            )
