"""The soak: strata-serve under every fault at once, for a bounded time (``make soak``).

``python -m bench.soak [--minutes 30]`` runs the real ``strata-serve run`` (its own process,
the real llama-server, the tiny demo model, auto-sessions on, the engine's RAM cache off so
every return is the disk's) and, for the whole run:

- clients of every API at once (OpenAI chat completions, completions, Responses, Anthropic
  messages; streamed and not), some impatient: they close before the first byte, in the
  middle of a stream, or right after the last event;
- every ``--fault-every`` seconds (60): the engine killed (SIGKILL), the engine frozen
  (SIGSTOP, SIGCONT some seconds later), the slot directory, a small tmpfs, filled up to its
  last byte with a ballast file and emptied again;
- in turn with those, in cycles of their own: a hung shared tier (auto-sessions shares its
  conversations through a directory tier; one conversation's head is replaced by a FIFO, so
  that opening it blocks as on a hung NFS mount, and that conversation's next turn is sent;
  then the FIFO's waiting readers are let go and the head put back), and slow readers (a
  streamed request whose client reads its headers and a plain one whose client reads
  nothing, both of answers made large with ``logprobs``, held unread for ``slow_s``);
- once, strata-serve itself stopped (SIGTERM) and started again on the same directory:
  during the first hung tier (a sixth of the way in when there is none); each stop is timed.

``/health`` is asked every second throughout. The report gives, per kind of fault, what the
other clients saw while it lasted (requests answered and failed, their latencies), the
``/health`` answers, and how long each stop took.

Every so often it records strata-serve's resident memory, its open files, the session files
on disk, and the tokens re-read by returning conversations (a return's prompt tokens the
engine held at the conversation's previous turn and did not reuse, from the engine's own
counts; its ``X-Strata-State`` header says where the state came from). Then the faults stop
and every conversation still parked comes back, twice: once from what the faults left, once
in a quiet round that must re-read nothing.

It exits non-zero unless (:func:`judge`): every request was answered, or failed in its API's
error shape with a status a fault explains (502/503, or a stream's error event, during an
engine kill or the restart; refused connections only while strata-serve was down), never a
500, never past :data:`DEADLINE_S`; other clients answered while the tier hung and while the
slow readers held on; every stop ended within :data:`STOP_DEADLINE_S` without a SIGKILL;
every parked conversation returned from its state; and resources stayed flat (:class:`Limits`). The table goes to ``bench/results/soak.md``.
Mounting the tmpfs needs root.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import queue
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any
from collections.abc import Iterator

import requests

from bench.run import machine
from bench.systems import StrataServe, System, children
from strata_auto_sessions.naming import session_name
from strata_auto_sessions.parked_blocks import ParkedBlocks
from strata_auto_sessions.store import SessionStore
from strata_serve.demo_model import write_demo_model
from tests.test_reliability import tmpfs

RESULTS = Path(__file__).resolve().parent / "results"

#: A request not done this long after it was sent is a hang (the longest fault, a frozen
#: engine, lasts :attr:`Plan.stop_s`; a queue of every client behind it takes seconds more).
DEADLINE_S = 120.0
#: A fault explains a failure of a request that was running from this long before it began
#: to this long after the server answered again.
FAULT_MARGIN_S = 5.0
#: Once the clients stop, the server is taken as done with their requests after this long
#: without answering, saving or pruning anything (past auto-sessions' ``idle_save_s``, 2 s);
#: it must get there within :data:`SETTLE_DEADLINE_S`.
SETTLED_S = 4.0
SETTLE_DEADLINE_S = 60.0
#: A stop (SIGTERM) not over this long after it was asked is cut with SIGKILL: a stop that
#: did not end.
STOP_DEADLINE_S = 30.0
#: How long the slow readers' answers may take to be made (one slot: the engine makes
#: them in turn) before the readers' hold begins all the same.
GENERATION_CAP_S = 180.0
#: With a shared tier, an upload's snapshot lives as long as its calls on the tier (each
#: bounded by ``timeout_s``, 5 s): a temporary is taken as left once seen this long.
TIER_TEMPORARY_S = 15.0
#: Once the slow readers read again, how long each waits for a byte before it gives up (a
#: whole answer kept alive by the server ends no other way).
READ_REST_S = 30.0
#: How often ``/health`` is asked.
HEALTH_EVERY_S = 1.0
#: The APIs that hold a conversation; ``/v1/completions`` requests are side requests.
CONVERSATION_APIS = ("chat", "responses", "messages")
PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions", "responses": "/v1/responses",
         "messages": "/v1/messages"}
#: How a client reads its answer, and how often each is drawn.
PATTERNS = {
    "read_all": 4,           # the whole answer (a stream to its end)
    "after_last_event": 2,   # a stream, closed right after its last event (before [DONE])
    "mid_stream": 2,         # a stream, closed after two events
    "before_first_byte": 2,  # the request sent, the connection closed at once
}
STREAM_ONLY = {"after_last_event", "mid_stream"}


@dataclass(frozen=True)
class Limits:
    """What "resources flat" and "returned from its state" mean, stated."""

    #: Median resident memory of the last third over the first third's (same process).
    rss_growth_mib: float = 32.0
    #: Most open files in the last third over the most in the first third.
    fd_growth: int = 16
    #: Session files on disk at any sample: ``keep`` (the prune setting) plus the one just
    #: committed before its prune runs; temporaries: those of the one save in progress (one
    #: slot), its state and its sidecar; a temporary seen at two samples in a row was left.
    extra_files: int = 1
    temporaries: int = 2
    #: Tokens a quiet return may re-read of what its conversation held (the engine reads at
    #: least one token again; a chat template may split a reply's last token differently).
    quiet_reread: int = 4
    #: With a shared tier, each upload under way holds a snapshot of its file and sidecar
    #: (two temporaries) beside the save's: at most one upload per conversation.
    upload_temporaries: int = 2


@dataclass(frozen=True)
class Plan:
    """The run's shape. The defaults are ``make soak``'s."""

    minutes: float = 30.0
    fault_every_s: float = 60.0
    #: How long the engine stays frozen each time.
    stop_s: float = 6.0
    clients: int = 6
    #: Conversations at a time, fewer than ``keep``: a conversation grown past ``longest``
    #: is left for a new one, and the files of those left are what pruning removes, so a
    #: return that re-reads with its file on disk shows a loss, not a prune.
    conversations: int = 6
    keep: int = 8
    min_tokens: int = 200
    opening: int = 600
    grow: int = 150
    #: A conversation longer than this is left for a new one (the context is 4,096).
    longest: int = 2400
    max_tokens: int = 12
    ctx: int = 4096
    tmpfs_mib: int = 32
    #: Share of client steps that are side requests (``/v1/completions``, no conversation).
    side_share: float = 0.15
    seed: int = 7
    #: The faults of the shared tier and of slow clients, each in a cycle of its own (see
    #: :meth:`Soak.schedule`): how long the tier hangs, how long the slow readers hold on
    #: (each at most 0.6 of ``fault_every_s``), and the tokens of their answers, each with
    #: ``slow_candidates`` candidates' logprobs: 100 make about 8.9 KB a token on SmolLM2, so
    #: 300 tokens are 2.7 MB, more than a loopback socket's buffers hold (about 1.4 MB with
    #: the reader's 4 KiB). Many candidates and few tokens: the engine makes the bytes in a
    #: quarter of the time 1,200 tokens of 20 candidates took (two answers of 90 s each, one
    #: slot: the other clients' requests waited past their deadline behind the workload,
    #: not behind the fault).
    hung_tier: bool = True
    hang_s: float = 40.0
    slow_reader: bool = True
    slow_s: float = 60.0
    slow_tokens: int = 300
    slow_candidates: int = 100

    @property
    def seconds(self) -> float:
        return self.minutes * 60

    @property
    def sample_every_s(self) -> float:
        return min(60.0, max(2.0, self.seconds / 40))


# -- what the clients send and read -----------------------------------------------------------

def filler(name: str, tokens: int) -> str:
    """About ``tokens`` tokens (the demo vocabulary reads one per character)."""
    unit = f" {name} walks the long shore;"
    return (unit * (tokens // len(unit) + 1))[:tokens]


def request_body(api: str, turns: list[tuple[str, str]], max_tokens: int, stream: bool) -> dict[str, Any]:
    """The body a client of ``api`` sends for a conversation of ``turns`` (role, text)."""
    messages = [{"role": role, "content": text} for role, text in turns]
    if api == "responses":
        # Typed items, as the Responses API's clients send them (the engine needs the type).
        messages = [{"type": "message", "role": role,
                     "content": [{"type": "input_text" if role == "user" else "output_text", "text": text}]}
                    for role, text in turns]
    if api == "chat":
        return {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": stream}
    if api == "completions":
        return {"prompt": turns[-1][1], "max_tokens": max_tokens, "temperature": 0, "stream": stream}
    if api == "responses":
        return {"input": messages, "max_output_tokens": max_tokens, "temperature": 0, "stream": stream}
    return {"model": "local", "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": stream}


def in_error_shape(api: str, body: Any) -> bool:
    """An error body in the API's own shape: Anthropic's under ``/v1/messages``, OpenAI's elsewhere."""
    if not isinstance(body, dict) or not isinstance(body.get("error"), dict):
        return False
    error = body["error"]
    if api == "messages":
        return body.get("type") == "error" and isinstance(error.get("type"), str) \
            and isinstance(error.get("message"), str)
    return isinstance(error.get("message"), str)


