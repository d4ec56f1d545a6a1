"""What the relay learns from a stream does not depend on how the bytes were cut into chunks."""

import json

from hypothesis import given, strategies as st

from strata_serve import Timings
from strata_serve.api.anthropic import ANTHROPIC
from strata_serve.api.formats import OPENAI, StreamSeen
from strata_serve.api.llama import LLAMA
from strata_serve.api.responses import RESPONSES
from strata_serve.engine.llama_server import read_llama_timings

TIMINGS = {"cache_n": 40, "prompt_n": 7, "predicted_n": 3}
#: What every stream below says it cost, in the core's terms.
COST = Timings(reused=40, prefilled=7, generated=3)


def sse(*events: dict | str, named: bool = False) -> bytes:
    out = b""
    for event in events:
        data = event if isinstance(event, str) else json.dumps(event, separators=(",", ":"))
        if named and isinstance(event, dict):
            out += f"event: {event['type']}\n".encode()
        out += f"data: {data}\n\n".encode()
    return out


def token(text: str) -> dict:
    return {"choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}],
            "object": "chat.completion.chunk"}


STREAMS = {
    "openai": (OPENAI, sse(*[token(t) for t in ("a", "b", "c")],
                           {"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}], "timings": TIMINGS},
                           "[DONE]")),
    "openai, ended by [DONE] alone": (OPENAI, sse(token("a"), token("b"), "[DONE]")),
    "openai, an error": (OPENAI, sse(token("a"), {"error": {"message": "boom"}})),
    "openai, usage alone (another engine)": (OPENAI, sse(
        token("a"), {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}],
                     "usage": {"prompt_tokens": 47, "completion_tokens": 3, "prompt_tokens_details": {"cached_tokens": 40}}},
        "[DONE]")),
    "llama": (LLAMA, sse({"content": "a", "stop": False}, {"content": "", "stop": True, "timings": TIMINGS})),
    "anthropic": (ANTHROPIC, sse(
        {"type": "message_start", "message": {"usage": {"input_tokens": 7, "cache_read_input_tokens": 40,
                                                          "output_tokens": 0}}},
        {"type": "content_block_delta", "delta": {"type": "text_delta", "text": "a"}},
        {"type": "message_delta", "usage": {"output_tokens": 3}},
        {"type": "message_stop"}, named=True)),
    "responses": (RESPONSES, sse(
        {"type": "response.output_text.delta", "delta": "a"},
        {"type": "response.completed", "response": {"usage": {"input_tokens": 47, "output_tokens": 3,
                                                              "input_tokens_details": {"cached_tokens": 40}}},
         "timings": TIMINGS},
        "[DONE]", named=True)),
}


def learnt(api, chunks: list[bytes]) -> tuple:
    """What the relay learns, with the engine's numbers read as llama-server's backend reads them."""
    seen = StreamSeen(api)
    for chunk in chunks:
        seen.feed(chunk)
    timings = read_llama_timings(seen.timings) or api.timings_from_usage(seen.usage)
    return timings, seen.usage, seen.finished, seen.error


def test_every_stream_tells_its_numbers_and_its_end():
    for name, (api, stream) in STREAMS.items():
        timings, _usage, finished, error = learnt(api, [stream])
        if name == "openai, an error":
            assert error is not None and "boom" in error and not finished
        elif name == "openai, ended by [DONE] alone":
            assert finished and error is None and timings is None
        else:
            assert finished and error is None, name
            assert timings == COST, name


def test_an_anthropic_stream_cut_before_its_output_count_says_nothing():
    """``message_start`` counts the prompt; the engine goes on writing after the client left."""
    _, stream = STREAMS["anthropic"]
    cut = stream[: stream.index(b"event: content_block_delta")]
    timings, usage, finished, _ = learnt(ANTHROPIC, [cut])
    assert usage and not finished and timings is None


def test_usage_without_cached_tokens_says_nothing_of_reuse():
    assert OPENAI.timings_from_usage({"prompt_tokens": 47, "completion_tokens": 3}) is None
    assert OPENAI.timings_from_usage({"prompt_tokens": 47, "prompt_tokens_details": {"cached_tokens": 90}}) == \
        Timings(reused=47, prefilled=0), "never more reused than the prompt"


def test_llama_timings_are_read_with_their_milliseconds_and_kept_raw():
    raw = {**TIMINGS, "prompt_ms": 12.5, "predicted_ms": 30, "predicted_per_second": 100.0}
    timings = read_llama_timings(raw)
    assert timings == Timings(reused=40, prefilled=7, generated=3, prefill_ms=12.5, generate_ms=30.0)
    assert timings.raw is raw and timings.prompt_tokens == 47 and timings.context_tokens == 50
    for nonsense in (None, [], {"predicted_n": 3}, {"cache_n": -1, "prompt_n": "7"}, {"cache_n": True}):
        assert read_llama_timings(nonsense) is None, nonsense


@given(st.sampled_from(sorted(STREAMS)), st.lists(st.integers(min_value=0, max_value=2000), max_size=40))
def test_the_same_whatever_the_chunks(name, cuts):
    api, stream = STREAMS[name]
    points = sorted({cut % (len(stream) + 1) for cut in cuts})
    chunks = [stream[a:b] for a, b in zip([0, *points], [*points, len(stream)])]
    assert learnt(api, chunks) == learnt(api, [stream])
    assert learnt(api, [bytes([byte]) for byte in stream]) == learnt(api, [stream])
