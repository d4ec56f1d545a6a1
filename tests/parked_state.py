"""Is a switched-back conversation answered from its own state? Shared by the model tests.

Equal greedy text says little: a model's first tokens may hardly depend on what its
KV state holds. The check here compares the top logprobs of the answer after a switch
and back with those of a fresh engine that went through the same conversation without
a switch, and runs a control that must fail the same comparison: the request on a
slot holding the *wrong* state, made by writing one conversation's tokens over another
conversation's KV data (the engine then reuses that state as if it were the first
conversation's).

The fresh engine replays the conversation rather than reading the last prompt in one
go: with quantized weights the engine's kernels round differently by batch size, so
a prompt read in one piece differs from one read in turns by a few hundredths of a
logprob (measured: 0.05 on the Q4_0 and Q8_0 demo models), while a replay computes
exactly what the parked state holds (measured: a difference of 0).
"""

from __future__ import annotations

import math
import struct
from pathlib import Path
from typing import Any

from strata_serve.api import SERVICE
from strata_serve.testing import until_idle

#: Candidates compared per generated token.
TOP = 5
#: Largest logprob difference allowed between the restored state and the replay.
TOLERANCE = 1e-3
#: Largest difference allowed where the conversation's state was built along other paths
#: than the reference's (several clients' turns of one conversation, restores of files
#: saved after other turns): the engine's float16 sums round differently by how a prompt
#: was split into batches. Measured from 0.003 to 0.016 (the largest in a run) on the
#: sharp demo model's load test, as the quantized models' kernels differ by 0.05; a wrong
#: state changes the answer's tokens there (an infinite distance).
PATH_TOLERANCE = 0.05
#: Smallest difference the wrong-state control must show (it usually changes the text).
WRONG_STATE_DISTANCE = 0.1
#: llama.cpp's sequence-state file starts with magic, version and the length of its token
#: section in i32 words (u32 each); that section (the slot's tokens, with a few words of
#: the server's own framing) comes next, then the KV data.
STATE_HEADER = struct.Struct("<III")


def sharp_demo_model(directory: Path) -> Path:
    """A random-weight demo model (float16) whose answers depend on the state they read.

    The tiny demo model's attention is near uniform: a wrong state moves its top logprobs
    by about 0.01 (measured), too little for a control. This shape's sharper weights make
    it a fair test, and it still reads a conversation in well under a second.
    """
    from strata_serve.demo_model import write_demo_model

    return write_demo_model(directory / "sharp.gguf", size="quant")


