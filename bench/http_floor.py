"""What a plain 1-token request costs through each kind of Python server, beside strata-serve.

One ``strata-serve run`` (its defaults) and its engine, and four relays in processes of
their own, each on uvloop (strata-serve's default loop) and each calling that engine on
kept connections with strata-serve's own client for whole answers
(:class:`~strata_serve.engine.llama_server.kept.KeptConnections`). Only their servers differ:

- ``app``: an aiohttp ``web.Application`` with one route (strata-serve's server);
- ``low``: aiohttp's low-level ``web.Server``, no application or router;
- ``proto``: an ``asyncio.Protocol`` with httptools' parser, the answer's head written
  in one line (the least an HTTP server in Python can do);
- ``bytes``: the byte relay (:func:`bench.profile.byte_relay`: no HTTP at all).

A client asks the engine itself, strata-serve and each relay in turn (each first in
turn), the same plain 1-token request, on connections kept from one request to the next
and then on a new connection each. It reports each way's p50 over the engine's, the
median of the rounds' differences, and each process's CPU a request.

``bench.engine_alone``'s bare relay calls the engine through aiohttp's client on
asyncio's loop, which costs more than strata-serve's own calls on uvloop; this table
sets strata-serve beside relays that call the engine as it does.

``python -m bench.http_floor [--requests 200] [--json FILE]``
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import aiohttp

from bench.harness import BENCH_ENGINE_KEY
from bench.layer_cost import cpu_seconds, plain_one, strata_process, until_answering
from strata_serve.engine.llama_server import free_port

#: The relays, in the order of the table: (name, what its server is).
RELAYS = {
    "app": "aiohttp web.Application, one route",
    "low": "aiohttp's low-level web.Server",
    "proto": "asyncio.Protocol with httptools' parser",
    "bytes": "byte relay, no HTTP",
}
PATH = "/v1/chat/completions"
#: The request every way is asked (as :func:`bench.layer_cost.plain_one` sends its messages).
SHORT = {"messages": [{"role": "user", "content": "Say something about rivers."}], "max_tokens": 1,
         "temperature": 0}


async def _relay(kind: str, port: int, engine_url: str, key: str) -> None:
    """Serve one relay until killed; its log's first line names its event loop."""
    from strata_serve.engine.llama_server.kept import KeptConnections

    print(f"loop: {type(asyncio.get_running_loop()).__module__}", flush=True)

    kept = KeptConnections(engine_url, {"Authorization": f"Bearer {key}"}, 60.0)
    loop = asyncio.get_running_loop()
    if kind in ("app", "low"):
        from aiohttp import web

        async def handle(request: web.BaseRequest) -> web.Response:
            answer = await kept.call("POST", PATH, await request.read())
            return web.Response(body=answer.body, status=answer.status, content_type="application/json")

        if kind == "app":
            app = web.Application()
            app.router.add_post(PATH, handle)
            runner: web.BaseRunner = web.AppRunner(app, access_log=None)
        else:
            runner = web.ServerRunner(web.Server(handle, access_log=None))
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
    elif kind == "proto":
        await loop.create_server(lambda: _Protocol(kept), "127.0.0.1", port)
    else:
        from bench.profile import byte_relay

        await byte_relay(port, engine_url)
    await asyncio.Event().wait()


class _Protocol(asyncio.Protocol):
    """The least HTTP server: httptools parses, each whole request is relayed in a task,
    its answer's head written with its body in one write. Answers go in the order they
    come back, which is the requests' order only for a client that waits for each answer
    before its next request (this bench's does; a pipelining one would need a queue)."""

    def __init__(self, kept: Any) -> None:
        import httptools

        self._kept = kept
        self._parser = httptools.HttpRequestParser(self)
        self._body: list[bytes] = []
        self._transport: asyncio.Transport | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self._parser.feed_data(data)

    # httptools' callbacks
    def on_body(self, body: bytes) -> None:
        self._body.append(body)

    def on_message_complete(self) -> None:
        body, self._body = b"".join(self._body), []
        task = asyncio.get_running_loop().create_task(self._answer(body, self._parser.should_keep_alive()))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _answer(self, body: bytes, keep: bool) -> None:
        answer = await self._kept.call("POST", PATH, body)
        assert self._transport is not None
        self._transport.write(b"HTTP/1.1 %d OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n%s\r\n"
                              % (answer.status, len(answer.body), b"" if keep else b"Connection: close\r\n")
                              + answer.body)
        if not keep:
            self._transport.close()


