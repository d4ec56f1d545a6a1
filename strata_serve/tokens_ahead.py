"""A request's prompt as the engine reads it (its tokens): asked once per request, beside the FIFO.

A plugin that restores a conversation by its tokens needs the tokens the incoming prompt
becomes (:meth:`strata_serve.engine.base.Engine.prompt_tokens`: the engine's own template
and tokenizer, which the engine runs beside its slots' work). Asked in the request's own
step, that time is on the switch's path. Asked as the request arrives (the ``on_arrival``
hook: :meth:`strata_serve.Service.tokens_ahead`), it runs while the request waits for its
turn and while the slot's outgoing conversation is saved. The first ask starts the engine's
call; every later one awaits the same answer, for the body as it was when first asked.
"""

from __future__ import annotations

import asyncio
import contextlib

from strata_serve.engine.base import Engine, EngineUnavailable
from strata_serve.hook_types import StrataRequest


def start(engine: Engine, request: StrataRequest) -> None:
    """Ask ``engine`` for ``request``'s prompt tokens now, unless asked already."""
    if request._tokens is None:
        request._tokens = asyncio.ensure_future(_ask(engine, request))
        request._tokens.add_done_callback(_retrieved)


async def prompt_tokens(engine: Engine, request: StrataRequest) -> list[int] | None:
    """``request``'s prompt tokens, the answer asked ahead when there is one (else asked now).

    An answer asked ahead while the engine was down is asked again: the request's own
    step runs once the engine is up. Awaiting it never cancels the shared call.

    :returns: None when the engine cannot tell (no ``tokens`` capability, an API without
        a path at the engine, a prompt it does not tokenize alone), or the request has no
        ``api`` (one built by hand, not by the relay).
    :raises EngineError: when the engine refused.
    :raises EngineUnavailable: when it could not be reached.
    """
    task = request._tokens
    if task is not None and task.done() and not task.cancelled() and isinstance(task.exception(), EngineUnavailable):
        request._tokens = None
    start(engine, request)
    assert request._tokens is not None
    return await asyncio.shield(request._tokens)


async def _ask(engine: Engine, request: StrataRequest) -> list[int] | None:
    api = request.api  # as the relay gives it (a request built without one: None)
    if api is None or not api.engine_path or "tokens" not in engine.capabilities:
        return None
    return await engine.prompt_tokens(api.engine_path, request.body)


def _retrieved(task: asyncio.Future) -> None:
    # An answer nobody awaited (the request left the line first) is dropped without the
    # "exception was never retrieved" warning; one awaited raises there.
    with contextlib.suppress(asyncio.CancelledError):
        task.exception()
