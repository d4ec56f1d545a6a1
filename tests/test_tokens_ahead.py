"""A request's prompt tokens, asked once and beside the FIFO (strata_serve/tokens_ahead.py).

On the in-memory engine, whose call is counted; the end-to-end claim (asked while the
request waits in line, and found asked at its switch) is shown against the real engine in
plugins/auto_sessions/tests/test_restore_by_tokens.py."""

from __future__ import annotations

import asyncio

import pytest

from strata_serve import StrataRequest
from strata_serve.api.builtin import builtin
from strata_serve.engine.base import EngineUnavailable
from strata_serve.memory_engine import MemoryEngine
from strata_serve import tokens_ahead


class CountedEngine(MemoryEngine):
    """The in-memory engine, its prompt_tokens counted; down (EngineUnavailable) while
    ``down`` is set, and held until ``go`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.calls, self.down, self.go = 0, False, asyncio.Event()
        self.go.set()

    async def prompt_tokens(self, path, body):
        self.calls += 1
        await self.go.wait()
        if self.down:
            raise EngineUnavailable("the engine is restarting")
        return await super().prompt_tokens(path, body)


def chat_request(text: str = "hello", *, with_api: bool = True) -> StrataRequest:
    api = builtin().by_route["chat"]
    return StrataRequest(route="chat", body={"messages": [{"role": "user", "content": text}]},
                         api=api if with_api else None)


async def test_asked_once_however_many_ask():
    engine, request = CountedEngine(), chat_request()
    tokens_ahead.start(engine, request)
    tokens_ahead.start(engine, request)
    first, second = await asyncio.gather(tokens_ahead.prompt_tokens(engine, request),
                                         tokens_ahead.prompt_tokens(engine, request))
    assert first == second and first and engine.calls == 1


async def test_a_cancelled_reader_leaves_the_shared_call_running():
    engine, request = CountedEngine(), chat_request()
    engine.go.clear()
    reader = asyncio.ensure_future(tokens_ahead.prompt_tokens(engine, request))
    await asyncio.sleep(0)
    reader.cancel()
    with pytest.raises(asyncio.CancelledError):
        await reader
    engine.go.set()
    assert await tokens_ahead.prompt_tokens(engine, request), "the answer asked ahead is still there"
    assert engine.calls == 1


async def test_asked_while_the_engine_was_down_is_asked_again():
    engine, request = CountedEngine(), chat_request()
    engine.down = True
    tokens_ahead.start(engine, request)
    assert request._tokens is not None
    await asyncio.wait({request._tokens})  # failed: the engine was down
    engine.down = False
    assert await tokens_ahead.prompt_tokens(engine, request)
    assert engine.calls == 2


async def test_a_request_without_its_api_or_an_engine_without_tokens_gets_none():
    engine = CountedEngine()
    assert await tokens_ahead.prompt_tokens(engine, chat_request(with_api=False)) is None
    engine.capabilities = frozenset({"slots"})
    assert await tokens_ahead.prompt_tokens(engine, chat_request()) is None
    assert engine.calls == 0
