"""The real Claude Code, Codex and Aider CLIs against strata-serve, end to end.

``make test`` installs Claude Code and Codex from npm at pinned versions into ``.node/``,
and Aider from PyPI into a virtual environment of its own, ``.aider/`` (``make clients``).
Each CLI runs two sessions that open the same way (one prompt, one working directory),
taking turns: A, B, then A resumed, then B resumed. Every resumed turn is a switch, so
auto-sessions parks the other session and restores this one from its file (the engine's
RAM cache is off): the engine then reuses all but the few hundred tokens the client
changed at the end of its prompt. The two sessions are told apart by the clients' own ids
(``X-Claude-Code-Session-Id``; Codex's ``session-id`` and ``prompt_cache_key``), never by
their identical openings.

The model is the tiny random-weight demo model at a context that holds what these
clients send (Claude Code's first request is about 17,000 tokens on it, Codex's 20,200):
its answers are garbage, the clients must still finish. The test's plugin ends every
answer early (a random model never ends by itself; Claude Code asks for 32,000 tokens,
Codex for no limit); the prompts go as sent. The clients get a private HOME, a private
CODEX_HOME, the server's address, and the settings that keep them off the network (no
update check, telemetry or error reports); every process has a deadline.

Aider sends no id at all, and every Aider session opens with the same system prompt and
the same worked example: two sessions get one key, and auto-sessions tells them apart as
two conversations of that key (siblings), each resumed (``--restore-chat-history``) from
its own file.

A second part serves a context too small for them, as ``make serve``'s SmolLM2 has, and
checks what the user sees: the refusal in the API's own shape, naming the context, the
request's size and how to serve a bigger one.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

import strata_serve
from strata_serve.api import SERVICE
from strata_serve.config import EngineSettings

ROOT = Path(__file__).resolve().parent.parent
NODE_BIN = ROOT / ".node" / "node_modules" / ".bin"
AIDER = ROOT / ".aider" / "bin" / "aider"
#: Holds either client's whole request on the demo model (one token per character).
CTX_SIZE = 65536
#: Each answer's length (the test's plugin sets it): the clients ask for up to 32,000.
ANSWER_TOKENS = 16
#: Deadline of one CLI run (a first turn prefills about 40,000 tokens on a shared machine).
CLI_TIMEOUT_S = 300
#: A resumed turn reuses its own state when it re-reads at most this many tokens: the
#: clients change the end of their prompt between turns (Claude Code moves a system
#: block after the new turn), so the last few hundred tokens are new anyway.
RESUME_SLACK = 1000
#: Auto-sessions' blocks, in tokens: a restore by tokens brings back whole blocks.
BLOCK_TOKENS = 64
PROMPT = "What does calc.py do?"
#: Two sessions taking turns: each resumed turn follows the other session's.
SESSIONS = [("A", "a"), ("B", "b"), ("A resumed", "a"), ("B resumed", "b")]
STOP_LETTERS = [chr(c) for c in [*range(ord("a"), ord("z") + 1), *range(ord("A"), ord("Z") + 1)]]


@dataclass
class Seen:
    """One request as strata-serve handled it."""

    route: str
    key: str | None
    client_id: str | None
    restored: int
    http_status: int | None
    status: str
    prompt_tokens: int | None
    reused: int | None
    at: float
    #: A chat request's messages, as the client sent them.
    messages: list[Any] | None = None
    #: An Anthropic or Responses request's body, as the engine was sent it.
    body: dict[str, Any] | None = None


class RequestLog:
    """A plugin writing down each request's key, the client's own id and what the engine reused."""

    strata_name = "cli_request_log"

    def __init__(self) -> None:
        self.seen: list[Seen] = []

    @strata_serve.hookimpl
    def pre_request(self, request: strata_serve.StrataRequest) -> None:
        # A random model never ends by itself (the clients ask for 32,000 tokens, Codex
        # for no limit); the prompt is left as sent. Codex takes an answer cut at
        # ANSWER_TOKENS. Claude Code takes a cut answer for one past its limit and asks
        # again, so its answers end at a stop sequence: any letter, which the demo model
        # writes several times in 16 characters (when it writes one first, the answer is
        # empty, and Claude Code sends the request once more: its own behaviour).
        if request.route == "responses":
            request.body["max_output_tokens"] = ANSWER_TOKENS
        elif request.route == "chat":  # Aider asks for no limit
            request.body["max_tokens"] = ANSWER_TOKENS
        elif request.route == "messages":
            request.body["stop_sequences"] = STOP_LETTERS
            request.body["max_tokens"] = min(request.body.get("max_tokens") or 4 * ANSWER_TOKENS, 4 * ANSWER_TOKENS)

    @strata_serve.hookimpl
    def post_request(self, request: strata_serve.StrataRequest, outcome: strata_serve.Outcome) -> None:
        headers = request.headers
        client_id = headers.get("X-Claude-Code-Session-Id") or headers.get("session-id") or headers.get("session_id")
        timings = outcome.timings
        self.seen.append(Seen(
            route=request.route, key=request.conversation_key, client_id=client_id,
            restored=request.restored_tokens, http_status=outcome.http_status, status=outcome.status,
            prompt_tokens=timings.prompt_tokens if timings else None, reused=timings.reused if timings else None,
            at=time.monotonic(), messages=request.body.get("messages") if request.route == "chat" else None,
            body=request.body if request.route in ("messages", "responses") else None,
        ))


def client_binary(name: str) -> Path:
    path = NODE_BIN / name
    if not os.access(path, os.X_OK):
        pytest.fail(f"{path} is missing: `make test` installs Claude Code and Codex CLI there with npm "
                    "(`make clients` alone does that)")
    return path


@dataclass
class Run:
    returncode: int
    stdout: str
    stderr: str
    seconds: float


async def run_cli(argv: list[str], *, cwd: Path, env: dict[str, str], timeout: float = CLI_TIMEOUT_S) -> Run:
    """Run a CLI to its end within ``timeout`` seconds (its whole process group is killed past it)."""
    start = time.monotonic()
    proc = await asyncio.create_subprocess_exec(
        *argv, cwd=cwd, env=env, stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, start_new_session=True,
    )
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout)
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        out, err = await proc.communicate()
        pytest.fail(f"{argv[0]} did not finish within {timeout:g} s\nstdout: {out.decode()[-2000:]}\n"
                    f"stderr: {err.decode()[-2000:]}")
    finally:
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
    return Run(proc.returncode, out.decode(errors="replace"), err.decode(errors="replace"), time.monotonic() - start)


def base_env(home: Path) -> dict[str, str]:
    """A clean environment: a private HOME, nothing of the developer's own set-up."""
    return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home), "LANG": "C.UTF-8",
            "TERM": "dumb", "NO_COLOR": "1"}


