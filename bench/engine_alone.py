"""strata-serve against its own engine alone: streaming, a 1-token request, eight clients at once.

``strata-serve run`` in its own process with its defaults (its installed plugins),
told its engine's port and key, so the same engine is asked directly too
(:func:`bench.layer_cost.strata_process`). Each figure alternates the engine alone and
strata-serve in one run, and is given as a ratio:

- streaming: streams of 150 tokens (``ignore_eos``), tokens/s over the whole call, and
  the engine's own decode speed in them (``predicted_per_second``): where that is lower
  through strata-serve, the layer's CPU took from the engine's threads;
- a 1-token request: p50 latency, streamed and not, a new connection for each, with a
  90% interval for what strata-serve adds (a bootstrap over this run's requests); and
  not streamed over a connection kept from one request to the next, as the SDKs keep
  theirs (a client of llama-server gets its connection closed after each stream, so only
  the plain request keeps one); the plain one through strata-serve part by part, from
  its own ``Server-Timing``;
- eight clients, each its own short chat (a ~60-token opening, 8 tokens out, 8 turns),
  all at once: requests/s over the whole round, and the layer's CPU per request.

Every measure goes through a third way too: a bare relay
(:func:`bench.profile.bare_relay_process`, an aiohttp server that passes each request to
the same engine through aiohttp's client and its answer back, nothing else: no line, no
hooks), in its own process, on asyncio's loop. Its ratio to the engine alone is what such a
relay between client and engine costs on this machine, measured in the same run. Its
plain calls to the engine cost more than strata-serve's own, on uvloop:
:mod:`bench.http_floor` sets strata-serve beside relays that call the engine as it does,
each with another server. The streams go through two more ways: a byte relay
(:func:`bench.profile.byte_relay`, the bytes both ways as they come, no HTTP at all), what
passing a token through a Python event loop costs here at the least (the 1-token requests
go through it too: what any Python process on their path adds); and a thread relay
(:func:`bench.profile.thread_relay`, the same done by a blocking thread each way), what a
layer that relays a stream's bytes off its event loop could cost.

The streaming and eight-client ratios are the median of each round's pair's ratio
(:func:`bench.harness.paired_ratio`: the machine's speed moves between rounds by more than
the goals' margins), with a 90% interval (:func:`bench.harness.ratio_interval`): whether a
goal missed or met is more than this run's own spread.

``python -m bench.engine_alone [--quick] [--tiny]`` prints the figures; ``bench.run``
puts its table in ``bench/results/README.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

from bench.harness import BENCH_ENGINE_KEY, chat, client_session, follow_up, paired_ratio, percentile, ratio_interval
from bench.layer_cost import cpu_seconds, plain_one, strata_process
from bench.profile import bare_relay_process, byte_relay_process, thread_relay_process

#: strata-serve with its defaults: auto-sessions with its own.
DEFAULTS: dict[str, Any] = {"auto_sessions": {}}
CTX_SIZE = 8192
WORDS = ("river stone lantern orchard meadow harbour falcon ember willow quarry thistle copper marsh "
         "beacon juniper saddle cinder hollow bramble tide").split()


def opening(client: int, words: int = 45) -> list[dict[str, str]]:
    """A client's own first message: about 60 tokens, unlike every other client's from its first word."""
    picked = [WORDS[(client * 7 + n * (client + 3)) % len(WORDS)] for n in range(words)]
    return [{"role": "user", "content": f"Client {client} asks: " + " ".join(picked) + ". Go on."}]


#: An eight-token answer takes well under a second; one not given in this long never comes.
ANSWER_WITHIN_S = 60.0
#: auto-sessions' ``idle_save_s`` at its default: an idle conversation is saved this long after its answer.
IDLE_SAVE_S = 2.0


async def settle(session: aiohttp.ClientSession, url: str, timeout_s: float = 60.0) -> None:
    """Until strata-serve's work after its last answer is done: its idle save, which would
    otherwise run during the engine's own round, taking from it; and, on llama-server, a
    slot save sent while requests wait for the slot is run at one's turn and leaves those
    behind it waiting until another request comes (its queue pops one waiting task each
    time a slot is released, and a save releases none): eight clients asking the engine
    directly then waited forever. Done when the spans strata-serve counted (``GET /stats``,
    ``phases``) stop changing, after the idle save's delay."""
    await asyncio.sleep(IDLE_SAVE_S)
    deadline = time.monotonic() + timeout_s
    last = None
    while True:
        async with session.get(url + "/stats") as resp:
            phases = (await resp.json()).get("phases", {}) if resp.status == 200 else {}
        counted = sum(phases.get("count", {}).values())
        if counted == last:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"strata-serve at {url} was still at work {timeout_s:g} s after its last answer")
        last = counted
        await asyncio.sleep(0.5)