def is_error_event(api: str, event: dict[str, Any]) -> bool:
    if api in ("responses", "messages"):
        return event.get("type") == "error"
    return isinstance(event.get("error"), dict)


def counts(api: str, answer: dict[str, Any]) -> tuple[int, int] | None:
    """(tokens reused, tokens read anew) of a prompt, from an answer or its counting event."""
    timings = answer.get("timings")
    if isinstance(timings, dict) and "prompt_n" in timings:
        return int(timings.get("cache_n", 0)), int(timings["prompt_n"])
    usage = answer.get("usage")
    if not isinstance(usage, dict):
        return None
    if api == "messages":
        reused = int(usage.get("cache_read_input_tokens") or 0)
        return reused, int(usage.get("input_tokens") or 0)
    if api == "responses":
        reused = int((usage.get("input_tokens_details") or {}).get("cached_tokens") or 0)
        return reused, int(usage.get("input_tokens") or 0) - reused
    return None


def answer_text(api: str, answer: dict[str, Any]) -> str:
    if api == "chat":
        return ((answer.get("choices") or [{}])[0].get("message") or {}).get("content") or ""
    if api == "completions":
        return (answer.get("choices") or [{}])[0].get("text") or ""
    if api == "responses":
        return "".join(part.get("text") or "" for item in answer.get("output") or [] if isinstance(item, dict)
                       for part in item.get("content") or [] if isinstance(part, dict))
    return "".join(block.get("text") or "" for block in answer.get("content") or [] if isinstance(block, dict))


class StreamReader:
    """What a client learns from a stream's events, one API at a time."""

    def __init__(self, api: str) -> None:
        self.api = api
        self.pieces: list[str] = []
        self.counts: tuple[int, int] | None = None
        self.error: dict[str, Any] | None = None
        self.events = 0
        self.last = False  # the answer's last event (its counts) was read
        self.ended = False  # the stream's own end was read

    def feed(self, data: bytes) -> None:
        if data == b"[DONE]":
            self.ended = True
            return
        event = json.loads(data)
        self.events += 1
        if is_error_event(self.api, event):
            self.error = event
            return
        kind = event.get("type")
        if self.api in ("chat", "completions"):
            for choice in event.get("choices") or []:
                self.pieces.append((choice.get("delta") or {}).get("content") or choice.get("text") or "")
            if isinstance(event.get("timings"), dict):
                self.counts, self.last = counts(self.api, event), True
        elif self.api == "responses":
            if kind == "response.output_text.delta":
                self.pieces.append(event.get("delta") or "")
            elif kind == "response.completed":
                self.counts = counts(self.api, event) or counts(self.api, event.get("response") or {})
                self.last = self.ended = True
        else:
            if kind == "message_start":
                self.counts = counts(self.api, event.get("message") or {})
            elif kind == "content_block_delta":
                self.pieces.append((event.get("delta") or {}).get("text") or "")
            elif kind == "message_stop":
                self.last = self.ended = True


@dataclass
class Record:
    """One request: what was sent, how the client read it, what came back."""

    api: str
    stream: bool
    pattern: str
    began: float
    ended: float = 0.0
    status: int | None = None
    #: answered | closed (the client left, as planned) | failed_in_shape | unreachable | violation
    outcome: str = ""
    detail: str = ""
    state: str | None = None
    #: The conversation's key, as strata-serve named it (``X-Strata-Conversation``).
    key: str | None = None
    reused: int | None = None
    read: int | None = None
    #: Tokens of this conversation the engine held at its previous answered turn (returns).
    held_before: int = 0
    #: The conversation's file was on disk when the request was sent.
    had_file: bool = False
    phase: str = "faults"
    #: "client", or "hung_turn": the turn of the conversation whose head hangs, sent by the fault.
    role: str = "client"


def _sse(reply: requests.Response) -> Iterator[bytes]:
    for line in reply.iter_lines():
        if line.startswith(b"data:"):
            yield line[5:].strip()


def send_and_forget(url: str, path: str, body: dict[str, Any]) -> None:
    """A client that sends its request and closes the connection before any byte of the answer."""
    payload = json.dumps(body).encode()
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)


def send(url: str, api: str, body: dict[str, Any], pattern: str, record: Record) -> str | None:
    """Send one request as a client of ``pattern``; fill ``record``; return the answer's text
    when the client read a whole answer."""
    path = PATHS[api]
    try:
        if pattern == "before_first_byte":
            send_and_forget(url, path, body)
            record.outcome = "closed"
            return None
        with requests.post(url + path, json=body, stream=record.stream, timeout=(10, DEADLINE_S)) as reply:
            record.status = reply.status_code
            record.state = reply.headers.get("X-Strata-State")
            record.key = reply.headers.get("X-Strata-Conversation")
            if reply.status_code != 200:
                shaped = in_error_shape(api, _json(reply.content))
                explainable = reply.status_code in (502, 503)
                record.outcome = "failed_in_shape" if shaped and explainable else "violation"
                record.detail = f"HTTP {reply.status_code}{'' if shaped else ' not in the API error shape'}: " \
                                f"{reply.text[:200]}"
                return None
            if not record.stream:
                answer = reply.json()
                found = counts(api, answer)
                if found is not None:
                    record.reused, record.read = found
                record.outcome = "answered"
                return answer_text(api, answer)
            reader = StreamReader(api)
            for data in _sse(reply):
                reader.feed(data)
                if reader.error is not None:
                    record.outcome, record.detail = "failed_in_shape", f"stream error event: {reader.error}"[:300]
                    return None
                if pattern == "mid_stream" and reader.events >= 2:
                    record.outcome = "closed"
                    return None
                if reader.last and pattern == "after_last_event" or reader.ended:
                    break
            if reader.counts is not None:
                record.reused, record.read = reader.counts
            if not reader.last:
                record.outcome, record.detail = "violation", "the stream ended with neither its end nor an error event"
                return None
            record.outcome = "answered"
            return "".join(reader.pieces)
    except requests.exceptions.Timeout as exc:
        record.outcome, record.detail = "violation", f"hang: no byte for {DEADLINE_S:.0f} s ({type(exc).__name__})"
    except (requests.exceptions.ConnectionError, ConnectionRefusedError, ConnectionResetError) as exc:
        # A refused connection (nothing listening), or one cut under a stream: which of
        # the two, and whether the restart explains it, is for :func:`judge`.
        # A connection closed or reset before the answer's status line ("aborted": a stop's
        # listener dropping, or the kernel resetting, what it had not accepted yet) reached no
        # handler either: unanswered, like a refusal. One cut later ("broken") is not.
        text = str(exc).lower()
        refused = "refused" in text or isinstance(exc, ConnectionRefusedError) \
            or "without response" in text or "connection aborted" in text
        record.outcome = "unreachable" if refused else "violation"
        label = "connection refused" if "refused" in text else "dropped before the answer" if refused \
            else "connection cut"
        record.detail = f"{label}: {exc}"[:300]
    except (ValueError, OSError, requests.RequestException) as exc:
        record.outcome, record.detail = "violation", f"{type(exc).__name__}: {exc}"[:300]
    finally:
        record.ended = time.monotonic()
    return None


