"""Where the layer's time goes: a sampling profile of strata-serve under load, beside a bare relay.

Two questions, answered in one run against the very engine strata-serve started:

- **How much of the cost is the HTTP stack itself?** A bare relay (an aiohttp server
  that passes each request to the engine with an aiohttp client and hands back the
  answer, nothing else: no FIFO, no hooks, no parsing) runs beside strata-serve; each
  figure alternates the engine, the bare relay and strata-serve. What the bare relay
  adds is the floor any aiohttp-based layer pays on this machine.
- **Where does strata-serve's own CPU go?** py-spy samples the strata-serve process
  while it serves streamed and plain 1-token requests; each sample is counted once,
  under the code it was running (its innermost Python frame), grouped by package.

``python -m bench.profile [--quick]`` prints the figures; ``make bench`` includes them.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import urllib.parse
from pathlib import Path
from typing import Any
from collections.abc import AsyncIterator

import aiohttp
from aiohttp import web

from bench.harness import client_session, conversation, percentile
from bench.layer_cost import BENCH_KEY, _one, cpu_seconds, strata_process, until_answering
from strata_serve.engine.llama_server import free_port

#: Innermost-frame file paths to the part of the stack they belong to, first match wins.
CATEGORIES = [
    ("strata-serve core", re.compile(r"(^|/)strata_serve/")),
    ("bundled plugins", re.compile(r"(^|/)strata_[a-z_]+/")),
    ("aiohttp client (to the engine)", re.compile(r"(^|/)aiohttp/(client|connector|streams)")),
    ("aiohttp server (to the client)", re.compile(r"(^|/)aiohttp/(web|http_|base_protocol|helpers|multipart)")),
    ("aiohttp, other", re.compile(r"(^|/)aiohttp/")),
    ("socket system calls (send, connect, close)",
     re.compile(r"(^|/)(asyncio/selector_events\.py|socket\.py)$")),
    ("asyncio event loop", re.compile(r"(^|/)(asyncio/|selectors\.py|uvloop/)")),
    ("json", re.compile(r"(^|/)json/")),
    ("logging", re.compile(r"(^|/)logging/")),
    ("pydantic", re.compile(r"(^|/)pydantic")),
    ("pluggy", re.compile(r"(^|/)pluggy/")),
]
#: Waiting, not working: the event loop blocked in epoll with nothing to do, a thread
#: blocked until the engine process exits. py-spy samples them here (it cannot tell
#: idle threads apart on this kernel), so they are left out.
_WAITING = re.compile(r"Selector\.select \([^;]*$|_do_waitpid|Condition\.wait")
_FRAME = re.compile(r"\((?P<path>[^:()]+):\d+\)$")


# -- the bare relay ------------------------------------------------------------------------

def bare_relay_app(engine_url: str, key: str) -> web.Application:
    """Pass a chat request to the engine and its answer back; nothing more."""
    app = web.Application()

    async def session_context(app: web.Application) -> AsyncIterator[None]:
        app["session"] = aiohttp.ClientSession()
        yield
        await app["session"].close()

    async def chat(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        stream = b'"stream": true' in body or b'"stream":true' in body
        headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
        if stream:
            headers["Connection"] = "close"  # llama-server closes a connection after a stream
        async with app["session"].post(engine_url + "/v1/chat/completions", data=body, headers=headers) as upstream:
            if not stream:
                return web.Response(body=await upstream.read(), status=upstream.status,
                                    content_type="application/json")
            answer = web.StreamResponse(status=upstream.status, headers={"Content-Type": "text/event-stream"})
            await answer.prepare(request)
            async for chunk in upstream.content.iter_any():
                await answer.write(chunk)
            await answer.write_eof()
            return answer

    app.cleanup_ctx.append(session_context)
    app.router.add_post("/v1/chat/completions", chat)
    return app


def bare_relay_process(engine_url: str, work: Path) -> contextlib.AbstractAsyncContextManager[tuple[str, int]]:
    """The bare relay in its own process (its CPU read apart); yields (its URL, its pid)."""
    return _relay_process("relay", "the bare relay", engine_url, work / "bare-relay.log")


def byte_relay_process(engine_url: str, work: Path) -> contextlib.AbstractAsyncContextManager[tuple[str, int]]:
    """The byte relay (:func:`byte_relay`) in its own process; yields (its URL, its pid)."""
    return _relay_process("bytes", "the byte relay", engine_url, work / "byte-relay.log")


@contextlib.asynccontextmanager
async def _relay_process(command: str, name: str, engine_url: str, log_path: Path) -> AsyncIterator[tuple[str, int]]:
    port = free_port("127.0.0.1")
    log = open(log_path, "wb")
    proc = subprocess.Popen([sys.executable, "-m", "bench.profile", command, "--port", str(port),
                             "--engine", engine_url], stdout=log, stderr=subprocess.STDOUT,
                            cwd=Path(__file__).resolve().parent.parent)
    url = f"http://127.0.0.1:{port}"
    try:
        hello = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
        key = {"Authorization": f"Bearer {BENCH_KEY}"}  # the byte relay passes the client's on as it came
        await until_answering(proc, name, lambda session: session.post(url + "/v1/chat/completions", json=hello,
                                                                       headers=key), 60, log_path)
        yield url, proc.pid
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()


def thread_relay_process(engine_url: str, work: Path) -> contextlib.AbstractAsyncContextManager[tuple[str, int]]:
    """The thread relay (:func:`thread_relay`) in its own process; yields (its URL, its pid)."""
    return _relay_process("threads", "the thread relay", engine_url, work / "thread-relay.log")


# -- the byte relay ------------------------------------------------------------------------

class _End(asyncio.Protocol):
    """One end of the byte relay: what it reads is written to the other end as it came."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.other: asyncio.Transport | None = None
        self.early: list[bytes] = []  # read before the other end was connected

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        if self.other is None:
            self.early.append(data)
        else:
            self.other.write(data)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.other is not None:
            self.other.close()


