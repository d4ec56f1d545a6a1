"""What an API the engine speaks says about its work, how it ends a stream, how it tells an error.

Each API declares its format in its module (:class:`ApiFormat` here is OpenAI chat's and
completions'; Anthropic's, the Responses API's and the engine's own are beside their
APIs). The relay is the same for every API; what differs is where the engine's numbers are
(under the engine's own key, ``Engine.numbers_key``, on OpenAI chat and the engine's own
routes; ``usage`` alone on Anthropic's Messages and on the Responses API's plain
answers), which event ends a stream, and how an error is told (inside a stream whose
headers are already gone, and as a whole answer: :attr:`ApiFormat.errors`). The core needs three
numbers from every answer that ran in a slot (:class:`~strata_serve.Timings`): prompt
tokens reused, prompt tokens read anew and tokens generated. The engine's own numbers
are found here, under its key, and read by the engine backend
(``Engine.read_timings``); where there are none, the API's ``usage`` says as much as it
can (:meth:`ApiFormat.timings_from_usage`).
"""

from __future__ import annotations

import functools
import json
import re
from typing import Any

from strata_serve.api.errors import OPENAI_ERRORS, ErrorShape
from strata_serve.engine.results import Timings, token_count


class ApiFormat:
    """OpenAI chat and completions (and embeddings): the engine's own numbers, else ``usage``."""

    name = "openai"
    #: How an error is told on the API's paths (:class:`~strata_serve.api.errors.ErrorShape`).
    errors: ErrorShape = OPENAI_ERRORS
    #: Bytes that mark an SSE event worth parsing; a plain token event is passed by unparsed.
    #: (An event with the engine's own numbers is worth parsing too: see :class:`StreamSeen`.)
    markers: tuple[bytes, ...] = (b'"usage"', b'"error"', b'"finish_reason":"', b'"finish_reason": "')
    #: Bytes without which a ``data:`` line cannot end the stream (see :meth:`done`).
    done_markers: tuple[bytes, ...] = (b"[DONE]",)

    def engine_numbers(self, answer: Any, key: str | None) -> Any:
        """The engine's own numbers in a whole (non-streamed) answer (under its ``key``)."""
        return answer.get(key) if key is not None and isinstance(answer, dict) else None

    def usage(self, answer: Any) -> Any:
        """The ``usage`` of a whole (non-streamed) answer."""
        return answer.get("usage") if isinstance(answer, dict) else None

    def timings_from_usage(self, usage: Any) -> Timings | None:
        """OpenAI's ``usage``: ``prompt_tokens`` (reused ones included, as
        ``prompt_tokens_details.cached_tokens``) and ``completion_tokens``. Without
        ``cached_tokens`` it says nothing of reuse, so nothing is read from it."""
        if not isinstance(usage, dict):
            return None
        prompt, details = token_count(usage.get("prompt_tokens")), usage.get("prompt_tokens_details")
        reused = token_count(details.get("cached_tokens")) if isinstance(details, dict) else None
        if prompt is None or reused is None:
            return None
        reused = min(reused, prompt)
        return Timings(reused=reused, prefilled=prompt - reused,
                       generated=token_count(usage.get("completion_tokens")) or 0)

    def read_event(self, event: dict[str, Any], seen: StreamSeen) -> None:
        """Learn what one parsed SSE event says."""
        seen.read_numbers(event)
        if isinstance(event.get("usage"), dict):
            seen.usage = event["usage"]
        if "error" in event:
            seen.error = str(event["error"])
        for choice in event.get("choices") or []:
            if isinstance(choice, dict) and choice.get("finish_reason"):
                seen.finished = True

    def done(self, data: bytes, seen: StreamSeen) -> bool:
        """Whether a ``data:`` line that is not JSON ends the stream (OpenAI's ``[DONE]``)."""
        return data == b"[DONE]"

    def stream_error(self, message: str, kind: str) -> bytes:
        """An event telling the client, inside the stream, that it ended in an error."""
        event = {"error": {"message": message, "type": kind, "param": None, "code": None}}
        return b"data: " + json.dumps(event).encode() + b"\n\n"


@functools.cache
def _markers(api: ApiFormat, numbers_key: str | None) -> tuple[tuple[bytes, ...], re.Pattern[bytes]]:
    """An API's markers with the engine's key for its numbers, and a pattern finding any of
    those or the ends (one search over a chunk, not one per marker)."""
    markers = api.markers if numbers_key is None else (*api.markers, json.dumps(numbers_key).encode())
    return markers, re.compile(b"|".join(re.escape(marker) for marker in markers + api.done_markers))


class StreamSeen:
    """What the relay learnt from a stream's events as they passed.

    ``numbers_key``: where the engine puts its own numbers in an event (``Engine.numbers_key``).
    """

    def __init__(self, api: ApiFormat, numbers_key: str | None) -> None:
        self.api = api
        self.numbers_key = numbers_key
        #: Bytes that mark an event worth parsing; with the ends, a chunk worth reading.
        self.markers, worth_reading = _markers(api, numbers_key)
        self._search = worth_reading.search
        self._buffer = b""
        #: The engine's own numbers (under its key), for the backend to read.
        self.timings: dict[str, Any] | None = None
        self.usage: dict[str, Any] | None = None
        self.finished = False
        #: The stream's last event was seen (OpenAI's ``[DONE]``, Anthropic's ``message_stop``):
        #: nothing the client needs comes after it.
        self.ended = False
        self.error: str | None = None

    def feed(self, chunk: bytes) -> None:
        # Called for every chunk the engine sends (most often one token): whole events of
        # plain tokens, most chunks, cost one search.
        if not self._buffer and chunk.endswith(b"\n") and self._search(chunk) is None:
            return
        self._buffer += chunk
        *lines, self._buffer = self._buffer.split(b"\n")
        for line in lines:
            line = line.strip()
            if not line.startswith(b"data:"):
                continue  # ``event:`` lines name what the data says again in its ``type``
            data = line[5:].strip()
            if self.api.done(data, self):
                self.finished = self.ended = True
                continue
            if not any(marker in data for marker in self.markers):
                continue  # a plain token: nothing to learn, and parsing each one costs speed
            try:
                event = json.loads(data)
            except ValueError:
                continue
            if isinstance(event, dict):
                self.api.read_event(event, self)

    def read_numbers(self, event: dict[str, Any]) -> None:
        """Keep the engine's own numbers when ``event`` carries them."""
        if self.numbers_key is not None and isinstance(event.get(self.numbers_key), dict):
            self.timings = event[self.numbers_key]


#: OpenAI chat's and completions' format, the one an API has unless it declares another.
OPENAI = ApiFormat()