def sizes(quick: bool) -> dict[str, int]:
    if quick:
        return {"streams": 2, "stream_tokens": 32, "requests": 10, "blocks": 1, "clients": 8, "turns": 2}
    # 150 1-token requests each way: with 40 to 80, runs of one tree on one machine put the
    # added p50 up to 0.7 ms apart, more than the goal's margin.
    # 24 streams and 8 rounds of the clients: with 16 and 5, a ratio's 90% interval was 11-18
    # and 10-41 points wide (within one run, the engine alone streamed at 79-143 tokens/s).
    return {"streams": 24, "stream_tokens": 150, "requests": 150, "blocks": 8, "clients": 8, "turns": 8}


def added_interval(through: list[float], alone: list[float], rounds: int = 2000,
                   seed: int = 39) -> tuple[float, float]:
    """A 90% interval (ms) for how much ``through``'s p50 exceeds ``alone``'s: each resampled
    with replacement, ``rounds`` times (a bootstrap; seeded, so a run's figures repeat). It
    says whether a p50 over a goal is more than this run's own spread."""
    picks = random.Random(seed)
    added = sorted(
        (statistics.median(picks.choices(through, k=len(through)))
         - statistics.median(picks.choices(alone, k=len(alone)))) * 1000
        for _ in range(rounds))
    return added[int(rounds * 0.05)], added[int(rounds * 0.95) - 1]


async def _plain(session: aiohttp.ClientSession, url: str, messages: list[dict],
                 parts: list[dict[str, float]] | None = None) -> float:
    """A plain 1-token request's time; with ``parts``, its ``Server-Timing`` spans added to them."""
    took, spans = await plain_one(session, url, messages)
    if parts is not None:
        parts.append({**spans, "total": took * 1000})
    return took


#: strata-serve's own steps before a plain request reaches the engine, as its Server-Timing
#: names them (``pre_request`` holds each plugin's).
OWN_STEPS = ("read", "key", "queue", "ready", "pre_request")