async def byte_relay(port: int, engine_url: str) -> None:
    """Relay bytes between each client connection and one of its own to the engine, both
    ways, as they come: no HTTP at all (no parsing, no framing, no headers of its own).
    What it costs a stream is what passing a token through a Python process costs on this
    machine at the least: one wake of the event loop, one read, one write."""
    loop = asyncio.get_running_loop()
    engine = urllib.parse.urlsplit(engine_url)
    connecting: set[asyncio.Task[None]] = set()

    async def connect(client: _End) -> None:
        try:
            _, upstream = await loop.create_connection(_End, engine.hostname, engine.port)
        except OSError:
            if client.transport is not None:
                client.transport.close()
            return
        assert client.transport is not None and upstream.transport is not None
        if client.transport.is_closing():  # the client left while this connected
            upstream.transport.close()
            return
        upstream.other, client.other = client.transport, upstream.transport
        for data in client.early:
            upstream.transport.write(data)
        client.early.clear()

    def accepted() -> _End:
        client = _End()
        task = loop.create_task(connect(client))
        connecting.add(task)
        task.add_done_callback(connecting.discard)
        return client

    server = await loop.create_server(accepted, "127.0.0.1", port)
    async with server:
        await server.serve_forever()


# -- the thread relay ----------------------------------------------------------------------

def _pass_on(source: socket.socket, sink: socket.socket) -> None:
    """What ``source`` reads, written to ``sink`` as it came, until ``source`` ends."""
    buffer = bytearray(65536)
    view = memoryview(buffer)
    try:
        while read := source.recv_into(buffer):
            sink.sendall(view[:read])
    except OSError:
        pass  # either end gone: the other is told below
    finally:
        with contextlib.suppress(OSError):
            sink.shutdown(socket.SHUT_WR)


def _serve_one(client: socket.socket, engine: tuple[str, int]) -> None:
    with client:
        try:
            upstream = socket.create_connection(engine, timeout=10)
        except OSError:
            return
        with upstream:
            upstream.settimeout(None)
            for end in (client, upstream):
                end.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            asking = threading.Thread(target=_pass_on, args=(client, upstream), daemon=True)
            asking.start()
            _pass_on(upstream, client)
            asking.join(timeout=10)