def claude_env(home: Path, url: str) -> dict[str, str]:
    return {
        **base_env(home),
        "ANTHROPIC_BASE_URL": url,
        "ANTHROPIC_API_KEY": "sk-local",
        "ANTHROPIC_MODEL": "local",
        # Off the network: no update check, telemetry or error reports. The umbrella
        # CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC is left unset, as a user would.
        "DISABLE_AUTOUPDATER": "1",
        "DISABLE_TELEMETRY": "1",
        "DISABLE_ERROR_REPORTING": "1",
        "DISABLE_BUG_COMMAND": "1",
        "CLAUDE_CODE_DISABLE_FEEDBACK_SURVEY": "1",
    }


def codex_config(url: str, context_window: int) -> str:
    return (
        'model = "local"\n'
        'model_provider = "strata"\n'
        f"model_context_window = {context_window}\n"
        "check_for_update_on_startup = false\n"
        "[analytics]\n"
        "enabled = false\n"
        "[model_providers.strata]\n"
        'name = "strata-serve"\n'
        f'base_url = "{url}/v1"\n'
        'wire_api = "responses"\n'
        "request_max_retries = 0\n"
        "stream_max_retries = 0\n"
    )


def codex_env(home: Path, codex_home: Path) -> dict[str, str]:
    return {**base_env(home), "CODEX_HOME": str(codex_home)}


def claude_argv(*extra: str) -> list[str]:
    return [str(client_binary("claude")), "-p", *extra, "--output-format", "json"]


def codex_argv(*extra: str) -> list[str]:
    return [str(client_binary("codex")), "exec", "--skip-git-repo-check", "--json", *extra]


