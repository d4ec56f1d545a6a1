"""Several replicas behind HAProxy, as docs/several-servers.md sets them up: real
strata-serve processes, each with its own llama-server, on loopback (tests/replicas.py)."""

from __future__ import annotations

import json
import re
import subprocess
from collections import Counter
from pathlib import Path

import pytest

from strata_serve.testing import conversation
from tests.replicas import (
    HAPROXY_CONFIG,
    Answer,
    Replicas,
    after_a_failover,
    balancer_config,
    haproxy_binary,
    reread_in_full,
)

#: The clients' own session headers, in the order the balancer (and session_header) reads them.
CLIENT_HEADERS = ["X-Claude-Code-Session-Id", "session-id", "session_id", "X-OpenWebUI-Chat-Id", "X-Session-Id"]


@pytest.fixture
async def replicas(tmp_path: Path, strata_demo_model: Path):
    async with Replicas(tmp_path, strata_demo_model) as started:
        yield started


def turn(name: str, n: int) -> list[dict]:
    """The ``n``-th turn (from 1) of a short conversation."""
    messages = [{"role": "user", "content": f"Hello from {name}"}]
    for k in range(1, n):
        messages += [{"role": "assistant", "content": f"reply {k}"}, {"role": "user", "content": f"more {k}"}]
    return messages


async def served(replicas: Replicas, messages: list[dict], headers: dict[str, str] | None = None) -> Answer:
    answer = await replicas.ask(messages, headers)
    assert answer.status == 200, answer.body
    assert answer.replica in replicas.names, answer.headers
    return answer


async def placement(replicas: Replicas, ids: list[str], header: str = "X-Session-Id") -> dict[str, str]:
    """The replica each id's first turn reaches under ``header``."""
    return {sid: (await served(replicas, turn(sid, 1), {header: sid})).replica for sid in ids}


