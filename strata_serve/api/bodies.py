"""A request's body, read and checked before anything else sees it: JSON as the engine
takes it (no NaN, no number a float cannot hold, no lone surrogate, nesting bounded), the
API's schema, and the messages' and media's limits (``api/checks.py``).

Every refusal is an :class:`~strata_serve.api.errors.APIError` the middleware shapes in
the route's API error shape: a bad body never reaches the FIFO, a plugin or the engine.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
from typing import Any

from aiohttp import web
from aiohttp.web_protocol import RequestPayloadError
from pydantic import BaseModel

from strata_serve.api.app_state import SERVICE
from strata_serve.api.checks import check_media, check_messages, might_hold_media
from strata_serve.api.errors import APIError, aiohttp_reason
from strata_serve.api.registry import Api

__all__ = ["MAX_JSON_DEPTH", "check_json_value", "read_json"]


async def read_json(request: web.Request, api: Api | type[BaseModel]) -> dict[str, Any]:
    """The body as a dict, checked as ``api`` declares (or against a model alone; raises
    errors the middleware shapes)."""
    model = api.schema if isinstance(api, Api) else api
    assert model is not None
    timeout = request.app[SERVICE].settings.server.read_timeout_s
    try:
        # A deadline on this task (wait_for would run the read in a task of its own, on
        # every request, for a body that has most often arrived with the headers).
        async with asyncio.timeout(timeout):
            raw = await request.read()  # 413 past server.max_body_mib
    except TimeoutError:
        raise APIError(408, f"the request body did not arrive within {timeout:g} s", code="read_timeout") from None
    except RequestPayloadError as exc:  # e.g. Content-Encoding: gzip over bytes that are not gzip
        raise APIError(400, f"the request body could not be read: {aiohttp_reason(exc.__cause__ or exc)}",
                       code="unreadable_body") from None
    if not raw:
        raise APIError(400, "the request body is empty; a JSON object is expected")
    encoding = json.detect_encoding(raw)
    try:
        # One decoder for every body (json.loads with these arguments builds one per call).
        body = _BODY_DECODER.decode(raw.decode(encoding, "surrogatepass"))
    except RecursionError:
        raise _too_deep() from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise APIError(400, f"the request body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    service = request.app[SERVICE]
    # Counted first: validating 400,000 messages would hold the event loop for seconds.
    fields = getattr(model, "message_fields", ())
    check_messages(body, fields, service.engine.info, service.settings.server)
    _check_value(body, raw, encoding)
    model.model_validate(body)
    # Most bodies are text alone: no second walk through them.
    if isinstance(api, Api) and api.media and might_hold_media(raw, api.media_words):
        check_media(body, fields, api.media, service.engine.info, service.settings.server)
    return body


def _not_json(word: str) -> Any:
    # Python's parser takes NaN and Infinity, which JSON (and the engine) does not.
    raise ValueError(f"{word} is not a JSON value")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e999: valid JSON text, but no number a float holds
        raise ValueError(f"the number {text[:40]} is out of range")
    return value


_BODY_DECODER = json.JSONDecoder(parse_constant=_not_json, parse_float=_finite_float)


#: Deepest nesting of arrays and objects accepted in a request body. Python's own
#: parser stops near 1,000 levels (a RecursionError); whatever handles the body later
#: (validation, the relay's encoder, the engine's parser) recurses too.
MAX_JSON_DEPTH = 100


def _too_deep() -> APIError:
    return APIError(400, f"the request body is nested more than {MAX_JSON_DEPTH} levels deep",
                    code="too_deeply_nested")


def _check_value(body: Any, raw: bytes, encoding: str) -> None:
    """:func:`check_json_value`, or as much of it as a UTF-8 body's bytes leave open.

    Bytes are searched at C speed; the walk through every value is Python's: 1.5-2 ms on
    a 200 KB agent's body (its parse took 2.6), against 0.3 ms for the walk through its
    arrays and objects alone (measured on 2 cores). No more arrays and objects opened than
    :data:`MAX_JSON_DEPTH` rules out nesting deeper; no surrogate's escape
    (``\\uD800``-``\\uDFFF``) nor its own UTF-8 bytes rules out a lone surrogate. A body
    whose bytes rule out both is not walked; one whose bytes rule out surrogates alone is
    walked through its arrays and objects only, for their depth."""
    if encoding != "utf-8" or _may_hold_surrogate(raw):
        check_json_value(body)
    elif raw.count(b"[") + raw.count(b"{") > MAX_JSON_DEPTH:
        _check_depth(body)


def _may_hold_surrogate(raw: bytes) -> bool:
    # Two plain searches first: most bodies hold neither an escape nor a byte 0xED, and the
    # pattern's alternation runs slower than a search for a fixed string.
    return (b"\\u" in raw or b"\xed" in raw) and _SURROGATE_BYTES.search(raw) is not None


def check_json_value(value: Any) -> None:
    """Refuse what parsed as JSON yet cannot be handled safely: deep nesting, lone surrogates.

    JSON's ``\\ud800`` escapes can make strings that are not Unicode text; encoding
    them (to hash a key, to name a file, to log) would fail far from here.

    :raises APIError: 400 naming the problem.
    """
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, str):
            if not item.isascii() and _SURROGATE.search(item):
                raise APIError(400, "the request body holds a lone UTF-16 surrogate (a \\ud800-\\udfff escape "
                               "outside a pair), which is not text", code="invalid_unicode")
            continue
        if isinstance(item, dict):
            children = [*item.keys(), *item.values()]
        elif isinstance(item, list):
            children = item
        else:
            continue
        if depth > MAX_JSON_DEPTH:
            raise _too_deep()
        stack.extend((child, depth + 1) for child in children)


def _check_depth(value: Any) -> None:
    """:func:`check_json_value`'s depth alone: through arrays and objects, a level at a time,
    past the rest (a parsed body's arrays and objects are exactly lists and dicts)."""
    level, depth = [value], 1
    while level:
        if depth > MAX_JSON_DEPTH:
            raise _too_deep()
        below = []
        for item in level:
            for child in item.values() if type(item) is dict else item:
                if type(child) is dict or type(child) is list:
                    below.append(child)
        level, depth = below, depth + 1


_SURROGATE = re.compile("[\ud800-\udfff]")
#: What a surrogate can come from in a UTF-8 body: an escape of one, or its own bytes (the
#: body is decoded with ``surrogatepass``). An escaped backslash before ``ud800`` matches too:
#: that body is walked, to no harm.
_SURROGATE_BYTES = re.compile(rb"\\u[dD][89a-fA-F]|\xed[\xa0-\xbf]")