@contextlib.asynccontextmanager
async def _relays(engine_url: str, work: Path) -> Any:
    """Every relay in its own process; yields {name: (url, pid)}."""
    procs: dict[str, subprocess.Popen] = {}
    found: dict[str, tuple[str, int]] = {}
    try:
        for kind in RELAYS:
            port = free_port("127.0.0.1")
            log = work / f"relay-{kind}.log"
            with open(log, "wb") as out:
                procs[kind] = subprocess.Popen(
                    [sys.executable, "-m", "bench.http_floor", "serve", kind, "--port", str(port),
                     "--engine", engine_url], stdout=out, stderr=subprocess.STDOUT,
                    cwd=Path(__file__).resolve().parent.parent)
            url = f"http://127.0.0.1:{port}"
            await until_answering(procs[kind], f"the {kind} relay",
                                  lambda session, url=url: session.post(
                                      url + PATH, json=SHORT, headers={"Authorization": f"Bearer {BENCH_ENGINE_KEY}"}),
                                  60, log)
            found[kind] = (url, procs[kind].pid)
        yield found
    finally:
        for proc in procs.values():
            proc.terminate()
        for proc in procs.values():
            proc.wait(30)


async def measure(model: Path, work: Path, requests: int) -> dict[str, Any]:
    """Each way's times (ms) on kept connections and on new ones, and each process's CPU
    (ms) a request."""
    found: dict[str, Any] = {"requests": requests}
    async with strata_process(model, work, ctx=8192, plugins={"auto_sessions": {}}) as (strata_url, engine_url, pid), \
            _relays(engine_url, work) as relays:
        urls = {"engine": engine_url, "strata": strata_url, **{name: url for name, (url, _) in relays.items()}}
        pids = {"strata": pid, **{name: relay_pid for name, (_, relay_pid) in relays.items()}}
        names = list(urls)
        # The loop each relay runs on, as it said in its log once serving.
        found["loops"] = {name: (work / f"relay-{name}.log").read_text().partition("loop: ")[2].split()[0]
                          for name in relays}
        for how in ("kept", "new"):
            connector = aiohttp.TCPConnector(force_close=how == "new")
            async with aiohttp.ClientSession(connector=connector,
                                             headers={"Authorization": f"Bearer {BENCH_ENGINE_KEY}"}) as session:
                for url in urls.values():  # warm: the prompt cached, each kept connection open
                    await plain_one(session, url, SHORT["messages"])
                times: dict[str, list[float]] = {name: [] for name in urls}
                before = {name: cpu_seconds(p) for name, p in pids.items()}
                for n in range(requests):
                    for name in names[n % len(names):] + names[:n % len(names)]:
                        times[name].append((await plain_one(session, urls[name], SHORT["messages"]))[0] * 1000)
                found[how] = {"ms": times, "cpu_ms": {name: (cpu_seconds(p) - before[name]) / requests * 1000
                                                      for name, p in pids.items()}}
    return found


def report(found: dict[str, Any]) -> list[str]:
    lines = [
        "",
        "## A plain 1-token request through each kind of Python server",
        "",
        f"`python -m bench.http_floor`: {found['requests']} requests each way, in turn. Each relay on uvloop, "
        "calling the engine on kept connections as strata-serve does; only its server differs. Added: the "
        "way's p50 over the engine's; in brackets, the median of the rounds' differences.",
        "",
        "| way | added, kept connections | added, new connections | CPU ms a request, kept | CPU ms a request, new |",
        "|---|---|---|---|---|",
    ]
    for name in ("strata", *RELAYS):
        cells = []
        for how in ("kept", "new"):
            times = found[how]["ms"]
            alone = times["engine"]
            added = statistics.median(times[name]) - statistics.median(alone)
            pairs = statistics.median(a - b for a, b in zip(times[name], alone))
            cells.append(f"{added:+.2f} ms ({pairs:+.2f})")
        what = "strata-serve, its defaults" if name == "strata" else f"{name}: {RELAYS[name]}"
        lines.append(f"| {what} | {cells[0]} | {cells[1]} | {found['kept']['cpu_ms'][name]:.2f} | "
                     f"{found['new']['cpu_ms'][name]:.2f} |")
    engine = ", ".join(f"{how} {statistics.median(found[how]['ms']['engine']):.2f} ms" for how in ("kept", "new"))
    lines += ["", f"The engine alone, p50: {engine}."]
    return lines


def cli() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command")
    serve = sub.add_parser("serve", help="run one relay (used by the benchmark)")
    serve.add_argument("kind", choices=list(RELAYS))
    serve.add_argument("--port", type=int, required=True)
    serve.add_argument("--engine", required=True)
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--json", type=Path, help="write the raw figures here")
    options = parser.parse_args()
    if options.command == "serve":
        import uvloop

        uvloop.run(_relay(options.kind, options.port, options.engine, BENCH_ENGINE_KEY))
        return
    from strata_serve.models import packaged_model_path

    model = packaged_model_path("smollm2")
    if model is None:
        raise SystemExit("SmolLM2 is not installed: run `make setup`")
    with tempfile.TemporaryDirectory(prefix="strata-http-floor-") as tmp:
        found = asyncio.run(measure(Path(model), Path(tmp), options.requests))
    print("\n".join(report(found)))
    if options.json:
        options.json.write_text(json.dumps(found, indent=1))


if __name__ == "__main__":
    cli()