def slow_request(host: str, port: int, path: str, body: dict[str, Any]) -> socket.socket:
    """A connection with a tiny receive buffer that has sent its request and reads nothing yet."""
    payload = json.dumps(body).encode()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.settimeout(10)
    sock.connect((host, port))
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
    return sock


def read_headers(sock: socket.socket, timeout: float) -> bytes:
    """Read up to the end of the answer's headers, a byte at a time (nothing of the body)."""
    sock.settimeout(timeout)
    seen = b""
    while not seen.endswith(b"\r\n\r\n"):
        byte = sock.recv(1)
        if not byte:
            raise ConnectionError("closed before the end of its headers")
        seen += byte
    return seen


def read_rest(sock: socket.socket, timeout: float) -> dict[str, Any]:
    """Read all that is left, until the server ends the connection or its answer ends: the
    bytes, and whether the answer came whole (a stream's end, or a plain answer's length)."""
    sock.settimeout(timeout)
    data = b""
    ended = "the server closed the connection"
    try:
        while True:
            chunk = sock.recv(1 << 16)
            if not chunk:
                break
            data += chunk
            if whole_answer(data):
                ended = "the answer's end"
                break
    except TimeoutError:
        ended = f"nothing for {timeout:.0f} s"
    except OSError as exc:
        ended = f"{type(exc).__name__}"
    return {"bytes": len(data), "whole": whole_answer(data), "ended_by": ended}


def whole_answer(data: bytes) -> bool:
    """Whether ``data`` (what a reader got, its headers included when it had not read them) holds
    a whole answer: a stream's ``[DONE]``, or a plain answer's ``Content-Length`` of bytes."""
    if b"data: [DONE]" in data or data.endswith(b"\r\n0\r\n\r\n"):  # a stream's end, a chunked body's
        return True
    head, _, body = data.partition(b"\r\n\r\n")
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            return len(body) >= int(line.split(b":", 1)[1])
    return False


def _json(content: bytes) -> Any:
    try:
        return json.loads(content)
    except ValueError:
        return None


@dataclass
class Conversation:
    """One client conversation on one API; it grows a turn each time a whole answer was read."""

    api: str
    name: str
    turns: list[tuple[str, str]] = field(default_factory=list)
    key: str | None = None
    #: Prompt tokens the engine held for it at its last answered turn (0: none yet).
    held: int = 0
    answered: int = 0

    def tokens(self) -> int:
        return sum(len(text) for _, text in self.turns)


# -- the run ------------------------------------------------------------------------------------

@dataclass
class Fault:
    kind: str  # kill | stop | disk_full | restart | hung_tier | slow_reader
    began: float
    ended: float = 0.0
    #: What the fault itself saw: a stop's duration, the hung conversation's turn, the slow readers.
    detail: dict[str, Any] = field(default_factory=dict)


@dataclass
class Health:
    """One ``GET /health``: its status (None: no answer) and how long it took."""

    at: float
    status: int | None
    took: float
    body: str = ""


@dataclass
class Sample:
    at: float
    pid: int
    rss_mib: float
    fds: int
    session_files: int
    temporaries: int
    disk_bytes: int
    stats: dict[str, Any] | None
    temporary_names: list[str] = field(default_factory=list)