def where_it_went(parts: list[dict[str, float]]) -> dict[str, float]:
    """Of plain requests through strata-serve, the median of each part (ms): its own steps
    before the engine, the engine's answer as it waited for it (the hop to the engine and
    back included), and the rest (``http``: the client's request reaching strata-serve's
    handler, and the answer handed back and leaving)."""
    known = [p for p in parts if "engine" in p]
    if not known:
        return {}
    found = {name: statistics.median(p.get(name, 0.0) for p in known) for name in (*OWN_STEPS, "engine", "total")}
    found["own"] = statistics.median(sum(p.get(name, 0.0) for name in OWN_STEPS) for p in known)
    found["http"] = statistics.median(
        p["total"] - p["engine"] - sum(p.get(name, 0.0) for name in OWN_STEPS) for p in known)
    return found


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
            bare_relay_process(engine_url, work) as (relay_url, relay_pid), \
            byte_relay_process(engine_url, work) as (bytes_url, bytes_pid), \
            thread_relay_process(engine_url, work) as (threads_url, threads_pid), \
            client_session() as session, \
            aiohttp.ClientSession(headers={"Authorization": f"Bearer {BENCH_ENGINE_KEY}"}) as kept_session:
        urls = {"engine": engine_url, "strata": strata_url}
        three = {**urls, "relay": relay_url}
        streamed = {**three, "bytes": bytes_url, "threads": threads_url}  # the streams' ways
        pids = {"strata": pid, "relay": relay_pid, "bytes": bytes_pid, "threads": threads_pid}
        for url in streamed.values():
            await chat(session, url, short)  # warm: the prompt is cached from here on

        def in_turn(ways: dict[str, str], n: int) -> list[str]:
            names = list(ways)
            return names[n % len(names):] + names[:n % len(names)]  # each first in turn

        # Streaming: tokens/s over the whole call, and the layer's CPU per token.
        tps: dict[str, list[float]] = {name: [] for name in streamed}
        decode: dict[str, list[float]] = {name: [] for name in streamed}  # the engine's own tokens/s
        cpu, tokens = dict.fromkeys(pids, 0.0), dict.fromkeys(pids, 0)
        for n in range(streams):
            for name in in_turn(streamed, n):
                before = cpu_seconds(pids[name]) if name in pids else 0.0
                reply = await chat(session, streamed[name], short, max_tokens=stream_tokens, ignore_eos=True)
                predicted = reply.timings.get("predicted_n", 0)
                tps[name].append(predicted / reply.total_s)
                decode[name].append(reply.timings.get("predicted_per_second", 0.0))
                if name in pids:
                    cpu[name] += cpu_seconds(pids[name]) - before
                    tokens[name] += predicted
        found["stream_tps"] = tps
        found["stream_ratios"] = [s / e for s, e in zip(tps["strata"], tps["engine"])]
        found["stream_ratio"] = paired_ratio(tps["strata"], tps["engine"])
        found["relay_stream_ratio"] = paired_ratio(tps["relay"], tps["engine"])
        found["bytes_stream_ratio"] = paired_ratio(tps["bytes"], tps["engine"])
        found["threads_stream_ratio"] = paired_ratio(tps["threads"], tps["engine"])
        found["stream_ratio_interval"] = ratio_interval(tps["strata"], tps["engine"])
        found["relay_stream_ratio_interval"] = ratio_interval(tps["relay"], tps["engine"])
        found["bytes_stream_ratio_interval"] = ratio_interval(tps["bytes"], tps["engine"])
        found["threads_stream_ratio_interval"] = ratio_interval(tps["threads"], tps["engine"])
        # The engine's decoding speed as it reports it: lower through strata-serve when the
        # layer's CPU per token takes from the engine's threads (2 cores), not the relay's delay.
        found["stream_decode_tps"] = decode
        alone = statistics.median(decode["engine"])
        found["stream_decode_ratio"] = paired_ratio(decode["strata"], decode["engine"]) if alone else None
        found["relay_stream_decode_ratio"] = paired_ratio(decode["relay"], decode["engine"]) if alone else None
        found["cpu_s_per_1000_tokens"] = cpu["strata"] / tokens["strata"] * 1000 if tokens["strata"] else None
        found["relay_cpu_s_per_1000_tokens"] = cpu["relay"] / tokens["relay"] * 1000 if tokens["relay"] else None
        found["bytes_cpu_s_per_1000_tokens"] = cpu["bytes"] / tokens["bytes"] * 1000 if tokens["bytes"] else None
        found["threads_cpu_s_per_1000_tokens"] = (cpu["threads"] / tokens["threads"] * 1000
                                                  if tokens["threads"] else None)

        # A 1-token request, a new connection each (client_session closes every one); then a
        # plain one over a connection each way keeps ("kept").
        # The byte relay too: what any Python process on the path adds to it here at the least.
        ones = {**three, "bytes": bytes_url}
        for url in ones.values():
            await _plain(kept_session, url, short)  # its connection opened before the count
        for kind in ("stream", "json", "kept"):
            times: dict[str, list[float]] = {name: [] for name in ones}
            parts: list[dict[str, float]] = []  # strata-serve's plain answers, part by part
            for n in range(requests):
                for name in in_turn(ones, n):
                    if kind == "stream":
                        times[name].append((await chat(session, ones[name], short)).total_s)
                        continue
                    times[name].append(await _plain(kept_session if kind == "kept" else session, ones[name],
                                                    short, parts if name == "strata" else None))
            if parts:
                found[f"one_token_{kind}_parts_ms"] = where_it_went(parts)
            found[f"one_token_{kind}_ms"] = {name: [s * 1000 for s in t] for name, t in times.items()}
            p50 = found[f"one_token_{kind}_p50_ms"] = {name: percentile(t, 50) * 1000 for name, t in times.items()}
            found[f"one_token_{kind}_added_p50_ms"] = p50["strata"] - p50["engine"]
            found[f"relay_one_token_{kind}_added_p50_ms"] = p50["relay"] - p50["engine"]
            found[f"bytes_one_token_{kind}_added_p50_ms"] = p50["bytes"] - p50["engine"]
            found[f"one_token_{kind}_added_interval_ms"] = added_interval(times["strata"], times["engine"])

        # Eight clients, each its own chat, all at once.
        async def client(url: str, number: int, block: int) -> int:
            messages = opening(number + 100 * block)
            for turn in range(turns):
                try:
                    reply = await asyncio.wait_for(chat(session, url, messages, max_tokens=8, ignore_eos=True),
                                                   ANSWER_WITHIN_S)
                except TimeoutError:
                    arm = next(name for name, known in three.items() if known == url)
                    raise RuntimeError(f"{arm}: client {number}'s turn {turn + 1} was not answered in "
                                       f"{ANSWER_WITHIN_S:g} s") from None
                messages = follow_up(messages, reply.text, f"Turn {turn + 2}: and then?")
            return turns

        await settle(session, strata_url)  # the 1-token requests' idle save
        rps: dict[str, list[float]] = {name: [] for name in three}
        cpu_ms: dict[str, list[float]] = {"strata": [], "relay": []}  # the layer's CPU per request
        for n in range(blocks):
            for name in in_turn(three, n):
                before = cpu_seconds(pids[name]) if name in pids else 0.0
                began = time.perf_counter()
                done = await asyncio.gather(*(client(three[name], c, 3 * n + list(three).index(name))
                                              for c in range(clients)))
                rps[name].append(sum(done) / (time.perf_counter() - began))
                if name in pids:
                    cpu_ms[name].append((cpu_seconds(pids[name]) - before) / sum(done) * 1000)
                if name == "strata":
                    await settle(session, strata_url)
        found["clients_rps"] = rps
        found["clients_ratios"] = [s / e for s, e in zip(rps["strata"], rps["engine"])]
        found["clients_ratio"] = paired_ratio(rps["strata"], rps["engine"])
        found["relay_clients_ratio"] = paired_ratio(rps["relay"], rps["engine"])
        found["clients_ratio_interval"] = ratio_interval(rps["strata"], rps["engine"])
        found["clients_cpu_ms"] = {name: statistics.median(values) for name, values in cpu_ms.items()}
    return found


