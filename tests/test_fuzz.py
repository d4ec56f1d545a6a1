"""Property-based tests over the HTTP API of a real server: never a 500, always the error shape.

Part of the reliability suite (``pytest -m reliability``). The server runs as a
user runs it (``strata-serve run``), with every installed plugin on, against the real
engine. Requests go out as raw bytes, so what is thrown is exactly what arrives (no
client library cleans a header up or refuses to send it), and a connection the server
drops without answering fails the test.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import quote

import pytest
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from strata_serve.api.builtin import builtin
from strata_serve.api.openapi import AnthropicErrorResponse, ErrorResponse
from strata_serve.api.schemas import ChatCompletionRequest
from tests.ports import listen_port

pytestmark = pytest.mark.reliability

KEY = "fuzz-key"
MAX_BODY = int(0.05 * 1024 * 1024)
PATHS = ["/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/slots", "/slots/0",
         "/slots/1", "/slots/x", "/openapi.json", "/stats", "/metrics", "/nope", "/v1",
         "/slots/0/../../etc", "/health/x", "/v1/messages", "/v1/messages/count_tokens", "/v1/messages/x",
         "/v1/responses", "/v1/embeddings", "/infill", "/tokenize", "/detokenize", "/apply-template", "/props"]
METHODS = ["GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS"]
ACTIONS = ["save", "restore", "erase"]
#: Where the server's own files go; everything else under the temporary tree must stay as it was.
SLOTS = Path("deep") / "er" / "slots"


@pytest.fixture(scope="module")
def server(tmp_path_factory, strata_demo_model):
    tmp = tmp_path_factory.mktemp("fuzz")
    port = listen_port()
    log_path = tmp / "server.log"
    # Files that an escaping name could overwrite: they must be untouched at the end.
    (tmp / "deep" / "er").mkdir(parents=True)
    for bait in (tmp / "bait.bin", tmp / "deep" / "bait.bin", tmp / "deep" / "er" / "bait.bin"):
        bait.write_bytes(b"not a slot file")
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "STRATA_SERVER__API_KEY": KEY,
           "STRATA_SERVER__MAX_BODY_MIB": "0.05", "STRATA_SERVER__READ_TIMEOUT_S": "1",
           "STRATA_PLUGINS__AUTO_SESSIONS__MIN_TOKENS": "50", "STRATA_ENGINE__LOG_LEVEL": "DEBUG"}
    with open(log_path, "w") as log, subprocess.Popen(
        [sys.executable, "-m", "strata_serve.cli", "run", "--model", str(strata_demo_model),
         "--port", str(port), "--slot-save-path", str(tmp / SLOTS), "--ctx-size", "2048"],
        stderr=log, env=env,
    ) as proc:
        deadline = time.monotonic() + 60
        while "listening on" not in log_path.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()[-2000:]
            time.sleep(0.05)
        before = snapshot(tmp)
        yield {"port": port, "log": log_path, "tmp": tmp, "slots": tmp / SLOTS}
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
    assert snapshot(tmp) == before, "something was written outside the slot directory"
    text = log_path.read_text()
    assert "Traceback" not in text and "unexpected error" not in text, text[-3000:]


def snapshot(root: Path) -> dict[str, tuple[int, int, int]]:
    """Every path under ``root`` but the slot directory and the log: ``(mode, size, mtime_ns)``."""
    seen = {}
    for path in sorted(root.rglob("*")):
        relative = path.relative_to(root)
        if relative == Path("server.log") or relative == SLOTS or SLOTS in relative.parents:
            continue
        info = path.lstat()
        seen[str(relative)] = (info.st_mode, info.st_size, info.st_mtime_ns)
    return seen


class Answer:
    def __init__(self, raw: bytes):
        head, _, self.body = raw.partition(b"\r\n\r\n")
        status_line, *lines = head.split(b"\r\n")
        self.status = int(status_line.split(b" ", 2)[1])
        self.headers = {k.lower(): v for k, _, v in (l.decode("latin-1").partition(": ") for l in lines)}
        if self.headers.get("transfer-encoding") == "chunked":
            self.body = _unchunk(self.body)

    def json(self):
        return json.loads(self.body)


def _unchunk(data: bytes) -> bytes:
    out = b""
    while data:
        size_line, _, data = data.partition(b"\r\n")
        size = int(size_line.split(b";")[0], 16)
        if size == 0:
            break
        out, data = out + data[:size], data[size + 2:]
    return out


def send(server, method: str, path: str, body: bytes = b"", headers: list[tuple[bytes, bytes]] = (),
         auth: bool = True, content_type: bytes | None = b"application/json") -> Answer:
    """One request as raw bytes; the answer, read to the end. No answer at all is a failure."""
    lines = [f"{method} {path} HTTP/1.1".encode(), b"Host: 127.0.0.1:%d" % server["port"], b"Connection: close"]
    if auth:
        lines.append(b"Authorization: Bearer " + KEY.encode())
    if body or method in ("POST", "PUT", "PATCH"):
        lines.append(b"Content-Length: %d" % len(body))
        if content_type is not None and body:
            lines.append(b"Content-Type: " + content_type)
    lines += [name + b": " + value for name, value in headers]
    with socket.create_connection(("127.0.0.1", server["port"]), timeout=60) as sock:
        sock.sendall(b"\r\n".join(lines) + b"\r\n\r\n" + body)
        raw = b""
        while chunk := sock.recv(65536):
            raw += chunk
    assert raw, f"the server dropped the connection without answering {method} {path}"
    return Answer(raw)


def check_error(answer: Answer, path: str = "/") -> None:
    assert answer.status < 500, (answer.status, answer.body[:300])
    if answer.status >= 400 and answer.body:
        # The OpenAI error shape every time, Anthropic's under /v1/messages.
        shape = AnthropicErrorResponse if builtin().errors_at(path.partition("?")[0]).name == "anthropic" else ErrorResponse
        shape.model_validate_json(answer.body)


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
valid_text = st.text(st.characters(exclude_categories=("Cs",)), max_size=60)
valid_message = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant", "developer"]),
     "content": st.one_of(valid_text, st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": valid_text}),
                                               min_size=1, max_size=2))},
)
# A conversation the engine takes: it refuses some orders the schema does not model
# (two assistant messages at the end, for one), so a valid one ends with the user.
valid_conversation = st.builds(lambda before, last: before + [{"role": "user", "content": last}],
                               st.lists(valid_message, max_size=3), valid_text)
valid_chat_bodies = st.fixed_dictionaries(
    {"messages": valid_conversation, "max_tokens": st.integers(1, 4)},
    optional={"temperature": st.floats(0, 2), "stream": st.booleans(), "seed": st.integers(0, 2**31),
              "stop": st.one_of(valid_text, st.lists(valid_text, max_size=2)), "top_p": st.floats(0, 1),
              "metadata": st.dictionaries(st.text(max_size=8), st.text(max_size=8), max_size=3),
              "user": valid_text, "model": valid_text},
)
chat_bodies = valid_chat_bodies | st.fixed_dictionaries(
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


def schema_accepts(body) -> bool:
    try:
        json.dumps(body, allow_nan=False)  # Infinity and NaN are not JSON
        ChatCompletionRequest.model_validate(body)
    except (ValueError, ValidationError):
        return False
    return True


@fuzz
@given(body=valid_chat_bodies)
def test_chat_bodies_the_schema_and_the_engine_take_are_answered(server, body):
    answer = send(server, "POST", "/v1/chat/completions", json.dumps(body).encode())
    assert schema_accepts(body)
    assert answer.status == 200, (body, answer.body[:300])
    if body.get("stream") is True:
        assert answer.body.rstrip().endswith(b"data: [DONE]"), answer.body[-300:]
    else:
        assert answer.json()["choices"]


@fuzz
@given(body=chat_bodies)
def test_chat_bodies_never_fail_the_server(server, body):
    if not isinstance(body.get("max_tokens"), int) or body["max_tokens"] > 4:
        body = {**body, "max_tokens": 2}  # keep the valid ones short
    answer = send(server, "POST", "/v1/chat/completions", json.dumps(body).encode())
    check_error(answer)
    event(f"HTTP {answer.status}")
    if not schema_accepts(body):
        assert answer.status == 400, (body, answer.status, answer.body[:300])
    elif answer.status == 400:
        # Only the engine may refuse what the schema takes: a conversation order its chat
        # template refuses. Its error is relayed with its numeric code (ours are names).
        assert answer.json()["error"]["code"] == 400, answer.body[:300]
        event("the engine refused a conversation order")
    else:
        assert answer.status == 200, (body, answer.body[:300])


@fuzz
@given(raw=st.binary(max_size=300), path=st.sampled_from(PATHS), method=st.sampled_from(METHODS),
       content_type=st.sampled_from([b"application/json", b"text/plain", None]))
def test_raw_bytes_on_any_route_and_method(server, raw, path, method, content_type):
    answer = send(server, method, path, raw, content_type=content_type)
    check_error(answer, path)
    if raw and content_type != b"application/json":
        assert answer.status == 415


nesting = st.builds(
    lambda depth, opener, closed: (opener * depth + (b"1" + (b"]" if opener == b"[" else b"}") * depth
                                                     if closed else b"")),
    st.integers(101, 40_000), st.sampled_from([b"[", b'{"a":']), st.booleans(),
)


@fuzz
@given(raw=nesting, path=st.sampled_from(["/v1/chat/completions", "/v1/completions", "/slots/0?action=save",
                                          "/v1/messages", "/v1/messages/count_tokens", "/v1/responses",
                                          "/v1/embeddings", "/infill", "/tokenize", "/detokenize",
                                          "/apply-template"]))
def test_deep_nesting_is_refused_on_every_route_with_a_body(server, raw, path):
    assume(len(raw) < MAX_BODY)
    answer = send(server, "POST", path, raw)
    check_error(answer, path)
    assert answer.status == 400


@fuzz
@given(depth=st.integers(1, 95))
def test_nesting_within_the_limit_is_answered(server, depth):
    body = b'{"messages": [{"role": "user", "content": "nest"}], "max_tokens": 1, "metadata": ' \
           + b'{"a": ' * depth + b"1" + b"}" * depth + b"}"
    answer = send(server, "POST", "/v1/chat/completions", body)
    assert answer.status == 200, answer.body[:300]


plain_names = st.from_regex(r"[a-z0-9_-]{1,12}\.bin", fullmatch=True)
multibyte = st.text(st.sampled_from("語éßж😀ॐ"), min_size=60, max_size=200)


def escaping_names(tmp: Path):
    return st.sampled_from(["../bait.bin", "../../bait.bin", "../../../bait.bin", "..", ".", "a/b.bin",
                            "..\\x.bin", str(tmp / "bait.bin"), str(tmp / "deep" / "new.bin"), "nul\x00.bin",
                            "/etc/passwd", "x" * 256, " lead.bin", "trail.bin ", "tab\t.bin", "q?.bin"])


@fuzz
@given(data=st.data())
def test_slot_actions_reach_file_names_and_write_nothing_outside(server, data):
    tmp, slots = server["tmp"], server["slots"]
    valid = st.sampled_from(ACTIONS)
    action = data.draw(st.one_of(valid, valid, valid, st.text(max_size=8)))
    name = data.draw(st.one_of(plain_names, multibyte, escaping_names(tmp), st.text(max_size=40), json_values))
    answer = send(server, "POST", f"/slots/0?action={quote(action)}", json.dumps({"filename": name}).encode())
    check_error(answer)
    event(f"{action if action in ACTIONS else 'bad action'}: HTTP {answer.status}")
    if action not in ACTIONS:
        assert answer.status == 400
    elif action == "erase":
        assert answer.status == 200, answer.body
    elif isinstance(name, str) and re.fullmatch(r"[a-z0-9_-]{1,12}\.bin", name):
        if action == "save" or (slots / name).is_file():
            assert answer.status == 200, answer.body
            assert (slots / name).is_file()
        else:
            assert answer.status == 404
    elif isinstance(name, str) and len(name.encode("utf-8", "surrogatepass")) > 255:
        assert answer.status == 400 and answer.json()["error"]["param"] == "filename"
    else:
        assert answer.status in (200, 400, 404), answer.body


@fuzz
@given(name=st.from_regex(r"[A-Za-z][A-Za-z0-9-]{0,19}", fullmatch=True),
       value=st.binary(max_size=200).map(lambda b: b.replace(b"\r", b"").replace(b"\n", b"").strip(b" \t")))
def test_random_headers(server, name, value):
    assume(name.lower() not in {"host", "content-length", "transfer-encoding", "connection", "authorization",
                                "content-type", "expect", "upgrade"})
    answer = send(server, "GET", "/v1/models", headers=[(name.encode(), value)])
    if name.lower() == "origin" and value:
        check_error(answer)
        assert answer.status == 403
        return
    if re.search(rb"[\x00-\x08\x0a-\x1f\x7f]", value):
        # Not a valid header value: aiohttp's parser refuses the bytes (a plain 400)
        # before any request exists to answer in the OpenAI shape.
        assert answer.status == 400
        return
    check_error(answer)
    assert answer.status == 200


def authorization_values():
    odd = st.sampled_from([b"Basic " + KEY.encode(), b"Bearer", b"Bearer ", b"bearer " + KEY.encode(),
                           b"BEARER  " + KEY.encode(), b"Bearer\t" + KEY.encode(), KEY.encode(),
                           b"Bearer " + KEY.encode() + b" x", b"Bearer " + KEY.encode() + b"\xff",
                           b"Digest username=x", b"Bearer \xff", b"Bearer \xe8\xaa\x9e"])
    return st.one_of(
        odd,
        st.binary(max_size=60).map(lambda b: b"Bearer " + b),
        st.text(max_size=40).map(lambda t: b"Bearer " + t.encode()),
        st.integers(1000, 8000).map(lambda n: b"Bearer " + b"k" * n),
        st.integers(8200, 20_000).map(lambda n: b"Bearer " + b"k" * n),
    ).map(lambda b: b.replace(b"\r", b"").replace(b"\n", b""))


@fuzz
@given(authorization=authorization_values(), path=st.sampled_from(["/v1/models", "/slots", "/stats"]))
def test_malformed_authorization_headers(server, authorization, path):
    answer = send(server, "GET", path, headers=[(b"Authorization", authorization)], auth=False)
    value = authorization.strip(b" \t")
    if len(authorization) > 8190 or re.search(rb"[\x00-\x08\x0a-\x1f\x7f]", value):
        assert 400 <= answer.status < 500  # refused by the HTTP parser, before any handler
        return
    check_error(answer)
    if re.fullmatch(rb"(?i:bearer) +" + KEY.encode(), value):
        assert answer.status == 200
    else:
        assert answer.status == 401


@fuzz
@given(session=st.one_of(multibyte, st.binary(min_size=1, max_size=300)
                         .map(lambda b: b.replace(b"\r", b"").replace(b"\n", b"").strip(b" \t"))))
def test_malformed_session_headers(server, session):
    raw = session.encode() if isinstance(session, str) else session
    assume(raw and not re.search(rb"[\x00-\x08\x0a-\x1f\x7f]", raw))
    body = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}).encode()
    answer = send(server, "POST", "/v1/chat/completions", body, headers=[(b"X-Session-Id", raw)])
    check_error(answer)
    expected = 200 if re.fullmatch(rb"[A-Za-z0-9_-]{1,64}", raw) else 400
    assert answer.status == expected, answer.body[:300]


@fuzz
@given(host=st.one_of(st.binary(max_size=80), st.text(max_size=40).map(str.encode),
                      st.sampled_from([b"[", b"[::1", b"[::1]:x", b":", b"localhost:", b"127.0.0.1:99999",
                                       b"a..b", b"xn--", b"\xff.example"]))
                 .map(lambda b: b.replace(b"\r", b"").replace(b"\n", b"").strip(b" \t")),
       origin=st.booleans())
def test_random_host_headers(server, host, origin):
    assume(not re.search(rb"[\x00-\x08\x0a-\x1f\x7f]", host))
    lines = [b"GET /v1/models HTTP/1.1", b"Host: " + host, b"Connection: close", b"Authorization: Bearer " + KEY.encode()]
    if origin:
        lines.append(b"Origin: http://" + host)
    with socket.create_connection(("127.0.0.1", server["port"]), timeout=60) as sock:
        sock.sendall(b"\r\n".join(lines) + b"\r\n\r\n")
        raw = b""
        while chunk := sock.recv(65536):
            raw += chunk
    assert raw, "the server dropped the connection without answering"
    answer = Answer(raw)
    check_error(answer)
    name = host.decode("utf-8", "replace").lower().rpartition(":")[0] or host.decode("utf-8", "replace").lower()
    if answer.status == 200:
        assert name in ("127.0.0.1", "localhost", "") or name.startswith("[") or name.endswith(".localhost") \
            or re.fullmatch(r"[0-9.]+", name), host


def test_openapi_document_describes_the_server(server):
    answer = send(server, "GET", "/openapi.json")
    assert answer.status == 200
    document = answer.json()
    assert document["openapi"].startswith("3.")
    for path, operations in document["paths"].items():
        concrete = path.replace("{slot_id}", "0")
        for method, operation in operations.items():
            answer = send(server, method.upper(), concrete, b"{}")
            assert str(answer.status) in operation["responses"], (method, path, answer.status, answer.body[:200])
            check_error(answer, concrete)
    assert send(server, "GET", "/openapi.json", auth=False).status == 401, "the description is guarded"


def test_slow_client_gets_408_and_huge_headers_get_4xx(server):
    with socket.create_connection(("127.0.0.1", server["port"])) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer " + KEY.encode()
                     + b"\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"messa")
        sock.settimeout(10)
        began = time.monotonic()
        answer = sock.recv(4096)
    assert b" 408 " in answer.split(b"\r\n")[0] and time.monotonic() - began < 5
    ErrorResponse.model_validate_json(answer.split(b"\r\n\r\n", 1)[1])

    answer = send(server, "GET", "/v1/models", headers=[(b"X-Big", b"x" * 20_000)])
    assert 400 <= answer.status < 500
    big = json.dumps({"messages": [{"role": "user", "content": "x" * 100_000}]}).encode()
    answer = send(server, "POST", "/v1/chat/completions", big)
    assert answer.status == 413
    check_error(answer)
