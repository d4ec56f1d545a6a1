"""Where a request's time goes, as its ``Server-Timing`` says (strata_serve.timing): the
core's own spans on the way in (``read``, ``key``) and the engine's answer (``engine``),
each measured where it happens, on the real engine."""

from __future__ import annotations

import asyncio
import json
import time

import strata_serve
from strata_serve.api import SERVICE
from strata_serve.testing import chat_body, until_idle
from strata_serve.timing import read_server_timing as spans

#: How long the slow client waits between the two halves of its body, and the keying plugin
#: takes to choose a key: far above what the steps take here (well under a millisecond).
BODY_PAUSE_S = 1.0
KEY_S = 0.05
#: The line between a read that waited for the body's second half and one that did not: the
#: read begins a few turns of the event loop after the first half came, so it may take a
#: little less than the pause.
READ_WAITED_MS = BODY_PAUSE_S * 1000 / 2


class SlowKey:
    """Takes ``KEY_S`` to choose a key."""

    strata_name = "slow_key"

    @strata_serve.hookimpl
    def conversation_key(self, request):
        time.sleep(KEY_S)
        return "slow-key"


async def test_a_plain_answer_says_how_long_its_body_its_key_and_the_engine_took(strata_client_factory):
    client = await strata_client_factory(SlowKey())
    body = chat_body("Where do rivers go?", max_tokens=16, ignore_eos=True)
    raw = json.dumps(body).encode()

    async def halves():
        yield raw[:10]
        await asyncio.sleep(BODY_PAUSE_S)  # the rest of the body comes later
        yield raw[10:]

    began = time.perf_counter()
    resp = await client.post("/v1/chat/completions", data=halves(), headers={"Content-Type": "application/json"})
    answer = await resp.json()
    total_ms = (time.perf_counter() - began) * 1000
    assert resp.status == 200, answer
    assert resp.headers["X-Strata-Conversation"] == "slow-key"
    timing = spans(resp.headers["Server-Timing"])
    # The body's read waited for its second half; the key took the plugin's time.
    assert READ_WAITED_MS <= timing["read"] < total_ms, timing
    assert KEY_S * 1000 <= timing["key"] < timing["read"], timing
    # The engine's answer, as the relay waited for it: at least the engine's own reading and
    # writing, at most the whole request less the spans before it.
    engine_own = answer["timings"]["prompt_ms"] + answer["timings"]["predicted_ms"]
    assert engine_own <= timing["engine"] <= total_ms - timing["read"] - timing["key"], (timing, engine_own)
    # The control: a body sent whole, with the same key, reads fast.
    again = await client.post("/v1/chat/completions", json=body)
    assert again.status == 200
    quick = spans(again.headers["Server-Timing"])
    assert quick["read"] < READ_WAITED_MS and quick["key"] >= KEY_S * 1000, quick
    service = client.app[SERVICE]
    await until_idle(service)  # a turn's spans count once it has ended
    totals = service.phases.snapshot()
    assert totals["count"]["read"] == totals["count"]["key"] == totals["count"]["engine"] == 2, totals


async def test_a_streams_engine_span_counts_in_the_totals(strata_client_factory):
    client = await strata_client_factory()
    resp = await client.post("/v1/chat/completions", json=chat_body("Tell me of the sea", max_tokens=16, stream=True,
                                                                     ignore_eos=True))
    assert resp.status == 200
    timing = spans(resp.headers["Server-Timing"])
    assert "read" in timing and "engine" not in timing, timing  # its headers leave before its answer
    assert "[DONE]" in await resp.text()
    service = client.app[SERVICE]
    await until_idle(service)
    totals = service.phases.snapshot()
    assert totals["count"]["engine"] == 1 and totals["ms"]["engine"] > 0, totals