def _range(values: list[float], digits: int) -> str:
    return f", {min(values):.{digits}f}-{max(values):.{digits}f}" if len(values) > 1 else ""


def _interval(found: dict[str, Any], kind: str) -> str:
    interval = found.get(f"one_token_{kind}_added_interval_ms")  # runs before it was measured lack it
    return f"; 90% interval {interval[0]:+.2f} to {interval[1]:+.2f} ms" if interval else ""


def _added(found: dict[str, Any], kind: str) -> str:
    """The bare relay's added p50 for the 1-token request ('-' in runs before it was measured)."""
    added = found.get(f"relay_one_token_{kind}_added_p50_ms")
    if added is None:
        return "-"
    return f"{added:+.2f} ms ({found[f'one_token_{kind}_p50_ms']['relay']:.2f} ms)"


def report(found: dict[str, Any], model: str) -> list[str]:
    s = found["sizes"]
    stream, rps = found["stream_tps"], found["clients_rps"]
    stream_e, stream_s = (statistics.median(stream[n]) for n in ("engine", "strata"))
    rps_e, rps_s = (statistics.median(rps[n]) for n in ("engine", "strata"))
    one = found["one_token_stream_p50_ms"]
    plain = found["one_token_json_p50_ms"]
    relayed = bool(stream.get("relay"))  # runs before the bare relay was measured lack it

    def relay(text: str) -> str:
        return text if relayed else "-"

    cpu = found.get("clients_cpu_ms", {})
    return [
        "",
        f"## Against its own engine alone, {model}",
        "",
        "`strata-serve run` with its defaults (its installed plugins) in its own process; the same engine "
        "it started, asked directly, alternating with it in this one run; and a bare relay (an aiohttp server "
        "passing each request to that engine, nothing else) in turn with both. Streaming: "
        f"{s['streams']} streams of {s['stream_tokens']} tokens each way, tokens/s over the whole call. A 1-token "
        f"request: {s['requests']} each way, a new connection each; the interval is a bootstrap's 90% for the "
        f"added p50. {s['clients']} clients at once, each its own "
        f"chat (a ~60-token opening, 8 tokens out, {s['turns']} turns), {s['blocks']} round(s) each way. In "
        "brackets: the way measured / the engine (medians), the lowest-highest ratio of strata-serve's "
        "interleaved pairs, and a 90% interval for the ratio (a bootstrap over the rounds, each round's pair "
        "kept together). A ratio is the median of the rounds' pairs: each pair ran seconds apart, the rounds "
        "minutes. The bare relay's column is what an aiohttp server and client between client and engine "
        "cost here.",
        "",
        "| measure | strata-serve / engine alone | bare relay / engine alone |",
        "|---|---|---|",
        f"| streaming tokens/s | {found['stream_ratio']:.3f} ({stream_s:.1f} / {stream_e:.1f}"
        f"{_range(found['stream_ratios'], 3)}{_ratio_interval(found, 'stream_ratio_interval')}) | "
        + relay(f"{found.get('relay_stream_ratio', 0):.3f} ({statistics.median(stream.get('relay') or [0]):.1f} / "
                f"{stream_e:.1f}{_ratio_interval(found, 'relay_stream_ratio_interval')})") + " |",
        f"| the engine's own decode tokens/s in those streams | {found['stream_decode_ratio'] or 0:.3f} | "
        + relay(f"{found.get('relay_stream_decode_ratio') or 0:.3f}") + " |",
        f"| 1-token request p50, streamed | {found['one_token_stream_added_p50_ms']:+.2f} ms "
        f"({one['strata']:.2f} / {one['engine']:.2f} ms{_interval(found, 'stream')}) | "
        + _added(found, "stream") + " |",
        f"| 1-token request p50, JSON | {found['one_token_json_added_p50_ms']:+.2f} ms "
        f"({plain['strata']:.2f} / {plain['engine']:.2f} ms{_interval(found, 'json')}) | "
        + _added(found, "json") + " |",
        *_kept(found),
        f"| {s['clients']} clients, requests/s | {found['clients_ratio']:.3f} ({rps_s:.2f} / {rps_e:.2f}"
        f"{_range(found['clients_ratios'], 3)}{_ratio_interval(found, 'clients_ratio_interval')}) | "
        + relay(f"{found.get('relay_clients_ratio', 0):.3f} ({statistics.median(rps.get('relay') or [0]):.2f} / "
                f"{rps_e:.2f})") + " |",
        f"| layer CPU ms per request, {s['clients']} clients | "
        + (f"{cpu['strata']:.2f}" if "strata" in cpu else "-") + " | "
        + relay(f"{cpu.get('relay', 0):.2f}") + " |",
        f"| layer CPU s per 1,000 streamed tokens | {found['cpu_s_per_1000_tokens'] or 0:.3f} | "
        + relay(f"{found.get('relay_cpu_s_per_1000_tokens') or 0:.3f}") + " |",
    ] + _stream_ways(found) + _bytes_one_token(found) + _parts(found.get("one_token_json_parts_ms"), "on a new connection") \
        + _parts(found.get("one_token_kept_parts_ms"), "on a kept connection")