def process_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def open_files(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


BALLAST = "ballast"


def is_sidecar(name: str) -> bool:
    """Whether ``name`` is a parked conversation's sidecar (``auto-<key>.json``: one for each,
    whole or in blocks; ``auto-.engine.json`` and the like are the plugin's own)."""
    return name.startswith("auto-") and not name.startswith("auto-.") and name.endswith(".json")


def slot_files(directory: Path) -> tuple[int, list[str], int]:
    """(parked conversations, temporaries, bytes of every file but the ballast, the block
    store's included) in the slot directory."""
    sessions = size = 0
    temporaries: list[str] = []
    for path in directory.rglob("*"):
        if path.name == BALLAST or not path.is_file():
            continue
        with contextlib.suppress(OSError):
            size += path.stat().st_size
        if path.parent != directory:
            continue
        if path.name.startswith("tmp-"):
            temporaries.append(path.name)
        elif is_sidecar(path.name):
            sessions += 1
    return sessions, temporaries, size


def fill(directory: Path) -> None:
    """Fill the file system of ``directory`` to its last byte with one ballast file."""
    fd = os.open(directory / BALLAST, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        for block in (b"\0" * (1 << 20), b"\0" * 4096):
            with contextlib.suppress(OSError):  # ENOSPC: full
                while os.write(fd, block):
                    pass
    finally:
        os.close(fd)


class Soak:
    def __init__(self, plan: Plan, work: Path) -> None:
        self.plan, self.work = plan, work
        self.model = write_demo_model(work / "tiny.gguf", size="tiny")
        auto: dict[str, Any] = {"min_tokens": plan.min_tokens, "keep": plan.keep}
        #: The shared directory tier (with :attr:`Plan.hung_tier`), outside the slot directory's tmpfs.
        self.shared_dir: Path | None = None
        if plan.hung_tier:
            self.shared_dir = work / "shared"
            self.shared_dir.mkdir()
            auto["shared"] = {"url": f"file://{self.shared_dir}"}
        self.system = System("strata-serve + auto-sessions, RAM cache off", "strata", cache_ram_mib=0,
                             plugins={"auto_sessions": auto}, server={"shutdown_grace_s": 2})
        self.slot_dir = work / "slots"
        self.health: list[Health] = []
        #: Each stop of strata-serve: why, how long it took, whether it had to be killed.
        self.stops: list[dict[str, Any]] = []
        #: The hung tier under way: (its fault, the conversation, the FIFO, the head set aside).
        self.hung: tuple[Fault, Conversation, Path, Path] | None = None
        self.tier_back = threading.Event()
        self.records: list[Record] = []
        self.faults: list[Fault] = []
        self.samples: list[Sample] = []
        self.free: queue.Queue[Conversation] = queue.Queue()
        self.conversations: list[Conversation] = []
        self.made = 0
        self.stop = threading.Event()
        self.server: StrataServe | None = None
        self.began = 0.0
        self.problems: list[str] = []

    @property
    def url(self) -> str:
        assert self.server is not None
        return self.server.url

    def start_server(self) -> None:
        self.server = StrataServe(self.system, self.model, self.plan.ctx, self.work, [])

    def stop_server(self, why: str) -> dict[str, Any]:
        """SIGTERM, then SIGKILL past :data:`STOP_DEADLINE_S`: how long the stop took, and whether it ended."""
        assert self.server is not None
        process = self.server.process
        began = time.monotonic()
        killed = False
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(STOP_DEADLINE_S)
            except subprocess.TimeoutExpired:
                killed = True
                process.kill()
                process.wait(10)
        stop = {"why": why, "at": began, "took_s": round(time.monotonic() - began, 2), "killed": killed,
                "tier_hung": self.hung is not None}
        self.stops.append(stop)
        return stop

    def new_conversation(self, api: str) -> Conversation:
        self.made += 1
        name = f"Soak{self.made}-{api}"
        conversation = Conversation(api, name, [("user", filler(name, self.plan.opening))])
        self.conversations.append(conversation)
        return conversation

    # -- clients

    def turn(self, conversation: Conversation, stream: bool, pattern: str, phase: str = "faults",
             role: str = "client") -> Record:
        body = request_body(conversation.api, conversation.turns, self.plan.max_tokens, stream)
        record = Record(conversation.api, stream, pattern, time.monotonic(), held_before=conversation.held,
                        phase=phase, role=role, had_file=conversation.key is not None
                        and (self.slot_dir / f"auto-{conversation.key}.json").exists())
        text = send(self.url, conversation.api, body, pattern, record)
        self.records.append(record)
        conversation.key = record.key or conversation.key
        if text is not None:
            if record.reused is not None and record.read is not None:
                conversation.held = record.reused + record.read
            conversation.answered += 1
            n = len(conversation.turns)
            # An empty reply (the model's first token ended it) is sent back as a word: an
            # assistant message without text is refused by some APIs.
            conversation.turns = [*conversation.turns, ("assistant", text or "ok"),
                                  ("user", filler(f"{conversation.name} turn {n}", self.plan.grow))]
        return record

    def side(self, stream: bool, pattern: str) -> Record:
        body = request_body("completions", [("user", filler(f"side {time.monotonic():.3f}", 48))],
                            self.plan.max_tokens, stream)
        record = Record("completions", stream, pattern, time.monotonic())
        send(self.url, "completions", body, pattern, record)
        self.records.append(record)
        return record

    def client(self, seed: int) -> None:
        try:
            self._client(seed)
        except Exception as exc:  # noqa: BLE001 - a client that died is a failed soak, said why
            self.problems.append(f"a client died: {type(exc).__name__}: {exc}")

    def _client(self, seed: int) -> None:
        draw = random.Random(seed)
        patterns, weights = list(PATTERNS), list(PATTERNS.values())
        while not self.stop.is_set():
            pattern = draw.choices(patterns, weights)[0]
            stream = pattern in STREAM_ONLY or draw.random() < 0.5
            if draw.random() < self.plan.side_share:
                if self.side(stream, pattern).outcome == "unreachable":
                    time.sleep(1.0)
                continue
            try:
                conversation = self.free.get(timeout=1)
            except queue.Empty:
                continue
            try:
                if self.turn(conversation, stream, pattern).outcome == "unreachable":
                    time.sleep(1.0)  # nothing listens: a client tries again a little later
            finally:
                if conversation.tokens() > self.plan.longest:
                    conversation = self.new_conversation(conversation.api)
                self.free.put(conversation)

    # -- faults

    def engine_pid(self) -> int | None:
        assert self.server is not None
        pid = self.server.engine_pid()
        return pid if pid in children(self.server.process.pid) else None

    def fault(self, kind: str) -> None:
        """Make one fault; it is recorded from its start to the moment it is over."""
        assert self.server is not None
        if kind == "disk_back":
            with contextlib.suppress(FileNotFoundError):
                (self.slot_dir / BALLAST).unlink()
            for earlier in self.faults:
                if earlier.kind == "disk_full" and not earlier.ended:
                    earlier.ended = time.monotonic()
            return
        if kind == "tier_back":
            self.unhang_tier()
            return
        record = Fault(kind, time.monotonic())
        self.faults.append(record)
        try:
            if kind == "kill":
                self.server.restart_engine()  # SIGKILL, then back once strata-serve says healthy
            elif kind == "stop":
                pid = self.engine_pid()
                if pid is not None:
                    os.kill(pid, signal.SIGSTOP)
                    try:
                        self.stop.wait(self.plan.stop_s)
                    finally:
                        os.kill(pid, signal.SIGCONT)
            elif kind == "disk_full":
                fill(self.slot_dir)
                return  # over at the next disk_back
            elif kind == "restart":
                # SIGTERM: in-flight streams end with an error event.
                record.detail = self.stop_server("restart")
                self.start_server()  # the same slot directory
            elif kind == "hung_tier":
                self.hang_tier(record)
                return  # over at the next tier_back
            elif kind == "slow_reader":
                self.slow_readers(record)
        except Exception as exc:  # noqa: BLE001 - a fault that could not be made is a failed soak
            self.problems.append(f"the {kind} fault failed: {type(exc).__name__}: {exc}")
        record.ended = record.ended or time.monotonic()  # slow readers: the hold alone

    def cycles(self) -> list[str]:
        """What each ``fault_every_s`` cycle holds, in turn: the engine's and the disk's faults
        (``classic``), the hung tier, the slow readers (each when the plan has it)."""
        return ["classic"] + (["hung_tier"] if self.plan.hung_tier else []) \
            + (["slow_reader"] if self.plan.slow_reader else [])

    # -- the hung tier

    def take_keyed(self, timeout: float) -> Conversation | None:
        """A conversation out of the clients' rotation, one the server has named (a key):
        the first with a head in the shared tier, else, once each was seen, the first
        named. At most one is held back while looking: the clients go on with the others."""
        assert self.shared_dir is not None
        deadline = time.monotonic() + timeout
        fallback: Conversation | None = None
        seen = 0
        while time.monotonic() < deadline:
            try:
                conversation = self.free.get(timeout=0.5)
            except queue.Empty:
                continue
            seen += 1
            if conversation.key and (self.shared_dir / "heads" / session_name(conversation.key, "bin")).exists():
                if fallback is not None:
                    self.free.put(fallback)
                return conversation
            if conversation.key and fallback is None:
                fallback = conversation
            else:
                self.free.put(conversation)
            if fallback is not None and seen >= 2 * len(self.conversations):
                return fallback
        return fallback

    def hang_tier(self, record: Fault) -> None:
        """One conversation's head becomes a FIFO (opening it blocks, as on a hung NFS mount),
        and that conversation's next turn is sent; the conversation stays out of the
        clients' rotation until :meth:`unhang_tier`."""
        assert self.shared_dir is not None
        conversation = self.take_keyed(DEADLINE_S)
        if conversation is None or conversation.key is None:
            raise RuntimeError("no conversation named by the server yet")
        heads = self.shared_dir / "heads"
        heads.mkdir(mode=0o700, exist_ok=True)
        fifo = heads / session_name(conversation.key, "bin")
        aside = self.work / "aside" / fifo.name
        aside.parent.mkdir(exist_ok=True)
        had_head = fifo.exists()
        if had_head:
            os.replace(fifo, aside)
        os.mkfifo(fifo, 0o600)
        self.tier_back.clear()
        self.hung = (record, conversation, fifo, aside)
        record.detail = {"conversation": conversation.name, "had_head": had_head}

        def hung_turn() -> None:
            try:
                turn = self.turn(conversation, False, "read_all", role="hung_turn")
                record.detail["turn"] = {"outcome": turn.outcome, "status": turn.status, "state": turn.state,
                                         "took_s": round(turn.ended - turn.began, 2), "detail": turn.detail}
            finally:
                self.tier_back.wait()
                self.free.put(conversation)

        threading.Thread(target=hung_turn, daemon=True).start()

    def unhang_tier(self) -> None:
        """The tier comes back: the calls blocked opening the FIFO return (a writer opens it
        and closes it: they read nothing), and the head is put back."""
        if self.hung is None:
            return
        record, _conversation, fifo, aside = self.hung
        with contextlib.suppress(OSError):  # ENXIO: no one waits on it
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        fifo.unlink(missing_ok=True)
        if aside.exists():
            os.replace(aside, fifo)
        self.hung = None
        self.tier_back.set()
        record.ended = time.monotonic()

    # -- the slow readers

    def slow_readers(self, record: Fault) -> None:
        """A streamed request whose client reads its headers and a plain one whose client
        reads nothing, held unread for ``slow_s`` while the other clients go on; then what
        is left of each is read: how much came, and whether it was whole."""
        host, port = self.url.removeprefix("http://").split(":")
        extra = {"ignore_eos": True, "logprobs": True, "top_logprobs": self.plan.slow_candidates}
        prompt = [("user", "Tell me a very long story about the sea")]
        readers = {}
        for name, stream in (("stream", True), ("plain", False)):
            body = {**request_body("chat", prompt, self.plan.slow_tokens, stream), **extra}
            readers[name] = slow_request(host, int(port), PATHS["chat"], body)
        detail: dict[str, Any] = {}
        began = time.monotonic()
        try:
            try:
                head = read_headers(readers["stream"], DEADLINE_S)
                detail["stream_headers_s"] = round(time.monotonic() - began, 2)
                detail["stream_status"] = head.split(b" ", 2)[1].decode() if head.startswith(b"HTTP/") else None
            except OSError as exc:
                detail["stream_headers"] = f"no headers: {type(exc).__name__}: {exc}"
            # First the engine makes both answers (the engine's turns, whoever reads them);
            # then the readers hold on, unread, for slow_s: the fault proper, its window.
            detail["generation_over"] = self.wait_for_long_answers(2, GENERATION_CAP_S)
            detail["generated_s"] = round(time.monotonic() - began, 1)
            record.began = time.monotonic()
            self.stop.wait(min(self.plan.slow_s, 0.6 * self.plan.fault_every_s))
            record.ended = time.monotonic()
            for name, sock in readers.items():
                detail[name] = read_rest(sock, READ_REST_S)
        finally:
            for sock in readers.values():
                sock.close()
        record.detail = detail

    def wait_for_long_answers(self, count: int, cap_s: float) -> bool:
        """Wait until the engine has made ``count`` answers of :attr:`Plan.slow_tokens` (its
        own account of its slots, ``GET /slots``, outside the FIFO: a task that decoded half
        of them is one of those; the other clients ask a dozen tokens), at most ``cap_s``."""
        tasks: set[Any] = set()
        deadline = time.monotonic() + cap_s
        while time.monotonic() < deadline and not self.stop.is_set():
            try:
                reports = requests.get(self.url + "/slots", timeout=5).json()
            except (requests.RequestException, ValueError):
                reports = []
            for report in reports if isinstance(reports, list) else []:
                decoded = max((t.get("n_decoded", 0) for t in report.get("next_token") or [] if isinstance(t, dict)),
                              default=0) if isinstance(report, dict) else 0
                if decoded >= self.plan.slow_tokens // 2:
                    tasks.add(report.get("id_task"))
            if len(tasks) >= count and not any(isinstance(r, dict) and r.get("is_processing")
                                                and r.get("id_task") in tasks for r in reports):
                return True
            time.sleep(0.2)
        return False

    def schedule(self) -> list[tuple[float, str]]:
        """(seconds from the start, fault) for the whole run, in order."""
        every = self.plan.fault_every_s
        hang = min(self.plan.hang_s, 0.6 * every)
        hold = min(self.plan.slow_s, 0.6 * every)
        plan: list[tuple[float, str]] = []
        restart: float | None = None
        at, n = 0.0, 0
        while at < self.plan.seconds:
            kind = self.cycles()[n % len(self.cycles())]
            if kind == "classic":
                plan += [(at + 0.1 * every, "kill"), (at + 0.35 * every, "disk_full"),
                         (at + 0.6 * every, "disk_back"), (at + 0.7 * every, "stop")]
            elif kind == "hung_tier" and at + 0.1 * every + hang < self.plan.seconds - self.plan.stop_s:
                plan += [(at + 0.1 * every, "hung_tier"), (at + 0.1 * every + hang, "tier_back")]
                if restart is None:  # the first ends with a stop while the tier still hangs
                    restart = at + 0.1 * every + hang - 0.5
            elif kind == "slow_reader" and at + 0.1 * every + hold < self.plan.seconds - self.plan.stop_s:
                # Only where its hold ends before the run does: one cut by the end measures nothing.
                plan.append((at + 0.1 * every, "slow_reader"))
            at += every
            n += 1
        plan.append((self.plan.seconds / 6 if restart is None else restart, "restart"))
        return sorted((t, kind) for t, kind in plan if t < self.plan.seconds - self.plan.stop_s)

    def faults_loop(self) -> None:
        for at, kind in self.schedule():
            if self.stop.wait(max(0.0, self.began + at - time.monotonic())) and not (
                    kind == "restart" and self.hung is not None):
                # The run is over; but a restart planned during a hung tier is made even late
                # (on a busy machine the tier's conversation can be slow to come free).
                break
            print(f"  {time.monotonic() - self.began:6.0f} s  {kind}", flush=True)
            self.fault(kind)
        if (self.slot_dir / BALLAST).exists():
            self.fault("disk_back")
        if self.hung is not None:
            self.fault("tier_back")

    # -- measures

    def sample(self) -> None:
        assert self.server is not None
        pid = self.server.process.pid
        try:
            rss, fds = process_rss_mib(pid), open_files(pid)
        except OSError:
            return  # between a stop and the next start
        if rss == 0 or fds == 0:
            return  # exited, not yet reaped (a zombie has no memory and no open files)
        sessions, temporaries, size = slot_files(self.slot_dir)
        stats = self.server.stats()
        self.samples.append(Sample(time.monotonic(), pid, rss, fds, sessions, len(temporaries), size,
                                   ((stats or {}).get("plugins") or {}).get("auto_sessions"), temporaries))

    def sampler(self) -> None:
        while not self.stop.wait(self.plan.sample_every_s):
            self.sample()

    def health_poller(self) -> None:
        """``GET /health`` every :data:`HEALTH_EVERY_S`, as a balancer asks it."""
        while not self.stop.wait(HEALTH_EVERY_S):
            began = time.monotonic()
            try:
                reply = requests.get(self.url + "/health", timeout=10)
                self.health.append(Health(began, reply.status_code, time.monotonic() - began, reply.text[:200]))
            except requests.RequestException as exc:
                self.health.append(Health(began, None, time.monotonic() - began, type(exc).__name__))

    # -- once the faults stop

    def parked(self) -> list[Conversation]:
        """The conversations parked on disk now (whole or in blocks, and not pruned)."""
        store = SessionStore(self.slot_dir, ParkedBlocks.existing(self.slot_dir))
        return [c for c in self.conversations if c.key and store.sidecar(c.key) is not None and store.stage(c.key)]

    def settle(self) -> None:
        """Wait until the server has stopped working on its own: no request answered, no file
        saved or pruned, the slot directory unchanged, for :data:`SETTLED_S`.

        The clients are gone, but not all their requests: one whose client left before the
        first byte still runs when its turn comes, and may park a conversation (a new file,
        and the oldest pruned for it); then each held conversation is saved once its slot
        has been idle ``idle_save_s``. The list taken before all that is over would name a
        file pruned a moment later.
        """
        def picture() -> tuple[Any, ...]:
            stats = (self.server.stats() if self.server is not None else None) or {}
            auto = (stats.get("plugins") or {}).get("auto_sessions") or {}
            files = []
            for path in self.slot_dir.glob("auto-*.json"):  # a save writes its sidecar, whole or in blocks
                with contextlib.suppress(FileNotFoundError):  # pruned meanwhile
                    files.append((path.name, path.stat().st_mtime_ns))
            return stats.get("requests"), auto.get("saves"), auto.get("prunes"), sorted(files)

        deadline = time.monotonic() + SETTLE_DEADLINE_S
        last, since = picture(), time.monotonic()
        while time.monotonic() - since < SETTLED_S:
            if time.monotonic() > deadline:
                self.problems.append(f"the server was still working {SETTLE_DEADLINE_S:.0f} s after the clients "
                                     "stopped (answering, saving or pruning)")
                return
            time.sleep(0.25)
            now = picture()
            if now != last:
                last, since = now, time.monotonic()

    def returns(self) -> dict[str, Any]:
        """Every parked conversation returns twice, one at a time: from what the faults left
        (from its state, whichever file it had), then in a quiet round (re-reading nothing)."""
        settling = time.monotonic()
        self.settle()
        parked = self.parked()
        found: dict[str, Any] = {"parked": len(parked), "conversations": len(self.conversations),
                                 "settled_s": round(time.monotonic() - settling, 1), "first": [], "quiet": []}
        for phase in ("first", "quiet"):
            for conversation in parked:
                record = self.turn(conversation, False, "read_all", phase=phase)
                found[phase].append({"name": conversation.name, "api": conversation.api, "status": record.status,
                                     "state": record.state, "held_before": record.held_before,
                                     "reused": record.reused, "read": record.read, "outcome": record.outcome,
                                     "had_file": record.had_file})
        return found

    def run(self) -> dict[str, Any]:
        self.slot_dir.mkdir(parents=True, exist_ok=True)
        with tmpfs(self.slot_dir, f"{self.plan.tmpfs_mib}m"):
            self.start_server()
            try:
                return self._run()
            finally:
                assert self.server is not None
                self.server.stop()

    def _run(self) -> dict[str, Any]:
        for n in range(self.plan.conversations):
            self.free.put(self.new_conversation(CONVERSATION_APIS[n % len(CONVERSATION_APIS)]))
        self.began = time.monotonic()
        self.sample()
        threads = [threading.Thread(target=self.client, args=(self.plan.seed * 100 + n,), daemon=True)
                   for n in range(self.plan.clients)]
        threads += [threading.Thread(target=self.faults_loop, daemon=True),
                    threading.Thread(target=self.sampler, daemon=True),
                    threading.Thread(target=self.health_poller, daemon=True)]
        for thread in threads:
            thread.start()
        self.stop.wait(self.plan.seconds)
        self.stop.set()
        for thread in threads:
            thread.join(DEADLINE_S + 60)
            if thread.is_alive():
                self.problems.append(f"a thread ({thread.name}) was still running {DEADLINE_S + 60:.0f} s "
                                     "after the end: a hang")
        faults_over = time.monotonic()
        self.sample()
        returns = self.returns()
        self.sample()
        assert self.server is not None
        stats = self.server.stats()
        self.stop_server("the end")
        return {
            "plan": asdict(self.plan), "limits": asdict(Limits()),
            "began": self.began, "faults_over": faults_over, "ended": time.monotonic(),
            "records": [asdict(r) for r in self.records], "faults": [asdict(f) for f in self.faults],
            "samples": [asdict(s) for s in self.samples], "returns": returns, "problems": self.problems,
            "stats": stats, "load_average": os.getloadavg(),
            "health": [asdict(h) for h in self.health], "stops": self.stops,
        }


# -- the verdict --------------------------------------------------------------------------------

EXPLAINING = ("kill", "restart")


def explained(record: dict[str, Any], faults: list[dict[str, Any]], kinds: tuple[str, ...] = EXPLAINING) -> bool:
    """Was a fault of ``kinds`` under way (give or take :data:`FAULT_MARGIN_S`) while the request ran?"""
    return any(f["kind"] in kinds and record["began"] <= (f["ended"] or f["began"]) + FAULT_MARGIN_S
               and record["ended"] >= f["began"] - FAULT_MARGIN_S for f in faults)


def thirds(samples: list[dict[str, Any]], began: float, ended: float) -> tuple[list[dict], list[dict]]:
    """The samples of the first and last thirds of the faulted run of the process that ran
    last (the restart starts a new one, a sixth of the way in): from its first sample on."""
    during = [s for s in samples if began <= s["at"] <= ended]
    if not during:
        return [], []
    pid = during[-1]["pid"]
    mine = [s for s in during if s["pid"] == pid]
    third = (mine[-1]["at"] - mine[0]["at"]) / 3
    return ([s for s in mine if s["at"] <= mine[0]["at"] + third],
            [s for s in mine if s["at"] >= mine[-1]["at"] - third])


def first_seen(samples: list[dict[str, Any]], name: str, until: dict[str, Any]) -> float:
    """When temporary ``name`` was first seen in the samples up to ``until``, in a row."""
    seen = until["at"]
    for sample in reversed([s for s in samples if s["at"] <= until["at"]]):
        if name not in (sample.get("temporary_names") or ()):
            break
        seen = sample["at"]
    return seen


def clean_window(fault: dict[str, Any], faults: list[dict[str, Any]]) -> tuple[float, float]:
    """A fault's window up to the first restart begun inside it (a hung tier ends with one)."""
    end = fault["ended"] or fault["began"]
    for other in faults:
        if other["kind"] == "restart" and fault["began"] < other["began"] < end:
            end = other["began"]
    return fault["began"], end


def judge(found: dict[str, Any], limits: Limits = Limits()) -> list[str]:
    """Everything the soak requires that did not hold (empty: it passed)."""
    failures = list(found.get("problems") or [])
    faults = found["faults"]
    for record in found["records"]:
        what = f"{record['api']} {'stream' if record['stream'] else 'plain'} {record['pattern']} at " \
               f"{record['began'] - found['began']:.0f} s"
        took = record["ended"] - record["began"]
        if took > DEADLINE_S:
            failures.append(f"{what}: took {took:.0f} s, past the {DEADLINE_S:.0f} s deadline")
        elif record["status"] == 500:
            failures.append(f"{what}: HTTP 500: {record['detail']}")
        elif record["outcome"] == "violation":
            failures.append(f"{what}: {record['detail']}")
        elif record["outcome"] == "failed_in_shape" and (record["phase"] != "faults" or not explained(record, faults)):
            failures.append(f"{what}: failed with no kill or restart under way: {record['detail']}")
        elif record["outcome"] == "unreachable" and not explained(record, faults, ("restart",)):
            failures.append(f"{what}: {record['detail']} while strata-serve was not being restarted")
    returns = found["returns"]
    if returns["parked"] < 2:
        failures.append(f"only {returns['parked']} conversation(s) parked at the end: the returns show nothing")
    for phase in ("first", "quiet"):
        for back in returns[phase]:
            name = f"{phase} return of {back['name']}"
            if back["status"] != 200:
                failures.append(f"{name}: HTTP {back['status']} ({back['outcome']})")
            elif back["state"] not in ("disk", "slot"):
                why = "its parked state was lost" if back.get("had_file", True) else \
                    "its file, listed once the server had settled, was gone when it was sent"
                failures.append(f"{name}: X-Strata-State {back['state']!r}: {why}")
            elif phase == "quiet" and (back["reused"] is None
                                       or back["held_before"] - back["reused"] > limits.quiet_reread):
                failures.append(f"{name}: re-read {back['held_before'] - (back['reused'] or 0)} of the "
                                f"{back['held_before']} tokens it held (at most {limits.quiet_reread})")
    plan = found["plan"]
    # With a shared tier, each upload under way holds a snapshot (a file and its sidecar).
    allowed_temporaries = limits.temporaries + (limits.upload_temporaries * (plan.get("conversations", 0) + 1)
                                                if plan.get("hung_tier") else 0)
    for fault in faults:
        if fault["kind"] in ("hung_tier", "slow_reader") and fault["ended"]:
            if fault["kind"] == "slow_reader" and not (fault.get("detail") or {}).get("generation_over", True):
                continue  # the engine was still making the answers: the hold did not begin clear of them
            began, ended = clean_window(fault, faults)
            if ended - began < 1.0:
                continue  # not held (the run ended first): nothing to judge
            others = [r for r in found["records"] if r.get("role", "client") == "client"
                      and r["outcome"] == "answered" and began <= r["ended"] <= ended]
            if not others:
                failures.append(f"{fault['kind']} at {began - found['began']:.0f} s: no other client's request was "
                                f"answered in its {ended - began:.0f} s")
    for stop in found.get("stops") or []:
        if stop["killed"]:
            failures.append(f"the stop at {stop['at'] - found['began']:.0f} s ({stop['why']}"
                            f"{', the tier hung' if stop.get('tier_hung') else ''}) had not ended "
                            f"{STOP_DEADLINE_S:.0f} s after SIGTERM: killed")
    for before, sample in zip(found["samples"], found["samples"][1:]):
        left = set(before.get("temporary_names") or ()) & set(sample.get("temporary_names") or ())
        if plan.get("hung_tier"):  # an upload's snapshot lives as long as its bounded calls
            left = {name for name in left if sample["at"] - first_seen(found["samples"], name, sample) >= TIER_TEMPORARY_S}
        if left:
            failures.append(f"at {sample['at'] - found['began']:.0f} s: temporaries left in the slot directory "
                            f"since the sample before: {sorted(left)}")
    for sample in found["samples"]:
        at = f"at {sample['at'] - found['began']:.0f} s"
        if sample["session_files"] > plan["keep"] + limits.extra_files:
            failures.append(f"{at}: {sample['session_files']} session files, past keep = {plan['keep']} "
                            f"(+{limits.extra_files})")
        if sample["temporaries"] > allowed_temporaries:
            failures.append(f"{at}: {sample['temporaries']} temporaries in the slot directory, more than one save's"
                            + (" and one upload's per conversation" if plan.get("hung_tier") else ""))
    first, last = thirds(found["samples"], found["began"], found["faults_over"])
    if not first or not last:
        failures.append("too few samples of one process to compare the first and last thirds")
    else:
        growth = statistics.median(s["rss_mib"] for s in last) - statistics.median(s["rss_mib"] for s in first)
        if growth > limits.rss_growth_mib:
            failures.append(f"resident memory grew {growth:.1f} MiB from the first third to the last "
                            f"(at most {limits.rss_growth_mib:g})")
        fds = max(s["fds"] for s in last) - max(s["fds"] for s in first)
        if fds > limits.fd_growth:
            failures.append(f"open files grew by {fds} from the first third to the last (at most {limits.fd_growth})")
    return failures


# -- the report ---------------------------------------------------------------------------------

def rows(found: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per sample: the process's figures then, and what happened since the last one."""
    out = []
    previous = found["began"]
    records, faults = found["records"], found["faults"]
    for sample in found["samples"]:
        window = [r for r in records if previous < r["ended"] <= sample["at"]]
        returns = [r for r in window if r["outcome"] == "answered" and r["held_before"] and r["reused"] is not None]
        happened = [f["kind"] for f in faults if previous < f["began"] <= sample["at"]]
        out.append({
            "t": sample["at"] - found["began"], "rss": sample["rss_mib"], "fds": sample["fds"],
            "files": sample["session_files"], "mb": sample["disk_bytes"] / 1e6,
            "answered": sum(r["outcome"] == "answered" for r in window),
            "closed": sum(r["outcome"] == "closed" for r in window),
            "failed": sum(r["outcome"] in ("failed_in_shape", "unreachable") for r in window),
            "returns": len(returns), "reread": sum(max(0, r["held_before"] - r["reused"]) for r in returns),
            "reread_filed": sum(max(0, r["held_before"] - r["reused"]) for r in returns if r.get("had_file")),
            "states": _states(returns),
            "faults": ", ".join(f"{happened.count(k)} {k}" for k in FAULT_NAMES if happened.count(k)),
            "saves": (sample["stats"] or {}).get("saves"), "prunes": (sample["stats"] or {}).get("prunes"),
        })
        previous = sample["at"]
    return out


FAULT_NAMES = {"kill": "engine killed", "stop": "engine frozen", "disk_full": "slot directory full",
               "restart": "strata-serve restarted", "hung_tier": "shared tier hung", "slow_reader": "slow readers"}


def each_fault(found: dict[str, Any]) -> list[dict[str, Any]]:
    """Per kind of fault (and the time under none): the other clients' requests that began
    while it lasted, their outcomes and latencies, the ``/health`` answers, and what the
    fault itself saw."""
    faults, records = found["faults"], [r for r in found["records"] if r.get("role", "client") == "client"]
    health = found.get("health") or []
    spans = [(f["began"], f["ended"] or f["began"]) for f in faults]

    def under(t: float, windows: list[tuple[float, float]]) -> bool:
        return any(a <= t <= b for a, b in windows)

    out = []
    for kind in [*FAULT_NAMES, None]:
        if kind is None:
            windows = []
            during = [r for r in records if r["phase"] == "faults" and not any(
                r["began"] <= b and r["ended"] >= a for a, b in spans)]
            asked = [h for h in health if not under(h["at"], spans)]
            seconds = (found["faults_over"] - found["began"]) - sum(b - a for a, b in spans)
        else:
            made = [f for f in faults if f["kind"] == kind]
            if not made:
                continue
            windows = [clean_window(f, faults) for f in made]
            during = [r for r in records if under(r["began"], windows)]
            asked = [h for h in health if under(h["at"], windows)]
            seconds = sum(b - a for a, b in windows)
        answered = [r["ended"] - r["began"] for r in during if r["outcome"] == "answered"]
        statuses: dict[str, int] = {}
        for h in asked:
            label = str(h["status"]) if h["status"] is not None else "none"
            statuses[label] = statuses.get(label, 0) + 1
        out.append({
            "kind": kind, "made": len(windows), "seconds": max(seconds, 0.0), "requests": len(during),
            "answered": len(answered), "failed": sum(r["outcome"] in ("failed_in_shape", "unreachable", "violation")
                                                     for r in during),
            "median_s": statistics.median(answered) if answered else None, "max_s": max(answered, default=None),
            "health": statuses, "health_max_s": max((h["took"] for h in asked), default=None),
            "saw": [] if kind is None else [_saw(f) for f in faults if f["kind"] == kind and _saw(f)],
        })
    return out


def _saw(fault: dict[str, Any]) -> str:
    """What one fault saw itself, in words."""
    detail = fault.get("detail") or {}
    if fault["kind"] == "restart" and detail:
        return f"stop {detail['took_s']:.1f} s" + (" (killed)" if detail["killed"] else "") \
            + (" with the tier hung" if detail.get("tier_hung") else "")
    if fault["kind"] == "hung_tier" and detail:
        turn = detail.get("turn")
        if turn is None:
            return "its conversation's turn: not sent"
        return (f"its conversation's turn: {turn['outcome']}" + (f" (HTTP {turn['status']})" if turn["status"] else "")
                + f" in {turn['took_s']:.1f} s" + (f", state {turn['state']}" if turn.get("state") else ""))
    if fault["kind"] == "slow_reader" and detail:
        parts = []
        if "generated_s" in detail:
            parts.append(f"both answers made {detail['generated_s']:.0f} s after they were sent"
                         if detail.get("generation_over") else
                         f"the answers not made within {GENERATION_CAP_S:.0f} s: held all the same")
        if "stream_headers_s" in detail:
            parts.append(f"stream headers after {detail['stream_headers_s']:.1f} s")
        elif "stream_headers" in detail:
            parts.append(f"stream: {detail['stream_headers']}")
        for name in ("stream", "plain"):
            got = detail.get(name)
            if got:
                parts.append(f"{name}: {got['bytes'] / 1e6:.2f} MB read afterwards, "
                             f"{'whole' if got['whole'] else 'cut'} ({got['ended_by']})")
        return "; ".join(parts)
    return ""


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _states(returns: list[dict[str, Any]]) -> str:
    seen: dict[str, int] = {}
    for r in returns:
        seen[r["state"] or "?"] = seen.get(r["state"] or "?", 0) + 1
    return " ".join(f"{k} {v}" for k, v in sorted(seen.items()))


def report(found: dict[str, Any], failures: list[str], command: str) -> str:
    plan, limits = found["plan"], found["limits"]
    records = found["records"]
    minutes = (found["faults_over"] - found["began"]) / 60
    by_outcome: dict[str, int] = {}
    for r in records:
        by_outcome[r["outcome"]] = by_outcome.get(r["outcome"], 0) + 1
    by_api = {api: sum(r["api"] == api for r in records) for api in PATHS}
    kinds = [f["kind"] for f in found["faults"]]
    answered_per_minute = sum(r["outcome"] == "answered" and r["phase"] == "faults" for r in records) / max(minutes,
                                                                                                          1e-9)
    lines = [
        f"# Soak: {plan['minutes']:g} minutes under faults",
        "",
        f"Made by `{command}` on {datetime.date.today().isoformat()}; machine: {machine()}; shared with other "
        f"work: load average (1, 5, 15 min) at the end {', '.join(f'{x:.1f}' for x in found['load_average'])}.",
        f"`strata-serve run` (its own process), the real llama-server, the tiny demo model, context {plan['ctx']:,}, "
        f"one slot, RAM cache off, auto-sessions with `min_tokens = {plan['min_tokens']}`, `keep = {plan['keep']}`"
        + (", a shared directory tier (its defaults: `timeout_s = 5`)" if plan.get("hung_tier") else "")
        + f"; the slot directory a {plan['tmpfs_mib']} MiB tmpfs.",
        "",
        f"{plan['clients']} clients at once over {plan['conversations']} conversations at a time (chat completions, "
        f"Responses, Anthropic messages, in turn; {plan['opening']:,}-token openings growing {plan['grow']} tokens a "
        f"turn, a conversation past {plan['longest']:,} tokens left for a new one) and side requests "
        f"(`/v1/completions`, {plan['side_share']:.0%} of steps); streamed or not; clients that read everything, "
        "close right after the last event, close after two events, or close before the first byte. Every "
        f"{plan['fault_every_s']:g} s, in turn, a cycle of: the engine killed (SIGKILL), the slot directory filled "
        f"to its last byte and emptied again, the engine frozen (SIGSTOP) for {plan['stop_s']:g} s"
        + (f"; or the shared tier hung for {min(plan['hang_s'], 0.6 * plan['fault_every_s']):g} s (one "
           "conversation's head replaced by a FIFO, which blocks whoever opens it, as a hung NFS mount does, and "
           "that conversation's next turn sent; then the FIFO's waiting readers let go, and the head put back)"
           if plan.get("hung_tier") else "")
        + (f"; or two slow readers held on for {min(plan['slow_s'], 0.6 * plan['fault_every_s']):g} s (answers of "
           f"{plan['slow_tokens']:,} tokens with 20 candidates' logprobs, a receive buffer of 4 KiB: a stream whose "
           "client read its headers, a plain answer whose client read nothing; then what was left read)"
           if plan.get("slow_reader") else "")
        + ". Once, strata-serve stopped (SIGTERM) and started again on the same directory"
        + (", during the first hung tier" if plan.get("hung_tier") else ", a sixth of the way in") + ".",
        "",
        f"The faults ran {minutes:.1f} minutes (the last requests included); {answered_per_minute:.0f} requests "
        "answered a minute on this machine, whose load says how much of it the soak had. "
        f"Faults made: {kinds.count('kill')} kills, {kinds.count('stop')} freezes, {kinds.count('disk_full')} disk "
        f"fills, {kinds.count('hung_tier')} hung tiers, {kinds.count('slow_reader')} slow-reader pairs, "
        f"{kinds.count('restart')} restart. Requests: {len(records):,} ("
        + ", ".join(f"{api} {n:,}" for api, n in by_api.items()) + "); "
        + ", ".join(f"{k.replace('_', ' ')} {v:,}" for k, v in sorted(by_outcome.items())) + ".",
        "",
        "## Over time",
        "",
        "Each row: strata-serve's resident memory and open files (`/proc/PID`) at that moment, the session files "
        "(parked conversations: their sidecars, `auto-*.json`) and bytes in the slot directory (the ballast not counted), and since the row before: "
        "requests answered, closed by their client on purpose, failed (502/503 or a stream's error event during a "
        "kill or the restart; refused while strata-serve was down), answered returns (a conversation's turn "
        "after an answered one), the tokens they re-read (what the engine held at the conversation's previous "
        "turn minus what it reused: the engine's `timings`, or the API's `usage`; in brackets, those of returns "
        "whose file was on disk when they were sent; the others' had been lost to a fault or pruned, or never "
        "made), where their state came from "
        "(`X-Strata-State`: a stream's leaves before the answer, so it says `engine` there), the faults made, and "
        "auto-sessions' saves and prunes so far (`/stats`, per process).",
        "",
        "| s | RSS MiB | open files | session files | MB on disk | answered | closed | failed | returns "
        "| re-read tokens (with a file) | state of returns | faults | saves | prunes |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows(found):
        lines.append(f"| {row['t']:.0f} | {row['rss']:.1f} | {row['fds']} | {row['files']} | {row['mb']:.1f} "
                     f"| {row['answered']} | {row['closed']} | {row['failed']} | {row['returns']} "
                     f"| {row['reread']:,} ({row['reread_filed']:,}) "
                     f"| {row['states']} | {row['faults']} | {row['saves'] if row['saves'] is not None else '-'} "
                     f"| {row['prunes'] if row['prunes'] is not None else '-'} |")
    returns = found["returns"]
    first_states = _states([{"state": b["state"]} for b in returns["first"]])
    quiet_reread = [max(0, b["held_before"] - (b["reused"] or 0)) for b in returns["quiet"]]
    first, last = thirds(found["samples"], found["began"], found["faults_over"])
    flat = ""
    if first and last:
        flat = (f"Resident memory, median of the first third {statistics.median(s['rss_mib'] for s in first):.1f} "
                f"MiB, of the last {statistics.median(s['rss_mib'] for s in last):.1f} MiB (growth allowed: "
                f"{limits['rss_growth_mib']:g} MiB); open files, most in the first third "
                f"{max(s['fds'] for s in first)}, in the last {max(s['fds'] for s in last)} (growth allowed: "
                f"{limits['fd_growth']}); both of the process that ran last. ")
    most_files = max((s["session_files"] for s in found["samples"]), default=0)
    lines += [
        "",
        "## Each fault",
        "",
        "Per kind of fault, over the time it lasted (a kill: until strata-serve said healthy again; a hung tier: "
        "from the FIFO to the stop that ends it, or to the head put back; slow readers: while they held on unread, "
        "once the engine had made both their answers): the other clients' "
        "requests that began then (the hung conversation's own turn and the slow readers not counted), how many "
        "were answered and failed, the latency of those answered (sent to last byte read; a client that closes "
        "early is not counted), the `/health` answers (asked every "
        f"{HEALTH_EVERY_S:g} s; `none`: no answer), and what the fault itself saw.",
        "",
        "| fault | made | s under it | requests | answered | failed | answered in, median / max s "
        "| /health answers (slowest s) | the fault itself |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in each_fault(found):
        health = ", ".join(f"{k} x{v}" for k, v in sorted(row["health"].items())) or "-"
        lines.append(f"| {FAULT_NAMES[row['kind']] if row['kind'] else 'none (between faults)'} | {row['made'] or '-'} "
                     f"| {row['seconds']:.0f} | {row['requests']} | {row['answered']} | {row['failed']} "
                     f"| {_seconds(row['median_s'])} / {_seconds(row['max_s'])} "
                     f"| {health} ({_seconds(row['health_max_s'])}) | {'; '.join(row['saw']) or '-'} |")
    stops = found.get("stops") or []
    if stops:
        lines += ["", "Stops (SIGTERM to the process's exit; SIGKILL past "
                  f"{STOP_DEADLINE_S:g} s): " + "; ".join(
                      f"{stop['why']} at {stop['at'] - found['began']:.0f} s: {stop['took_s']:.1f} s"
                      + (" (killed)" if stop["killed"] else "") + (", the tier hung" if stop.get("tier_hung") else "")
                      for stop in stops) + "."]
    lines += [
        "",
        "## Once the faults stopped",
        "",
        f"Once the server had settled (nothing answered, saved or pruned for {SETTLED_S:g} s; "
        f"{returns.get('settled_s', 0):g} s after the clients stopped), {returns['parked']} of the {returns['conversations']} conversations had a "
        "file on disk (the others were "
        f"pruned, `keep = {plan['keep']}`, or never saved under a fault). Each came back, one at a time: first "
        f"from what the faults left ({first_states or 'none'}), then in a quiet round, which re-read "
        f"{max(quiet_reread, default=0)} tokens at most of what a conversation held (allowed: "
        f"{limits['quiet_reread']}).",
        "",
        flat + f"Session files on disk: {most_files} at most (allowed: keep + {limits['extra_files']}).",
        "",
        "## Verdict",
        "",
    ]
    lines += ["Passed: every request answered or failed in its API's shape with a fault to explain it; no 500, "
              "no hang; other clients answered while the tier hung and while slow readers held on; every stop "
              "ended; every parked conversation returned from its state; resources flat."] if not failures else \
        ["**Failed**:", "", *[f"- {f}" for f in failures[:50]]]
    if len(failures) > 50:
        lines.append(f"- ... and {len(failures) - 50} more")
    return "\n".join(lines) + "\n"


def main(plan: Plan, out: Path, command: str) -> int:
    """Run the soak, write ``soak.md`` (and ``soak.json``, ``soak-strata.log``) into ``out``; the exit code."""
    if os.geteuid() != 0:
        print("[strata] the soak mounts a tmpfs for the slot directory: run it as root", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    print(f"[strata] soak: {plan.minutes:g} minutes, faults every {plan.fault_every_s:g} s", flush=True)
    with tempfile.TemporaryDirectory(prefix="strata-soak-") as tmp:
        try:
            found = Soak(plan, Path(tmp)).run()
        finally:
            log = Path(tmp) / "strata.log"
            if log.exists():
                (out / "soak-strata.log").write_bytes(log.read_bytes())
    failures = judge(found)
    (out / "soak.json").write_text(json.dumps(found, indent=1))
    (out / "soak.md").write_text(report(found, failures, command))
    print((out / "soak.md").read_text(), flush=True)
    return 1 if failures else 0


def cli() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=Plan.minutes)
    parser.add_argument("--fault-every", type=float, default=Plan.fault_every_s, help="seconds between faults")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    if not 0 < args.minutes <= 30:
        parser.error("--minutes: more than 0, at most 30")
    command = "make soak" + (f" SOAK_MINUTES={args.minutes:g}" if args.minutes != Plan.minutes else "")
    sys.exit(main(Plan(minutes=args.minutes, fault_every_s=args.fault_every), args.out, command))


if __name__ == "__main__":
    cli()