def thread_relay(port: int, engine_url: str) -> None:
    """The byte relay's work done by threads instead of an event loop: for each client
    connection, one of its own to the engine, and a thread each way in a blocking read and
    write, no HTTP. A thread woken by its socket runs no event loop's turn: what a layer that
    relays a stream's bytes off its event loop could cost a token here."""
    engine = urllib.parse.urlsplit(engine_url)
    address = (engine.hostname or "127.0.0.1", engine.port or 80)
    with socket.create_server(("127.0.0.1", port)) as server:
        while True:
            client, _ = server.accept()
            threading.Thread(target=_serve_one, args=(client, address), daemon=True).start()


# -- the profile ---------------------------------------------------------------------------

def _path(frame: str) -> str:
    match = _FRAME.search(frame)
    return match.group("path") if match else frame


def categorize(raw: str) -> tuple[collections.Counter[str], int, int]:
    """Samples per category from py-spy's raw output (``frame;frame;...;innermost count``),
    their total, and how many ran under a frame of strata-serve's own code (its handlers,
    middlewares, FIFO and hooks, and the library calls they made), as opposed to the
    event loop's and aiohttp's own work around them."""
    counts: collections.Counter[str] = collections.Counter()
    total = ours = 0
    own = re.compile(r"(^|/)strata_[a-z_]+/|(^|/)strata_serve/")
    for line in raw.splitlines():
        stack, _, number = line.rpartition(" ")
        if not stack or not number.isdigit() or _WAITING.search(stack):
            continue
        frames = stack.split(";")
        # What runs under the event loop's callbacks (the frames above them start the server).
        starts = [i for i, frame in enumerate(frames) if frame.startswith(("Handle._run ", "Task.__step"))]
        work = frames[starts[-1] + 1:] if starts else frames
        if any(own.search(_path(frame)) for frame in work):
            ours += int(number)
        path = _path(frames[-1])
        function = frames[-1].split(" (", 1)[0]
        if path.endswith(("selector_events.py", "socket.py")) and not re.search(
                r"write|send|connect|close|shutdown|accept|recv", function, re.I):
            path = "asyncio/"  # the loop's own bookkeeping in those files
        name = next((label for label, pattern in CATEGORIES if pattern.search(path)), "other")
        counts[name] += int(number)
        total += int(number)
    return counts, total, ours


