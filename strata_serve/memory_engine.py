"""An in-memory engine: a second backend, and a test double for plugin unit tests, never a real engine.

:class:`MemoryEngine` follows :class:`strata_serve.engine.base.Engine` closely enough
for the service, the OpenAI chat and completions routes and slot files to work, in
milliseconds and without llama-server. A "token" is one character of the prompt as
the double renders it; timings are synthetic but consistent (what the slot held is
reused, the rest is "prefilled") and in a shape of the double's own, under a key of
its own (:attr:`MemoryEngine.numbers_key`), which only its ``read_timings`` understands,
as another engine's would be; answers are a fixed text. Its slot reports and slot calls
answer in the core's types directly. Slot files are written to
``info.slot_save_path`` when it is set (auto-sessions checks them on disk), else kept
in memory.

Use it for what a plugin decides (keys, verdicts, what to save when); use the real
engine (``strata_client_factory``) for what the engine does.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any
from collections.abc import AsyncIterator, Awaitable, Callable

from strata_serve.engine.base import ContextOverflow, EngineInfo, SlotErased, SlotReport, SlotRestored, SlotSaved
from strata_serve.engine.state_blocks import StateFormat
from strata_serve.engine.results import Timings

#: What the double answers, token by token (one token per character, like its prompts).
ANSWER = "ok."


def render(body: dict[str, Any]) -> str:
    """The prompt as the double "tokenizes" it: one token per character."""
    if isinstance(body.get("messages"), list):
        return "".join(f"<{m.get('role')}>{m.get('content')}" for m in body["messages"] if isinstance(m, dict))
    prompt = body.get("prompt")
    return prompt if isinstance(prompt, str) else json.dumps(body, sort_keys=True)


class MemoryEngine:
    """One slot, slot files, synthetic timings; see the module's docstring."""

    capabilities = frozenset({"slots", "slot_files", "tokens"})
    #: What it answers; every other route of the API is ``not_supported`` (404).
    routes = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/models"})
    #: One slot: every request runs in it.
    pinned_routes = routes
    #: Where its own numbers travel in an answer: no other engine's key.
    numbers_key = "memory_engine"
    #: Its files are its own JSON, kept whole.
    state_format: StateFormat | None = None

    def __init__(self, slot_save_path: Path | None = None, n_ctx: int = 4096):
        self.info = EngineInfo(url="memory://engine", model_path="memory-engine", n_ctx=n_ctx,
                               slot_save_path=Path(slot_save_path) if slot_save_path else None)
        self.generation = 0
        self.on_start: Callable[[bool], Awaitable[None]] | None = None
        self.slot: str = ""
        self.files: dict[str, str] = {}
        self.requests: list[dict[str, Any]] = []
        self._ready = False

    # -- life cycle ----------------------------------------------------------------

    async def start(self) -> None:
        self.generation += 1
        self.slot = ""
        if self.on_start is not None:
            await self.on_start(self.generation > 1)
        self._ready = True

    async def stop(self) -> None:
        self._ready = False

    def kill(self) -> None:
        self._ready = False

    @property
    def ready(self) -> bool:
        return self._ready

    async def wait_ready(self) -> None:
        return None

    async def health(self) -> bool:
        return self._ready

    async def prompt_tokens(self, path: str, body: dict[str, Any]) -> list[int] | None:
        """One token per character of the prompt, as it reads it (its code point)."""
        return [ord(c) for c in render(body)] if path in self.routes and path != "/v1/models" else None

    # -- answers ----------------------------------------------------------------------

    def _answer(self, body: dict[str, Any]) -> tuple[dict[str, Any], str]:
        prompt = render(body)
        reused = 0
        while reused < min(len(prompt), len(self.slot)) and prompt[reused] == self.slot[reused]:
            reused += 1
        reused = min(reused, max(len(prompt) - 1, 0))  # the last prompt token is always evaluated
        text = ANSWER[: max(1, min(int(body.get("max_tokens") or len(ANSWER)), len(ANSWER)))]
        self.slot = prompt + text[:-1]  # the last token generated is never fed back
        self.requests.append(body)
        # Its own numbers, in its own shape: the core learns them through read_timings alone.
        timings = {"kept": reused, "read": len(prompt) - reused, "read_us": (len(prompt) - reused) * 10,
                   "written": len(text), "written_us": len(text) * 10}
        return timings, text

    async def request(self, method: str, path: str, json: Any = None, *, op: str = "request",
                      resend: bool = True) -> tuple[int, Any]:
        if method == "GET" and path == "/v1/models":
            return 200, {"object": "list", "data": [{"id": "memory-engine", "object": "model"}]}
        if method != "POST" or path not in ("/v1/chat/completions", "/v1/completions"):
            return 404, {"error": {"code": 404, "message": f"the memory engine has no {method} {path}",
                                   "type": "not_found_error"}}
        timings, text = self._answer(json or {})
        prompt_tokens = timings["kept"] + timings["read"]
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": len(text),
                 "total_tokens": prompt_tokens + len(text)}
        if path == "/v1/completions":
            choice: dict[str, Any] = {"index": 0, "text": text, "finish_reason": "length"}
        else:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "length"}
        return 200, {"object": "chat.completion", "model": "memory-engine", "choices": [choice],
                     "usage": usage, self.numbers_key: timings}

    @contextlib.asynccontextmanager
    async def stream(self, path: str, json: Any) -> AsyncIterator[MemoryStream]:
        status, answer = await self.request("POST", path, {**(json or {}), "stream": False})
        yield MemoryStream(status, answer)

    # -- the slot ---------------------------------------------------------------------

    async def save(self, filename: str, slot: int = 0) -> SlotSaved:
        data = self.slot.encode()
        if self.info.slot_save_path is not None:
            (self.info.slot_save_path / filename).write_bytes(data)
        self.files[filename] = self.slot
        return SlotSaved(tokens=len(self.slot), bytes=len(data), raw={"slot": slot, "file": filename})

    async def restore(self, filename: str, slot: int = 0) -> SlotRestored:
        if self.info.slot_save_path is not None:
            path = self.info.slot_save_path / filename
            self.slot = path.read_bytes().decode() if path.is_file() else ""
        else:
            self.slot = self.files.get(filename, "")
        return SlotRestored(tokens=len(self.slot), bytes=len(self.slot.encode()),
                            raw={"slot": slot, "file": filename})

    async def erase(self, slot: int = 0) -> SlotErased:
        erased, self.slot = len(self.slot), ""
        return SlotErased(tokens=erased, raw={"slot": slot})

    async def slots(self) -> list[SlotReport]:
        """Its one slot; a task is a request it answered (numbered from 1)."""
        return [SlotReport(id=0, processing=False, task=len(self.requests), tokens=len(self.slot),
                           raw={"slot": 0, "tokens": len(self.slot)})]

    def read_timings(self, numbers: Any) -> Timings | None:
        """The double's numbers (``kept``, ``read``, ``written``, in microseconds) in the core's terms."""
        if not isinstance(numbers, dict) or not isinstance(numbers.get("kept"), int):
            return None
        return Timings(reused=numbers["kept"], prefilled=numbers["read"], generated=numbers["written"],
                       prefill_ms=numbers["read_us"] / 1000, generate_ms=numbers["written_us"] / 1000, raw=numbers)


    def read_overflow(self, error: dict[str, Any]) -> ContextOverflow | None:
        """Never: the double takes a prompt of any length."""
        return None


class MemoryStream:
    """The double's streamed answer: the chunks an OpenAI-compatible engine would send."""

    def __init__(self, status: int, answer: dict[str, Any]):
        self.status = status
        self._answer = answer

    async def body(self) -> Any:
        return self._answer

    async def chunks(self) -> AsyncIterator[bytes]:
        choice = self._answer["choices"][0]
        text = choice.get("text") or choice.get("message", {}).get("content", "")
        for piece in text:
            yield _event({"choices": [{"index": 0, "delta": {"content": piece}, "finish_reason": None}]})
        yield _event({"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}],
                      "usage": self._answer["usage"],
                      MemoryEngine.numbers_key: self._answer[MemoryEngine.numbers_key]})
        yield b"data: [DONE]\n\n"


def _event(data: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(data).encode() + b"\n\n"