def test_the_documented_config_is_valid_as_written():
    result = subprocess.run([haproxy_binary(), "-c", "-f", str(HAPROXY_CONFIG)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_tested_config_is_the_documented_one_with_local_addresses(tmp_path):
    template = HAPROXY_CONFIG.read_text()
    local = balancer_config(template, bind="127.0.0.1:9", stats_socket=tmp_path / "s.sock",
                            servers=[("replica1", "127.0.0.1:10"), ("replica2", "127.0.0.1:11")])
    differs = {line.split()[0] + " " + line.split()[1] for line in set(template.splitlines()) ^ set(local.splitlines())}
    assert differs == {"bind :8080", "bind 127.0.0.1:9", "stats socket", "server replica1", "server replica2",
                       "server replica3"}
    assert "    server replica2 127.0.0.1:11\n" in local
    (tmp_path / "local.cfg").write_text(local)
    result = subprocess.run([haproxy_binary(), "-c", "-f", str(tmp_path / "local.cfg")], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


async def test_a_session_id_keeps_its_replica_ids_spread_every_client_header_counts_and_no_header_is_served(replicas):
    ids = [f"chat-{n}" for n in range(24)]
    where = await placement(replicas, ids)
    assert set(where.values()) == set(replicas.names), f"24 ids on {Counter(where.values())}"
    for sid in ids[:8]:
        for n in (2, 3):
            answer = await served(replicas, turn(sid, n), {"X-Session-Id": sid})
            assert answer.replica == where[sid], sid
        assert answer.reuse.state == "slot", (sid, answer.reuse)  # turn 3 where turn 2 left it

    # Each client's own header is hashed as X-Session-Id is: the same id, the same replica.
    sample = ids[:9]
    assert len({where[sid] for sid in sample}) > 1
    for header in CLIENT_HEADERS[:-1]:
        assert await placement(replicas, sample, header) == {sid: where[sid] for sid in sample}, header
    # The first header present wins; an empty one is passed over.
    a, b = next((a, b) for a in ids for b in ids if where[a] != where[b])
    for first, later in zip(CLIENT_HEADERS, CLIENT_HEADERS[1:]):
        assert (await served(replicas, turn(a, 1), {first: a, later: b})).replica == where[a], first
        assert (await served(replicas, turn(b, 1), {first: "", later: b})).replica == where[b], first

    # No id at all: served, by the replica the client's address hashes to.
    plain = [await served(replicas, conversation(f"plain{n}")) for n in range(4)]
    assert len({answer.replica for answer in plain}) == 1

    # The balancer's word on who answered is each replica's own count of what it answered.
    told = Counter(where.values())
    told.update(where[sid] for sid in ids[:8] for _ in (2, 3))
    told.update(where[sid] for sid in sample for _ in CLIENT_HEADERS[:-1])
    told.update([where[a], where[b]] * (len(CLIENT_HEADERS) - 1))
    told.update(answer.replica for answer in plain)
    assert {name: (await replicas.stats(name))["requests"] for name in replicas.names} == dict(told)


async def test_each_replica_runs_with_the_config_it_is_given(tmp_path, strata_demo_model):
    config = {"plugins": {"session_header": {"header": "X-Chat"}}}
    async with Replicas(tmp_path, strata_demo_model, count=2, config=config) as replicas:
        for sid in ("first-chat", "second-chat", "third-chat"):
            answer = await served(replicas, turn(sid, 1), {"X-Chat": sid})
            assert answer.key == sid, answer.headers


async def test_an_echoed_key_returns_to_the_replica_that_answered_it(replicas):
    """A client that sends no id, sending back X-Strata-Conversation, keeps its replica
    (the stick table) though the key's hash points at any of them; a streamed answer's
    key is learnt as well."""
    firsts = [await replicas.ask(conversation(f"echo{n}"), stream=n % 2 == 1) for n in range(6)]
    assert {first.status for first in firsts} == {200}
    assert all(first.body.rstrip().endswith("data: [DONE]") for first in firsts[1::2]), firsts[1].body
    for n, first in enumerate(firsts):
        assert first.key is not None
        again = await served(replicas, conversation(f"echo{n}", turns=2), {"X-Strata-Conversation": first.key})
        assert again.replica == first.replica, n
        assert again.key == first.key

    # Its replica gone, the conversation goes on elsewhere, and stays there once it is back:
    # each answer's key is stored with the replica that gave it.
    lost = firsts[0].replica
    await replicas.kill(lost)
    await replicas.wait_for_state(lost, "DOWN")
    echo = {"X-Strata-Conversation": firsts[0].key}
    elsewhere = (await served(replicas, conversation("echo0", turns=3), echo)).replica
    assert elsewhere != lost
    await replicas.restart(lost)
    await replicas.wait_for_state(lost, "UP")
    later = await served(replicas, conversation("echo0", turns=4), echo)
    assert later.replica == elsewhere and later.reuse.state == "slot", (later.replica, later.reuse)


async def test_a_body_field_past_the_balancers_first_buffer_is_out_of_its_reach(tmp_path, strata_demo_model):
    """Why the configuration hashes on headers alone: HAProxy made to hash a JSON field of
    the body, as much of it as it buffers, finds one in a small body and none at the end
    of a 100 KB one (strata-serve refuses such a prompt for the tiny context; the
    balancer's choice is what is looked at)."""
    hashing_the_body = HAPROXY_CONFIG.read_text().replace(
        "    balance hdr(X-Strata-Affinity)\n",
        "    option http-buffer-request\n    balance hash req.body,json_query('$.conversation')\n")
    async with Replicas(tmp_path, strata_demo_model, template=hashing_the_body) as replicas:
        def body(padding: int) -> list[dict]:
            return [{"role": "user", "content": "Hello " + "sea " * padding}]

        small = [await replicas.ask(body(10), conversation="one-conversation") for _ in range(6)]
        assert {answer.status for answer in small} == {200}
        assert len({answer.replica for answer in small}) == 1
        large = [await replicas.ask(body(25_000), conversation="one-conversation") for _ in range(6)]
        assert len(json.dumps(body(25_000))) > 100_000
        assert len({answer.replica for answer in large}) == len(replicas.names), [a.replica for a in large]


async def test_kill_9_of_the_replica_holding_a_conversation_then_its_return(replicas):
    ids = [f"fleet-{n}" for n in range(12)]
    where = await placement(replicas, ids)
    headers = {"X-Claude-Code-Session-Id": "held-conversation"}
    first = await served(replicas, conversation("held"), headers)
    holder = first.replica
    second = await served(replicas, conversation("held", turns=2), headers)
    assert second.replica == holder and second.reuse.state == "slot" and second.reuse.cached > 500, second.reuse
    moved = [sid for sid in ids if where[sid] == holder]
    stayed = [sid for sid in ids if where[sid] != holder]
    assert moved and stayed

    await replicas.kill(holder)
    # Before the checks see it gone: the connection is refused, and HAProxy tries another.
    probe = await served(replicas, turn(moved[0], 2), {"X-Session-Id": moved[0]})
    assert probe.replica != holder
    await replicas.wait_for_state(holder, "DOWN")

    answer, reuse = await after_a_failover(replicas, conversation("held", turns=3), headers)
    assert answer.replica != holder
    assert reread_in_full(reuse), reuse
    assert reuse.prompt > 700, reuse
    # Consistent hashing: only the lost replica's conversations move.
    for sid in stayed:
        assert (await served(replicas, turn(sid, 2), {"X-Session-Id": sid})).replica == where[sid], sid
    for sid in moved:
        assert (await served(replicas, turn(sid, 2), {"X-Session-Id": sid})).replica != holder, sid

    await replicas.restart(holder)
    await replicas.wait_for_state(holder, "UP")
    back = await served(replicas, conversation("held", turns=4), headers)
    assert back.replica == holder
    for sid in ids:
        assert (await served(replicas, turn(sid, 3), {"X-Session-Id": sid})).replica == where[sid], sid
    log = replicas[holder].log_file.read_text()
    assert len(re.findall(r"--- start ", log)) == 2


async def test_the_echoed_key_names_the_senders_own_conversation_and_sending_one_back_reaches_no_other(
        strata_memory_client_factory, strata_settings_factory):
    settings = strata_settings_factory(server={"api_keys": {"alice": "ka", "bob": "kb"}})
    client = await strata_memory_client_factory(settings=settings)

    async def ask_as(key: str, headers: dict[str, str] | None = None):
        resp = await client.post("/v1/chat/completions", json={"messages": conversation("shared"), "max_tokens": 4},
                                 headers={"Authorization": f"Bearer {key}", **(headers or {})})
        assert resp.status == 200, await resp.text()
        return resp.headers

    alice = await ask_as("ka")
    assert alice["X-Strata-Conversation"].startswith("alice--")
    # Bob sends Alice's key back: it routes his request, and keys nothing.
    bob = await ask_as("kb", {"X-Strata-Conversation": alice["X-Strata-Conversation"]})
    assert bob["X-Strata-Conversation"] == "bob--" + alice["X-Strata-Conversation"].removeprefix("alice--")
    assert bob["X-Strata-State"] != "slot", "Alice's state, held in the slot, is not Bob's"