def _ratio_interval(found: dict[str, Any], name: str) -> str:
    interval = found.get(name)  # runs before it was measured lack it
    return f"; 90% interval {interval[0]:.3f}-{interval[1]:.3f}" if interval else ""


#: The ways only the streams take: the opening and the closing words of each one's sentence.
_STREAM_WAYS = {
    "bytes": ("The same streams through a byte relay (an asyncio process passing the bytes both ways as they "
              "come, no HTTP at all)", "what passing a token through a Python process costs on this machine "
              "at the least (one wake of its event loop, one read, one write)"),
    "threads": ("And through a thread relay (the byte relay's work done by a blocking thread each way instead "
                "of an event loop)", "what a layer that relays a stream's bytes off its event loop could cost "
                "a token here"),
}


def _stream_ways(found: dict[str, Any]) -> list[str]:
    """The streams through the byte and the thread relay (runs before each was measured lack it)."""
    lines: list[str] = []
    stream = found["stream_tps"]
    for way, (opening, meaning) in _STREAM_WAYS.items():
        ratio = found.get(f"{way}_stream_ratio")
        if ratio is None:
            continue
        lines += [
            "",
            f"{opening}: {ratio:.3f} ({statistics.median(stream[way]):.1f} / "
            f"{statistics.median(stream['engine']):.1f}{_ratio_interval(found, f'{way}_stream_ratio_interval')}), "
            f"{found[f'{way}_cpu_s_per_1000_tokens'] or 0:.3f} s of its CPU per 1,000 tokens: {meaning}.",
        ]
    return lines