def claude_result(run: Run) -> dict[str, Any]:
    result = json.loads(run.stdout.strip().splitlines()[-1])
    said = {k: result.get(k) for k in ("subtype", "terminal_reason", "is_error", "num_turns", "api_error_status",
                                        "stop_reason", "result", "permission_denials")}
    assert run.returncode == 0, f"claude exited {run.returncode}: {said}\nstderr: {run.stderr[-3000:]}"
    assert result.get("is_error") is False, result
    return result


def codex_thread(run: Run) -> str:
    assert run.returncode == 0, f"codex exited {run.returncode}\nstdout: {run.stdout[-3000:]}\nstderr: {run.stderr[-3000:]}"
    events = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    assert any(e.get("type") == "turn.completed" for e in events), events
    return next(e["thread_id"] for e in events if e.get("type") == "thread.started")


@pytest.fixture
def workspace(tmp_path: Path) -> dict[str, Path]:
    """A HOME, a CODEX_HOME and one project directory both sessions of a client work in."""
    home, codex_home, project = tmp_path / "home", tmp_path / "codex-home", tmp_path / "project"
    for path in (home, codex_home, project):
        path.mkdir()
    (project / "calc.py").write_text("def add(a, b):\n    return a + b\n")
    return {"home": home, "codex_home": codex_home, "project": project}


@pytest.fixture
def cli_server(strata_client_factory, strata_settings_factory):
    """strata-serve as ``strata-serve run`` has it (every installed plugin but the examples,
    the default engine: one slot, ``engine.side_slot_tokens`` = 0), on the demo model at
    ``ctx_size``, with the request log."""

    async def make(ctx_size: int) -> tuple[Any, RequestLog, str]:
        log = RequestLog()
        settings = strata_settings_factory(
            # The engine keeps to the context a model was trained for (the demo model's is
            # 4,096 tokens), so the model is said to be made for this one.
            engine={"ctx_size": ctx_size, "start_timeout_s": 120,
                    "side_slot_tokens": EngineSettings().side_slot_tokens,
                    "extra_args": ["--override-kv", f"llama.context_length=int:{ctx_size}"]},
            plugins={"auto_sessions": {"min_tokens": 100, "idle_save_s": 0}},
            disable_plugins=["prefix_key"],
        )
        client = await strata_client_factory(log, settings=settings, entrypoints=True)
        return client, log, str(client.make_url("")).rstrip("/")

    return make


def assert_resumed(turn: list[Seen], label: str) -> Seen:
    """The resumed turn's first request was restored from its own file and re-read only its end."""
    assert turn, f"{label}: no request reached the server"
    first = turn[0]
    assert first.restored > 0, f"{label}: nothing was restored: {first}"
    assert first.prompt_tokens is not None and first.reused is not None, first
    assert first.prompt_tokens - first.reused <= RESUME_SLACK, (
        f"{label}: re-read {first.prompt_tokens - first.reused:,} of {first.prompt_tokens:,} tokens: {first}")
    return first


def assert_keyed_by_id(ids: dict[str, str], keys: dict[str, set[str | None]]) -> None:
    """Two sessions that open alike have a key each, the same across a resume, from the client's id."""
    assert ids["a"] != ids["b"]
    assert len(keys["a"]) == 1 and len(keys["b"]) == 1, f"one key per session, constant across its resume: {keys}"
    assert keys["a"] != keys["b"], (
        f"two sessions that open alike got one key {keys['a']}: the key must come from the client's id")
    for session in ("a", "b"):
        (key,) = keys[session]
        assert key is not None and ids[session] in key, f"the key {key!r} is not the client's id {ids[session]}"


def report(label: str, run: Run, turn: list[Seen]) -> str:
    parts = [f"{s.prompt_tokens} tokens, reused {s.reused}, restored {s.restored}" for s in turn]
    return f"{label}: {run.seconds:.1f} s, {len(turn)} request(s): " + "; ".join(parts)


