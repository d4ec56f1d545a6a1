"""Property-based tests over the HTTP API of a real server: never a 500, always the error shape.

Part of the reliability suite (``pytest -m reliability``). The server runs as a
user runs it (``strata-serve run``), with auto-sessions on, against the real engine.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from strata_serve.api.openapi import ErrorResponse
from strata_serve.engine.llama_server import free_port

pytestmark = pytest.mark.reliability

KEY = "fuzz-key"
PATHS = ["/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/slots", "/slots/0",
         "/openapi.json", "/nope", "/v1", "/slots/0/../../etc"]
METHODS = ["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS"]


@pytest.fixture(scope="module")
def server(tmp_path_factory, strata_demo_model):
    tmp = tmp_path_factory.mktemp("fuzz")
    port = free_port("127.0.0.1")
    log_path = tmp / "server.log"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "STRATA_SERVER__API_KEY": KEY,
           "STRATA_SERVER__MAX_BODY_MIB": "0.05", "STRATA_SERVER__READ_TIMEOUT_S": "1",
           "STRATA_PLUGINS__AUTO_SESSIONS__MIN_TOKENS": "50", "STRATA_ENGINE__LOG_LEVEL": "DEBUG"}
    with open(log_path, "w") as log, subprocess.Popen(
        [sys.executable, "-m", "strata_serve.cli", "run", "--model", str(strata_demo_model),
         "--port", str(port), "--slot-save-path", str(tmp / "slots"), "--ctx-size", "2048"],
        stderr=log, env=env,
    ) as proc:
        deadline = time.monotonic() + 60
        while "listening on" not in log_path.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()[-2000:]
            time.sleep(0.05)
        yield {"port": port, "log": log_path}
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
    assert "Traceback" not in log_path.read_text(), log_path.read_text()[-3000:]


def send(server, method: str, path: str, body: bytes = b"", headers: dict | None = None,
         auth: bool = True) -> tuple[int, dict, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", server["port"], timeout=60)
    try:
        all_headers = {"Authorization": f"Bearer {KEY}"} if auth else {}
        all_headers.update(headers or {})
        conn.request(method, path, body=body, headers=all_headers)
        resp = conn.getresponse()
        return resp.status, dict(resp.getheaders()), resp.read()
    finally:
        conn.close()


def check_error(status: int, raw: bytes) -> None:
    assert status != 500 and status < 600, (status, raw[:300])
    if status >= 400:
        ErrorResponse.model_validate_json(raw)  # the OpenAI error shape, every time


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=30),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
    max_leaves=12,
)
message = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant", "tool", "robot", 7]),
     "content": st.one_of(st.text(max_size=60), st.integers(), st.none(),
                          st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=20)}),
                                   max_size=2))},
    optional={"name": st.text(max_size=5), "extra": json_values},
)
chat_bodies = st.fixed_dictionaries(
    {"messages": st.one_of(st.lists(message, max_size=3), json_values)},
    optional={
        "max_tokens": st.one_of(st.integers(-5, 4), st.text(max_size=3)),
        "temperature": st.one_of(st.floats(-1, 3, allow_nan=False), st.text(max_size=3)),
        "stream": st.one_of(st.booleans(), st.just("yes"), st.integers(0, 1)),
        "stop": st.one_of(st.text(max_size=3), st.lists(st.text(max_size=3), max_size=2), st.integers()),
        "n": st.integers(-1, 3),
        "seed": st.one_of(st.integers(), st.text(max_size=2)),
        "model": st.one_of(st.text(max_size=8), st.integers()),
    },
)
fuzz = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@fuzz
@given(body=chat_bodies)
def test_chat_bodies_never_fail_the_server(server, body):
    if body.get("max_tokens") is None or not isinstance(body.get("max_tokens"), int):
        body = {**body, "max_tokens": 2}  # keep the valid ones short
    status, headers, raw = send(server, "POST", "/v1/chat/completions", json.dumps(body).encode(),
                                {"Content-Type": "application/json"})
    check_error(status, raw)
    if status == 200 and body.get("stream") is not True:
        assert json.loads(raw)["choices"]


@fuzz
@given(raw=st.binary(max_size=300), path=st.sampled_from(PATHS), method=st.sampled_from(METHODS))
def test_raw_bytes_on_any_route_and_method(server, raw, path, method):
    status, _, answer = send(server, method, path, raw, {"Content-Type": "application/json"})
    check_error(status, answer)


@fuzz
@given(query=st.dictionaries(st.text(st.characters(codec="ascii", exclude_categories=("Cc",)), max_size=8),
                             st.text(st.characters(codec="ascii", exclude_categories=("Cc",)), max_size=12),
                             max_size=3),
       filename=st.one_of(st.text(max_size=40), json_values))
def test_slot_actions_with_random_queries_and_names(server, query, filename):
    from urllib.parse import urlencode

    status, _, answer = send(server, "POST", "/slots/0?" + urlencode(query),
                             json.dumps({"filename": filename}).encode())
    check_error(status, answer)
    slots = Path(server["log"]).parent / "slots"
    assert all(p.parent == slots for p in slots.iterdir()) if slots.exists() else True


@fuzz
@given(name=st.text(st.characters(codec="ascii", exclude_categories=("Cc",)), min_size=1, max_size=20),
       value=st.text(st.characters(codec="latin-1", exclude_categories=("Cc",)), max_size=200),
       auth=st.one_of(st.none(), st.text(st.characters(codec="ascii", exclude_categories=("Cc",)), max_size=40)))
def test_random_headers_and_keys(server, name, value, auth):
    headers = {name.strip() or "X": value}
    if auth is not None:
        headers["Authorization"] = auth
    try:
        status, _, answer = send(server, "GET", "/v1/models", headers=headers, auth=False)
    except (http.client.HTTPException, ValueError):
        return  # the client library itself refused to send such a header
    if not re.fullmatch(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+", name.strip() or "X"):
        # Not a valid HTTP header name: not a request at all. aiohttp refuses the
        # bytes itself (plain 400) before any handler runs.
        assert status == 400
        return
    check_error(status, answer)
    if auth != f"Bearer {KEY}":
        assert status == 401


def test_openapi_document_describes_the_server(server):
    status, _, raw = send(server, "GET", "/openapi.json")
    assert status == 200
    document = json.loads(raw)
    assert document["openapi"].startswith("3.")
    for path, operations in document["paths"].items():
        concrete = path.replace("{slot_id}", "0")
        for method, operation in operations.items():
            status, _, answer = send(server, method.upper(), concrete, b"{}",
                                     {"Content-Type": "application/json"})
            assert str(status) in operation["responses"], (method, path, status, answer[:200])
            check_error(status, answer)
    status, headers, _ = send(server, "GET", "/openapi.json", auth=False)
    assert status == 401, "the description is guarded like the rest"


def test_slow_client_gets_408_and_huge_headers_get_4xx(server):
    import socket

    with socket.create_connection(("127.0.0.1", server["port"])) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode()
                     + b"\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"messa")
        sock.settimeout(10)
        began = time.monotonic()
        answer = sock.recv(4096)
    assert b" 408 " in answer.split(b"\r\n")[0] and time.monotonic() - began < 5
    ErrorResponse.model_validate_json(answer.split(b"\r\n\r\n", 1)[1])

    status, _, answer = send(server, "GET", "/v1/models", headers={"X-Big": "x" * 20_000})
    assert 400 <= status < 500
    big = json.dumps({"messages": [{"role": "user", "content": "x" * 100_000}]}).encode()
    status, _, answer = send(server, "POST", "/v1/chat/completions", big, {"Content-Type": "application/json"})
    assert status == 413
    check_error(status, answer)