def _bytes_one_token(found: dict[str, Any]) -> list[str]:
    """The 1-token requests through the byte relay (runs before it was measured lack them)."""
    kinds = {"json": "plain on a new connection", "kept": "plain on a kept connection", "stream": "streamed"}
    added = {how: found.get(f"bytes_one_token_{kind}_added_p50_ms") for kind, how in kinds.items()}
    if any(value is None for value in added.values()):
        return []
    return ["", "The 1-token requests through the byte relay too, added p50: "
            + ", ".join(f"{how} {value:+.2f} ms" for how, value in added.items())
            + ": what any Python process on the path adds to a short request here at the least."]


def _kept(found: dict[str, Any]) -> list[str]:
    """The plain 1-token request's row over a kept connection (runs before it was measured lack it)."""
    kept = found.get("one_token_kept_p50_ms")
    if not kept:
        return []
    return [f"| 1-token request p50, JSON, connection kept | {found['one_token_kept_added_p50_ms']:+.2f} ms "
            f"({kept['strata']:.2f} / {kept['engine']:.2f} ms{_interval(found, 'kept')}) | "
            + _added(found, "kept") + " |"]


def _parts(parts: dict[str, float] | None, how: str) -> list[str]:
    """Where a plain 1-token request's time went through strata-serve (runs before it was
    measured lack it)."""
    if not parts:
        return []
    steps = ", ".join(f"{name} {parts[name]:.3f}" for name in OWN_STEPS)
    return [
        "",
        f"Where a plain 1-token request's {parts['total']:.2f} ms {how} went through strata-serve (p50 of each "
        "part, from its own `Server-Timing`): the engine's answer as strata-serve waited for it, the hop "
        f"to the engine and back included, {parts['engine']:.2f} ms; strata-serve's own steps before it "
        f"{parts['own']:.3f} ms ({steps}); the rest, {parts['http']:.3f} ms: the client's request reaching "
        "strata-serve's handler, and the answer handed back and leaving.",
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