async def alternate_sessions(log, route: str, turn_of) -> None:
    """Sessions a, b, a resumed, b resumed (:data:`SESSIONS`): ``await turn_of(session, id)``
    runs one CLI turn (``id`` None for a new session) and returns ``(run, the client's id)``.
    Every answer 200 on ``route``, each session keyed by its own id, each resume restored."""
    ids: dict[str, str] = {}
    keys: dict[str, set[str | None]] = {"a": set(), "b": set()}
    lines: list[str] = []
    resumed: list[tuple[str, list[Seen]]] = []
    for label, session in SESSIONS:
        since = len(log.seen)
        resume = session in ids
        run, client_id = await turn_of(session, ids.get(session))
        turn = log.seen[since:]
        lines.append(report(label, run, turn))
        assert turn and all(s.http_status == 200 and s.status == "ok" for s in turn), turn
        assert {s.route for s in turn} == {route}, turn
        if resume:
            resumed.append((label, turn))
        ids.setdefault(session, client_id)
        assert client_id == ids[session], "a resumed session keeps its id"
        assert {s.client_id for s in turn} == {ids[session]}, turn
        keys[session] |= {s.key for s in turn}
    print("\n".join(lines))
    assert_keyed_by_id(ids, keys)
    for label, turn in resumed:
        assert_resumed(turn, label)


async def test_claude_code_two_sessions_resumed_in_turn_each_restore_their_own_state(cli_server, workspace):
    client, log, url = await cli_server(CTX_SIZE)
    env, cwd = claude_env(workspace["home"], url), workspace["project"]

    async def turn_of(session: str, session_id: str | None):
        resume = ["--resume", session_id] if session_id else []
        run = await run_cli(claude_argv(*resume, "And what else?" if resume else PROMPT), cwd=cwd, env=env)
        return run, claude_result(run)["session_id"]

    await alternate_sessions(log, "messages", turn_of)


async def test_codex_two_sessions_resumed_in_turn_each_restore_their_own_state(cli_server, workspace):
    client, log, url = await cli_server(CTX_SIZE)
    (workspace["codex_home"] / "config.toml").write_text(codex_config(url, CTX_SIZE))
    env, cwd = codex_env(workspace["home"], workspace["codex_home"]), workspace["project"]

    async def turn_of(session: str, thread_id: str | None):
        argv = codex_argv("resume", thread_id, "And what else?") if thread_id else codex_argv(PROMPT)
        run = await run_cli(argv, cwd=cwd, env=env)
        return run, codex_thread(run)

    await alternate_sessions(log, "responses", turn_of)


#: Each CLI's route and the engine path its requests go to.
CLI_ROUTES = {"claude": ("messages", "/v1/messages"), "codex": ("responses", "/v1/responses")}


async def new_cli_session(cli: str, prompt: str, workspace: dict[str, Path], url: str) -> str:
    """One turn of a new session of ``cli`` in the project; the client's id for it."""
    cwd = workspace["project"]
    if cli == "claude":
        run = await run_cli(claude_argv(prompt), cwd=cwd, env=claude_env(workspace["home"], url))
        return str(claude_result(run)["session_id"])
    run = await run_cli(codex_argv(prompt), cwd=cwd, env=codex_env(workspace["home"], workspace["codex_home"]))
    return codex_thread(run)