def logprob_body(messages: list[dict[str, Any]], max_tokens: int = 4, **extra: Any) -> dict[str, Any]:
    """A greedy chat request that asks for the top logprobs of each generated token."""
    return {"messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "logprobs": True, "top_logprobs": TOP, **extra}


def text_of(answer: dict[str, Any]) -> str:
    return answer["choices"][0]["message"]["content"]


def top_logprobs(answer: dict[str, Any]) -> list[tuple[str, dict[str, float]]]:
    """Per generated token: the token chosen and its top candidates' logprobs."""
    content = answer["choices"][0]["logprobs"]["content"]
    assert content, f"no logprobs in the answer: {answer}"
    return [(item["token"], {c["token"]: c["logprob"] for c in item["top_logprobs"]}) for item in content]


def logprob_distance(a: dict[str, Any], b: dict[str, Any]) -> float:
    """The largest difference of a shared candidate's logprob, over the tokens both chose alike.

    Infinite when the two answers choose different tokens somewhere (or stop at different
    lengths), or share fewer
    than ``TOP - 1`` of their candidates at a position (a near tie at the edge of the
    list may swap one).
    """
    steps_a, steps_b = top_logprobs(a), top_logprobs(b)
    if len(steps_a) != len(steps_b):
        return math.inf
    worst = 0.0
    for (chosen_a, top_a), (chosen_b, top_b) in zip(steps_a, steps_b):
        shared = top_a.keys() & top_b.keys()
        if chosen_a != chosen_b or len(shared) < TOP - 1:
            return math.inf
        worst = max(worst, *(abs(top_a[t] - top_b[t]) for t in shared))
    return worst


def reordered(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Another conversation with as many tokens: the first user message's words in reverse.

    With one token per character (the demo models) or a tokenizer that splits words
    before merging (SmolLM2's), the token count stays the same.
    """
    first, *words = messages[0]["content"].split(" ")
    return [{**messages[0], "content": " ".join([first, *reversed(words)])}, *messages[1:]]


def parking(client) -> Any:
    return client.app[SERVICE].state["auto_sessions"]


async def ask(client, body: dict[str, Any]) -> dict[str, Any]:
    resp = await client.post("/v1/chat/completions", json=body)
    assert resp.status == 200, await resp.text()
    return await resp.json()


async def engine_ask(engine, body: dict[str, Any]) -> dict[str, Any]:
    status, answer = await engine.request("POST", "/v1/chat/completions", json=body)
    assert status == 200, answer
    return answer


async def switch_and_back(client, a: list[dict[str, Any]], b: list[dict[str, Any]],
                          max_tokens: int) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """A, then B (A is parked), then A's next turn (A is restored): its messages and answer."""
    first = await ask(client, logprob_body(a, max_tokens))
    await ask(client, logprob_body(b, max_tokens))
    a2 = a + [{"role": "assistant", "content": text_of(first)}, {"role": "user", "content": "Go on."}]
    back = await ask(client, logprob_body(a2, max_tokens))
    stats = parking(client).stats
    assert stats.saves >= 1 and stats.restores == 1, stats
    timings = back["timings"]
    assert timings["cache_n"] >= 0.9 * (timings["cache_n"] + timings["prompt_n"]) - 20, timings
    return a2, back


async def replayed_answer(engine, a: list[dict[str, Any]], a2: list[dict[str, Any]],
                          max_tokens: int) -> dict[str, Any]:
    """``a2`` answered by a fresh engine after ``a``, as if no other conversation came between."""
    first = await engine_ask(engine, logprob_body(a, max_tokens))
    assert first["timings"]["cache_n"] == 0, "the engine is not fresh"
    return await engine_ask(engine, logprob_body(a2, max_tokens))


async def wrong_state_answer(engine, slot_dir: Path, a: list[dict[str, Any]], b: list[dict[str, Any]],
                             a2: list[dict[str, Any]], max_tokens: int) -> dict[str, Any]:
    """``a2`` answered by a bare engine whose slot holds A's tokens over B's KV data."""
    saved = {}
    for name, messages in (("a", a), ("b", b)):
        await engine_ask(engine, {"messages": messages, "max_tokens": 1, "temperature": 0})
        saved[name] = await engine.save(f"control-{name}.bin")
    data = {name: (slot_dir / f"control-{name}.bin").read_bytes() for name in saved}
    counts = {name: STATE_HEADER.unpack_from(blob)[2] for name, blob in data.items()}
    assert all(0 <= counts[name] - s.tokens < 16 for name, s in saved.items()), (counts, saved)
    assert counts["a"] == counts["b"], f"the control needs two conversations of one length: {counts}"
    tokens_end = STATE_HEADER.size + 4 * counts["a"]
    assert data["a"][:tokens_end] != data["b"][:tokens_end]
    (slot_dir / "control-wrong.bin").write_bytes(data["a"][:tokens_end] + data["b"][tokens_end:])
    await engine.restore("control-wrong.bin")
    answer = await engine_ask(engine, logprob_body(a2, max_tokens))
    timings = answer["timings"]
    assert timings["cache_n"] >= 0.9 * saved["a"].tokens - 20, f"the wrong state was not reused: {timings}"
    return answer


async def settle(client, deadline_s: float = 30) -> None:
    """Wait (bounded) until the service is idle: every request has run or left."""
    await until_idle(client.app[SERVICE], deadline_s)
