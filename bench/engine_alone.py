"""strata-serve against its own engine alone: streaming, a 1-token request, eight clients at once.

``strata-serve run`` in its own process with its defaults (its installed plugins),
told its engine's port and key, so the same engine is asked directly too
(:func:`bench.layer_cost.strata_process`). Each figure alternates the engine alone and
strata-serve in one run, and is given as a ratio:

- streaming: streams of 150 tokens (``ignore_eos``), tokens/s over the whole call, and
  the engine's own decode speed in them (``predicted_per_second``): where that is lower
  through strata-serve, the layer's CPU took from the engine's threads;
- a 1-token request: p50 latency, streamed and not, a new connection for each;
- eight clients, each its own short chat (a ~60-token opening, 8 tokens out, 8 turns),
  all at once: requests/s over the whole round.

``python -m bench.engine_alone [--quick] [--tiny]`` prints the figures; ``bench.run``
puts its table in ``bench/results/README.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

from bench.harness import chat, client_session, follow_up, percentile
from bench.layer_cost import _one, cpu_seconds, strata_process

#: strata-serve with its defaults: auto-sessions with its own.
DEFAULTS: dict[str, Any] = {"auto_sessions": {}}
CTX_SIZE = 8192
WORDS = ("river stone lantern orchard meadow harbour falcon ember willow quarry thistle copper marsh "
         "beacon juniper saddle cinder hollow bramble tide").split()


def opening(client: int, words: int = 45) -> list[dict[str, str]]:
    """A client's own first message: about 60 tokens, unlike every other client's from its first word."""
    picked = [WORDS[(client * 7 + n * (client + 3)) % len(WORDS)] for n in range(words)]
    return [{"role": "user", "content": f"Client {client} asks: " + " ".join(picked) + ". Go on."}]


def sizes(quick: bool) -> dict[str, int]:
    if quick:
        return {"streams": 2, "stream_tokens": 32, "requests": 10, "blocks": 1, "clients": 8, "turns": 2}
    return {"streams": 16, "stream_tokens": 150, "requests": 40, "blocks": 3, "clients": 8, "turns": 8}


async def _plain(session: aiohttp.ClientSession, url: str, messages: list[dict]) -> float:
    return await _one(session, url, messages, stream=False)


async def measure(model: Path, work: Path, *, streams: int, stream_tokens: int, requests: int, blocks: int,
                  clients: int, turns: int, source: Path | None = None,
                  engine: dict[str, Any] | None = None) -> dict[str, Any]:
    """Every measure, interleaved; ``source``: strata-serve from that tree (an earlier version);
    ``engine``: engine settings over its defaults (an earlier version's differ: 7c39d15 ran a
    side slot of 2,048 tokens by default, two slots in the engine)."""
    found: dict[str, Any] = {"sizes": {"streams": streams, "stream_tokens": stream_tokens, "requests": requests,
                                       "blocks": blocks, "clients": clients, "turns": turns}}
    short = [{"role": "user", "content": "Say something about rivers."}]
    async with strata_process(model, work, ctx=CTX_SIZE, plugins=DEFAULTS, source=source,
                              engine=engine) as (strata_url, engine_url, pid), \
            client_session() as session:
        urls = {"engine": engine_url, "strata": strata_url}
        for url in urls.values():
            await chat(session, url, short)  # warm: the prompt is cached from here on

        def order(n: int) -> tuple[str, str]:
            return ("engine", "strata") if n % 2 else ("strata", "engine")

        # Streaming: tokens/s over the whole call, and the layer's CPU per token.
        tps: dict[str, list[float]] = {"engine": [], "strata": []}
        decode: dict[str, list[float]] = {"engine": [], "strata": []}  # the engine's own tokens/s
        cpu, tokens = 0.0, 0
        for n in range(streams):
            for name in order(n):
                before = cpu_seconds(pid)
                reply = await chat(session, urls[name], short, max_tokens=stream_tokens, ignore_eos=True)
                predicted = reply.timings.get("predicted_n", 0)
                tps[name].append(predicted / reply.total_s)
                decode[name].append(reply.timings.get("predicted_per_second", 0.0))
                if name == "strata":
                    cpu += cpu_seconds(pid) - before
                    tokens += predicted
        found["stream_tps"] = tps
        found["stream_ratios"] = [s / e for s, e in zip(tps["strata"], tps["engine"])]
        found["stream_ratio"] = statistics.median(tps["strata"]) / statistics.median(tps["engine"])
        # The engine's decoding speed as it reports it: lower through strata-serve when the
        # layer's CPU per token takes from the engine's threads (2 cores), not the relay's delay.
        found["stream_decode_tps"] = decode
        alone = statistics.median(decode["engine"])
        found["stream_decode_ratio"] = statistics.median(decode["strata"]) / alone if alone else None
        found["cpu_s_per_1000_tokens"] = cpu / tokens * 1000 if tokens else None

        # A 1-token request, a new connection each (client_session closes every one).
        for kind in ("stream", "json"):
            times: dict[str, list[float]] = {"engine": [], "strata": []}
            for n in range(requests):
                for name in order(n):
                    times[name].append((await chat(session, urls[name], short)).total_s if kind == "stream"
                                       else await _plain(session, urls[name], short))
            found[f"one_token_{kind}_p50_ms"] = {name: percentile(t, 50) * 1000 for name, t in times.items()}
            found[f"one_token_{kind}_added_p50_ms"] = (found[f"one_token_{kind}_p50_ms"]["strata"]
                                                      - found[f"one_token_{kind}_p50_ms"]["engine"])

        # Eight clients, each its own chat, all at once.
        async def client(url: str, number: int, block: int) -> int:
            messages = opening(number + 100 * block)
            for turn in range(turns):
                reply = await chat(session, url, messages, max_tokens=8, ignore_eos=True)
                messages = follow_up(messages, reply.text, f"Turn {turn + 2}: and then?")
            return turns

        rps: dict[str, list[float]] = {"engine": [], "strata": []}
        for n in range(blocks):
            for name in order(n):
                began = time.perf_counter()
                done = await asyncio.gather(*(client(urls[name], c, 2 * n + (name == "strata"))
                                              for c in range(clients)))
                rps[name].append(sum(done) / (time.perf_counter() - began))
        found["clients_rps"] = rps
        found["clients_ratios"] = [s / e for s, e in zip(rps["strata"], rps["engine"])]
        found["clients_ratio"] = statistics.median(rps["strata"]) / statistics.median(rps["engine"])
    return found


def _range(values: list[float], digits: int) -> str:
    return f", {min(values):.{digits}f}-{max(values):.{digits}f}" if len(values) > 1 else ""


def report(found: dict[str, Any], model: str) -> list[str]:
    s = found["sizes"]
    stream_e, stream_s = (statistics.median(found["stream_tps"][n]) for n in ("engine", "strata"))
    rps_e, rps_s = (statistics.median(found["clients_rps"][n]) for n in ("engine", "strata"))
    one = found["one_token_stream_p50_ms"]
    plain = found["one_token_json_p50_ms"]
    return [
        "",
        f"## Against its own engine alone, {model}",
        "",
        "`strata-serve run` with its defaults (its installed plugins) in its own process; the same engine "
        "it started, asked directly, alternating with it in this one run. Streaming: "
        f"{s['streams']} streams of {s['stream_tokens']} tokens each way, tokens/s over the whole call. A 1-token "
        f"request: {s['requests']} each way, a new connection each. {s['clients']} clients at once, each its own "
        f"chat (a ~60-token opening, 8 tokens out, {s['turns']} turns), {s['blocks']} round(s) each way. In "
        "brackets: strata-serve / the engine, and the lowest-highest ratio of the interleaved pairs.",
        "",
        "| measure | strata-serve / engine alone |",
        "|---|---|",
        f"| streaming tokens/s | {found['stream_ratio']:.3f} ({stream_s:.1f} / {stream_e:.1f}"
        f"{_range(found['stream_ratios'], 3)}) |",
        f"| the engine's own decode tokens/s in those streams | {found['stream_decode_ratio'] or 0:.3f} |",
        f"| 1-token request p50, streamed | {found['one_token_stream_added_p50_ms']:+.2f} ms "
        f"({one['strata']:.2f} / {one['engine']:.2f} ms) |",
        f"| 1-token request p50, JSON | {found['one_token_json_added_p50_ms']:+.2f} ms "
        f"({plain['strata']:.2f} / {plain['engine']:.2f} ms) |",
        f"| {s['clients']} clients, requests/s | {found['clients_ratio']:.3f} ({rps_s:.2f} / {rps_e:.2f}"
        f"{_range(found['clients_ratios'], 3)}) |",
        f"| layer CPU s per 1,000 streamed tokens | {found['cpu_s_per_1000_tokens'] or 0:.3f} |",
    ]


def cli() -> None:
    from strata_serve.demo_model import write_demo_model
    from strata_serve.models import packaged_model_path

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--tiny", action="store_true", help="the tiny demo model instead of SmolLM2")
    parser.add_argument("--json", type=Path, help="write the raw figures here")
    parser.add_argument("--before", type=Path, help="strata-serve from this tree (an earlier version) instead")
    parser.add_argument("--engine", action="append", default=[], metavar="SETTING=VALUE",
                        help="an engine setting over the defaults, its value as JSON (e.g. side_slot_tokens=0: "
                             "7c39d15 ran a side slot by default, so its figures are of another engine layout)")
    options = parser.parse_args()
    engine = {name: json.loads(value) for name, value in (item.split("=", 1) for item in options.engine)}
    with tempfile.TemporaryDirectory(prefix="strata-alone-") as tmp:
        model = write_demo_model(Path(tmp) / "tiny.gguf", size="tiny") if options.tiny \
            else packaged_model_path("smollm2")
        if model is None:
            raise SystemExit("SmolLM2 is not installed: run `make setup`")
        work = Path(tmp) / "work"
        work.mkdir()
        found = asyncio.run(measure(Path(model), work, **sizes(options.quick), source=options.before,
                                    engine=engine or None))
    print("\n".join(report(found, "tiny model" if options.tiny else "SmolLM2-135M")))
    if options.json:
        options.json.write_text(json.dumps(found, indent=1))


if __name__ == "__main__":
    cli()