async def test_new_agent_sessions_after_the_other_agent_took_the_slot_start_from_their_opening(cli_server, workspace):
    """Claude Code's ``/v1/messages`` and Codex's ``/v1/responses`` are restored by their
    tokens. A session of each, then a new session of each in the same project (a new id, so
    a new key with nothing parked), each arriving while the other CLI holds the slot: each
    new session gets its CLI's opening back from the blocks the first session parked, what
    the two sessions share and no more."""
    client, log, url = await cli_server(CTX_SIZE)
    (workspace["codex_home"] / "config.toml").write_text(codex_config(url, CTX_SIZE))
    stats = client.app[SERVICE].state["auto_sessions"].stats
    engine = client.app[SERVICE].engine
    first: dict[str, tuple[str, Seen]] = {}
    for cli in CLI_ROUTES:
        at = len(log.seen)
        first[cli] = (await new_cli_session(cli, PROMPT, workspace, url), log.seen[at])
    for cli, other in (("claude", "codex"), ("codex", "claude")):
        route, path = CLI_ROUTES[cli]
        assert log.seen[-1].route == CLI_ROUTES[other][0] and log.seen[-1].key is not None, "the other CLI holds the slot"
        by_tokens, since, began = stats.restores_by_tokens, len(log.seen), time.monotonic()
        second = await new_cli_session(cli, "Which functions are in calc.py?", workspace, url)
        turn = log.seen[since:]
        print(f"a new {cli} session after {other}: {time.monotonic() - began:.1f} s, " + "; ".join(
            f"{s.prompt_tokens} tokens, reused {s.reused}, restored {s.restored}" for s in turn))
        assert second != first[cli][0], "a new session"
        assert turn and all(s.http_status == 200 and s.route == route for s in turn), turn
        assert stats.restores_by_tokens > by_tokens, f"{cli}: not restored by tokens"
        opening, parked = turn[0], first[cli][1]
        assert opening.restored > 0 and opening.reused is not None, opening
        # What the two sessions' first requests share, as the engine tokenizes them: they
        # part at the user's prompt, and all that follows it is new to the second session.
        a, b = [await engine.prompt_tokens(path, seen.body) for seen in (parked, opening)]
        assert a and b, f"the engine tokenizes {cli}'s requests"
        shared = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        assert shared >= 4000, f"{cli}: the sessions share {shared:,} tokens"
        whole_blocks = shared // BLOCK_TOKENS * BLOCK_TOKENS
        # Its blocks, not the first session's whole state (which a prefix restore would
        # bring, the part past the user's prompt then thrown away by the engine).
        assert whole_blocks <= opening.restored <= shared, (cli, shared, opening)
        assert opening.reused >= whole_blocks, (cli, shared, opening)


def aider_binary() -> Path:
    if not os.access(AIDER, os.X_OK):
        pytest.fail(f"{AIDER} is missing: `make test` installs Aider there with pip (`make clients` alone does that)")
    return AIDER


def aider_env(home: Path, url: str) -> dict[str, str]:
    return {
        **base_env(home),
        "OPENAI_API_BASE": f"{url}/v1",
        "OPENAI_API_KEY": "sk-local",
        # Off the network: litellm's model list is read from the package, not fetched.
        "LITELLM_LOCAL_MODEL_COST_MAP": "True",
    }


def aider_argv(question: str, *, resume: bool) -> list[str]:
    # No repository map (it needs git and tree-sitter) and no file added to the chat: Aider
    # puts the chat's files after the history, so a file in the chat would leave only the
    # opening reusable at any resume, whichever server is in front.
    return [str(aider_binary()), "--model", "openai/local", "--no-git", "--yes-always", "--no-check-update",
            "--analytics-disable", "--no-show-model-warnings", "--no-show-release-notes", "--no-pretty",
            "--no-fancy-input", "--map-tokens", "0", *(["--restore-chat-history"] if resume else []),
            "--message", question]