async def measure(model: Path, work: Path, requests: int = 200, sampled: int = 300) -> dict[str, Any]:
    """Added latency and CPU per request of the bare relay and of strata-serve, interleaved;
    then a py-spy profile of strata-serve over ``sampled`` streamed and as many plain requests."""
    messages = conversation("latency", 64)
    found: dict[str, Any] = {"requests": requests, "sampled": sampled}
    async with strata_process(model, work) as (strata_url, engine_url, strata_pid), \
            bare_relay_process(engine_url, work) as (bare_url, bare_pid), client_session() as session:
        urls = {"engine": engine_url, "bare relay": bare_url, "strata": strata_url}
        pids = {"bare relay": bare_pid, "strata": strata_pid}
        for name in urls:
            await _one(session, urls[name], messages, True)  # warm: the prompt is cached
        order = list(urls)
        for stream in (True, False):
            kind = "stream" if stream else "json"
            times: dict[str, list[float]] = {name: [] for name in urls}
            cpu = {name: 0.0 for name in pids}
            for n in range(requests):
                for name in order[n % 3:] + order[:n % 3]:
                    before = cpu_seconds(pids[name]) if name in pids else 0.0
                    times[name].append(await _one(session, urls[name], messages, stream))
                    if name in pids:
                        cpu[name] += cpu_seconds(pids[name]) - before
            for name in pids:
                found[f"{kind}_added_p50_ms {name}"] = (percentile(times[name], 50)
                                                        - percentile(times["engine"], 50)) * 1000
                found[f"{kind}_cpu_ms {name}"] = cpu[name] / requests * 1000

        spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
        out = work / "profile.txt"
        recorder = subprocess.Popen([spy, "record", "--pid", str(strata_pid), "--format", "raw",
                                     "--rate", "500", "--output", str(out)],
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        await asyncio.sleep(1.0)  # attached
        if recorder.poll() is not None:
            raise RuntimeError(f"py-spy could not sample strata-serve: {recorder.stdout.read().decode()}")
        for _ in range(sampled):
            await _one(session, strata_url, messages, True)
            await _one(session, strata_url, messages, False)
        recorder.send_signal(2)  # SIGINT: py-spy writes what it sampled and exits
        output, _ = await asyncio.to_thread(recorder.communicate, timeout=60)
        if not out.exists():
            raise RuntimeError(f"py-spy wrote no profile: {output.decode()[-500:]}")
        counts, total, ours = categorize(out.read_text())
        found["profile"] = {"total": total, "ours": ours, "categories": dict(counts.most_common())}
    return found


def report(found: dict[str, Any]) -> list[str]:
    lines = [
        "",
        "## Where the layer's time goes (tiny model)",
        "",
        "A bare relay (an aiohttp server passing each request to the engine with an aiohttp client,",
        "nothing else) beside strata-serve, against the same engine, interleaved: what it adds is the",
        "floor of any aiohttp-based layer here. A cached 64-token prompt, 1 new token,",
        f"{found['requests']} requests of each kind for each.",
        "",
        "| | added p50 ms, stream | added p50 ms, JSON | CPU ms per request, stream | CPU ms per request, JSON |",
        "|---|---|---|---|---|",
    ]
    for name in ("bare relay", "strata"):
        label = "strata-serve" if name == "strata" else name
        lines.append(f"| {label} | {found[f'stream_added_p50_ms {name}']:.2f} | "
                     f"{found[f'json_added_p50_ms {name}']:.2f} | {found[f'stream_cpu_ms {name}']:.2f} | "
                     f"{found[f'json_cpu_ms {name}']:.2f} |")
    profile = found["profile"]
    total = profile["total"] or 1
    lines += [
        "",
        f"py-spy sampled strata-serve (500 Hz, {profile['total']:,} samples of busy time) over "
        f"{found['sampled']} streamed and {found['sampled']} plain requests; each sample counted under",
        "the code it was running (its innermost Python frame; time in a system call counts under the",
        "Python code that made it):",
        "",
        "| part of the stack | share of strata-serve's busy samples |",
        "|---|---|",
    ]
    for name, count in profile["categories"].items():
        lines.append(f"| {name} | {count / total:.0%} |")
    lines += ["", f"Samples under a frame of strata-serve's own code (its handlers, middlewares, FIFO and hooks, "
              f"with the library calls they made): {profile['ours'] / total:.0%}; the rest is the event loop "
              "and aiohttp at work around them (reading, parsing and writing HTTP, scheduling)."]
    return lines


def cli() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    sub = parser.add_subparsers(dest="command")
    relay = sub.add_parser("relay", help="run the bare relay (used by the benchmark)")
    relay.add_argument("--port", type=int, required=True)
    relay.add_argument("--engine", required=True)
    byte = sub.add_parser("bytes", help="run the byte relay (used by the benchmark)")
    byte.add_argument("--port", type=int, required=True)
    byte.add_argument("--engine", required=True)
    threads = sub.add_parser("threads", help="run the thread relay (used by the benchmark)")
    threads.add_argument("--port", type=int, required=True)
    threads.add_argument("--engine", required=True)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.command == "relay":
        web.run_app(bare_relay_app(args.engine, BENCH_KEY), host="127.0.0.1", port=args.port, print=None)
        return
    if args.command == "threads":
        with contextlib.suppress(KeyboardInterrupt):
            thread_relay(args.port, args.engine)
        return
    if args.command == "bytes":
        with contextlib.suppress(KeyboardInterrupt):
            asyncio.run(byte_relay(args.port, args.engine))
        return
    from strata_serve.demo_model import write_demo_model

    with tempfile.TemporaryDirectory(prefix="strata-profile-") as tmp:
        model = write_demo_model(Path(tmp) / "tiny.gguf", size="tiny")
        found = asyncio.run(measure(model, Path(tmp), *((20, 20) if args.quick else (200, 300))))
    print("\n".join(report(found)))


if __name__ == "__main__":
    cli()