async def test_aider_sessions_share_one_key_keep_their_own_files_and_every_turn_reuses_the_opening(
        cli_server, tmp_path):
    """Two Aider sessions taking turns (A, B, A resumed, B resumed, each resumed with
    ``--restore-chat-history``), as sent by the real client.

    Aider sends no id, and every session opens with the same system prompt and worked
    example: one key. Aider puts the history before its message about the chat's files,
    so a resumed turn continues none of its session's earlier prompts: it shares the
    opening with every state parked under the key, and no more (shown here from the
    requests themselves). What strata-serve owes it: every turn after the first reuses
    the whole opening, and no session's state is saved over another's (each is a file of
    its own under the key, where one file a key was overwritten at every turn).
    """
    client, log, url = await cli_server(CTX_SIZE)
    home = tmp_path / "home"
    home.mkdir()
    questions = {"a": "What does calc.py do?", "b": "Which shapes does shapes.py draw?"}
    projects = {}
    for session in questions:
        projects[session] = tmp_path / f"project-{session}"
        projects[session].mkdir()
    lines, firsts = [], []
    for label, session in SESSIONS:
        since = len(log.seen)
        resume = label.endswith("resumed")
        run = await run_cli(aider_argv("And what else?" if resume else questions[session], resume=resume),
                            cwd=projects[session], env=aider_env(home, url))
        turn = log.seen[since:]
        lines.append(report(label, run, turn))
        assert run.returncode == 0, f"aider exited {run.returncode}\nstdout: {run.stdout[-3000:]}\nstderr: {run.stderr[-3000:]}"
        assert turn and all(s.http_status == 200 and s.status == "ok" and s.route == "chat" for s in turn), turn
        assert all(s.client_id is None for s in turn), "Aider sends no id of its own"
        firsts.append(turn[0])
    print("\n".join(lines))
    (key,) = {s.key for s in firsts}
    assert key is not None

    # The client's own layout: the messages every request shares, then each goes its way.
    prompts = [s.messages for s in firsts]
    assert all(prompts), firsts
    opening = 0
    while all(len(p) > opening and p[opening] == prompts[0][opening] for p in prompts):
        opening += 1
    assert opening >= 3 and prompts[0][0]["role"] == "system", prompts[0][:opening]
    for first, resumed in ((prompts[0], prompts[2]), (prompts[1], prompts[3])):
        assert resumed[opening] != first[opening], "a resumed Aider turn continues its first prompt"
    # The opening in tokens, as the engine reads it (the template's prompt for the next
    # turn, which the opening's own messages end before, is left out with the slack).
    rendered = await client.post("/apply-template", json={"messages": prompts[0][:opening]})
    assert rendered.status == 200, await rendered.text()
    tokens = await client.post("/tokenize", json={"content": (await rendered.json())["prompt"]})
    opening_tokens = len((await tokens.json())["tokens"])
    assert opening_tokens > 1000, opening_tokens
    for label, seen in zip([label for label, _ in SESSIONS][1:], firsts[1:]):
        assert seen.reused is not None and seen.reused >= opening_tokens - 16, (
            f"{label} reused {seen.reused} tokens, less than the {opening_tokens:,}-token opening: {seen}")

    # Each turn's state kept under the key, none saved over another's: A's first turn, B's
    # and A's second, each saved as the next came (B's second is still in the slot).
    store = client.app[SERVICE].state["auto_sessions"].store
    files = sorted(store.siblings(key), key=lambda sidecar: sidecar.sibling)
    assert [f.sibling for f in files] == [0, 1, 2], files
    for sidecar, seen in zip(files, firsts):
        assert 0 <= sidecar.tokens - seen.prompt_tokens <= ANSWER_TOKENS + 1, (sidecar, seen)


# A context too small for an agent: what the user sees.

#: ``make serve``'s context (SmolLM2's own is 8,192 tokens): the clients' first request is
#: several times longer.
SMALL_CTX = 8192


def assert_says_how_to_serve_more(message: str, ctx: int = SMALL_CTX) -> int:
    """The refusal names the context, the request's size and how to serve a bigger one;
    it returns the request's size as said."""
    found = re.search(r"the request \(([\d,]+) tokens\) exceeds the available context size \(([\d,]+) tokens", message)
    assert found, message
    asked, held = (int(group.replace(",", "")) for group in found.groups())
    assert held == ctx and asked > ctx, message
    assert re.search(r"make serve MODEL=\S+ CTX_SIZE=\d+", message) and "--ctx-size " in message, message
    needed = int(re.search(r"CTX_SIZE=(\d+)", message).group(1))
    assert needed > asked, message
    return asked


LONG_TEXT = " ".join(f"word{n}" for n in range(2500))  # about 17,000 tokens on the demo model


async def test_a_request_past_the_context_is_refused_in_each_apis_shape_saying_how_to_serve_more(cli_server):
    import anthropic
    import openai

    client, log, url = await cli_server(SMALL_CTX)
    claude = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0)
    oai = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    try:
        for stream in (False, True):
            with pytest.raises(anthropic.BadRequestError) as refused:
                await asyncio.to_thread(claude.messages.create, model="local", max_tokens=8, stream=stream,
                                        messages=[{"role": "user", "content": LONG_TEXT}])
            body = refused.value.body
            assert set(body) == {"type", "error"} and body["error"]["type"] == "invalid_request_error", body
            assert_says_how_to_serve_more(body["error"]["message"])

            with pytest.raises(openai.BadRequestError) as refused:
                await asyncio.to_thread(oai.responses.create, model="local", input=LONG_TEXT, stream=stream)
            error = refused.value.body
            assert {"message", "type", "param", "code"} <= set(error), error
            assert error["n_ctx"] == SMALL_CTX and error["n_prompt_tokens"] > SMALL_CTX, error
            assert_says_how_to_serve_more(error["message"])

            with pytest.raises(openai.BadRequestError) as refused:
                await asyncio.to_thread(oai.chat.completions.create, model="local", stream=stream,
                                        messages=[{"role": "user", "content": LONG_TEXT}])
            assert_says_how_to_serve_more(refused.value.body["message"])
    finally:
        claude.close()
        oai.close()
    assert log.seen and all(s.http_status == 400 for s in log.seen), log.seen
    # The refusal is the request's own: the server goes on answering what fits.
    answer = await client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8})
    assert answer.status == 200, await answer.text()


async def test_claude_code_on_a_context_too_small_shows_how_to_serve_more(cli_server, workspace):
    client, log, url = await cli_server(SMALL_CTX)
    run = await run_cli(claude_argv(PROMPT), cwd=workspace["project"], env=claude_env(workspace["home"], url))
    print(f"claude on a {SMALL_CTX}-token context: exit {run.returncode}, {run.seconds:.1f} s\n"
          f"stdout: {run.stdout[-1500:]}\nstderr: {run.stderr[-1500:]}")
    assert run.returncode != 0
    assert log.seen and all(s.http_status == 400 for s in log.seen), log.seen
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["is_error"] is True, result
    # Claude Code knows the engine's words for it, and says so before the message.
    assert result["result"].startswith("Prompt is too long"), result["result"]
    asked = assert_says_how_to_serve_more(result["result"])
    assert asked > 2 * SMALL_CTX, f"Claude Code's first request is {asked:,} tokens"


async def test_codex_on_a_context_too_small_shows_how_to_serve_more(cli_server, workspace):
    client, log, url = await cli_server(SMALL_CTX)
    (workspace["codex_home"] / "config.toml").write_text(codex_config(url, SMALL_CTX))
    run = await run_cli(codex_argv(PROMPT), cwd=workspace["project"],
                        env=codex_env(workspace["home"], workspace["codex_home"]))
    print(f"codex on a {SMALL_CTX}-token context: exit {run.returncode}, {run.seconds:.1f} s\n"
          f"stdout: {run.stdout[-1500:]}\nstderr: {run.stderr[-1500:]}")
    assert run.returncode != 0
    assert log.seen and all(s.http_status == 400 for s in log.seen), log.seen
    events = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    shown = [e.get("message") or e.get("error", {}).get("message") for e in events
             if e.get("type") in ("error", "turn.failed")]
    assert shown and any(m and "--ctx-size" in m for m in shown), events
    asked = assert_says_how_to_serve_more(next(m for m in shown if m and "--ctx-size" in m))
    assert asked > SMALL_CTX, asked


def test_the_refusal_names_the_slots_and_an_attached_engine():
    from strata_serve import ContextOverflow
    from strata_serve.api.relay import context_overflow
    from strata_serve.config import EngineSettings

    error = ContextOverflow(prompt_tokens=20000, context_tokens=4096)
    two_slots = context_overflow(error, "", EngineSettings(ctx_size=8192, parallel=2))
    assert "(4,096 tokens per slot, 2 slots)" in two_slots and "CTX_SIZE=65536" in two_slots, two_slots
    attached = context_overflow(error, "", EngineSettings(url="http://127.0.0.1:9000"))
    assert "restart the engine at http://127.0.0.1:9000" in attached and "-c 32768" in attached, attached
    capped = context_overflow(error, "", EngineSettings(ctx_size=65536))
    assert "(4,096 tokens, the model's own; --ctx-size asked for 65,536)" in capped, capped
    # Claude Code shows about 350 characters, "Prompt is too long · the provider said: " first:
    # the command to run is within them.
    for said in (two_slots, attached, capped, context_overflow(ContextOverflow(180_000, 131_072), "", None)):
        assert len("Prompt is too long · the provider said: " + said) <= 330, (len(said), said)
    unknown = context_overflow(ContextOverflow(), "too long", None)
    assert unknown.startswith("too long: serve a model with a larger context"), unknown
