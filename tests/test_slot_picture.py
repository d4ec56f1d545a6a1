"""The core's picture of the slot against what the engine says, under random interleavings.

A hypothesis state machine drives a real server (real engine, auto-sessions on) with
conversations read to the end or abandoned at any point, requests without a key,
slot actions by hand and engine crashes; after every step the picture must agree
with the engine's own ``GET /slots``, and a file the picture calls current must hold
what the slot holds. The engine counts tokens and cannot name conversations: the
conversations are of lengths far enough apart that its count says whose state the
slot holds, so a picture naming the wrong one fails too.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import threading
import time
from typing import Any

import pytest
import requests
from aiohttp import web
from hypothesis import HealthCheck, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

import strata_auto_sessions
from strata_serve.api import SERVICE, create_app
from strata_serve.hook_types import StrataRequest
from strata_serve.plugins import get_plugin_manager

#: Each conversation's opening, in items of about 18 tokens (the demo model reads a
#: character as a token): about 400, 1,000 and 1,600 tokens. A turn adds about 40 tokens,
#: and an example has at most ``STEPS`` turns: the counts of two conversations never meet.
CONVERSATIONS = {"pa": 20, "pb": 52, "pc": 84}
HOW = ("read_all", "after_last_event", "mid_stream", "before_first_byte")
STEPS = 10
#: Tokens a conversation may hold past its first turn's prompt, at most: the turns of one
#: example and the answer of the last (6 tokens).
GROWTH = 50 * STEPS


def conversation(name: str, turns: int = 1) -> list[dict]:
    """Like :func:`strata_serve.testing.conversation`, with an opening of this name's length."""
    opening = f"Conversation {name}: " + " ".join(f"{name}{n} ship sea wind" for n in range(CONVERSATIONS[name]))
    messages = [{"role": "user", "content": opening}]
    for n in range(1, turns):
        messages += [{"role": "assistant", "content": f"reply {n}"},
                     {"role": "user", "content": f"and then {name} {n}?"}]
    return messages


class ServerThread:
    """A real strata-serve on a real port, its event loop in a thread of its own."""

    def __init__(self, app: web.Application):
        self.app = app
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="strata-test-server", daemon=True)
        self.thread.start()
        self.runner = web.AppRunner(app, handler_cancellation=True)
        self.call(self.runner.setup())
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        self.call(site.start())
        self.url = f"http://127.0.0.1:{self.runner.addresses[0][1]}"

    @property
    def service(self):
        return self.app[SERVICE]

    def prompt_tokens(self, messages: list[dict]) -> int:
        """Tokens the engine reads for these messages (the chat template applied)."""
        reply = requests.post(self.url + "/apply-template", json={"messages": messages}, timeout=60)
        assert reply.status_code == 200, reply.text
        reply = requests.post(self.url + "/tokenize", json={"content": reply.json()["prompt"]}, timeout=60)
        assert reply.status_code == 200, reply.text
        return len(reply.json()["tokens"])

    def call(self, coro, timeout: float = 60) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self) -> None:
        try:
            self.call(self.runner.cleanup())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)
            self.loop.close()


@pytest.fixture
def server(strata_settings_factory):
    settings_ = strata_settings_factory(plugins={"auto_sessions": {"min_tokens": 100, "idle_save_s": 0}})
    pm = get_plugin_manager(settings_, entrypoints=False, plugins=[strata_auto_sessions])
    running = ServerThread(create_app(settings_, pm))
    yield running
    running.stop()


def chat(url: str, messages: list[dict], how: str) -> None:
    body = {"messages": messages, "max_tokens": 6, "temperature": 0, "stream": how != "read_all"}
    endpoint = url + "/v1/chat/completions"
    if how == "before_first_byte":
        payload = json.dumps(body).encode()
        host, port = url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            # The Host a client would send: any other name is refused before the request runs.
            sock.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}:{port}\r\n".encode()
                         + b"Content-Type: application/json\r\n"
                         + f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
        return
    if how == "read_all":
        assert requests.post(endpoint, json=body, timeout=60).status_code == 200
        return
    with requests.post(endpoint, json=body, stream=True, timeout=60) as reply:
        events = 0
        for line in reply.iter_lines():
            if line.startswith(b"data:") and line[5:].strip() != b"[DONE]":
                events += 1
                if how == "mid_stream" and events >= 2:
                    return
                if how == "after_last_event" and b'"timings"' in line:
                    return


class PictureMatchesTheEngine(RuleBasedStateMachine):
    server: ServerThread
    #: Per conversation key: its name, and the tokens a slot holding it may hold.
    counts: dict[str, tuple[str, range]]

    def __init__(self) -> None:
        super().__init__()
        self.turns = dict.fromkeys(CONVERSATIONS, 0)
        self.hand_file = False
        #: False after a step that may leave the slot's count unknown (a request cut off
        #: before its last event): only then may the picture say "not known". The server
        #: is shared by every example, so a new one starts with whatever the last one
        #: left (hypothesis also replays from the start on the same server).
        self.count_known = False

    def settle(self, deadline_s: float = 30) -> None:
        """Wait until every request has run or left, and the engine is up.

        A request whose client closed right after sending it may not have reached the
        FIFO yet when the FIFO looks idle: its connection is still open on the server's
        side until its handler has finished, so that is waited for too.
        """
        deadline = time.monotonic() + deadline_s
        service = self.server.service
        server = self.server.runner.server
        while not (service.fifo.idle and service.engine.ready and not server.connections):
            assert time.monotonic() < deadline, "the server never settled"
            time.sleep(0.02)

    @rule(name=st.sampled_from(sorted(CONVERSATIONS)), how=st.sampled_from(HOW))
    def turn(self, name: str, how: str) -> None:
        self.turns[name] += 1
        messages = conversation(name, turns=self.turns[name])
        chat(self.server.url, messages, how)
        # A client that saw the last event (timings) leaves a known count behind it.
        self.count_known = how in ("read_all", "after_last_event")

    @rule()
    def without_a_key(self) -> None:
        reply = requests.post(self.server.url + "/v1/completions",
                              json={"prompt": "Once upon a time", "max_tokens": 4, "temperature": 0}, timeout=60)
        assert reply.status_code == 200, reply.text
        self.count_known = True

    @rule(action=st.sampled_from(("save", "restore", "erase")))
    def slot_by_hand(self, action: str) -> None:
        if action == "restore" and not self.hand_file:
            action = "save"
        body = {} if action == "erase" else {"filename": "by-hand.bin"}
        reply = requests.post(f"{self.server.url}/slots/0?action={action}", json=body, timeout=60)
        if action == "save" and reply.status_code == 400:
            return  # an empty slot: the engine refuses to save it
        assert reply.status_code == 200, reply.text
        self.hand_file = self.hand_file or action == "save"
        self.count_known = True

    @rule()
    def engine_crashes(self) -> None:
        engine = self.server.service.engine
        generation = engine.generation
        os.kill(engine.pid, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while engine.generation == generation or not engine.ready:
            assert time.monotonic() < deadline, "the engine did not come back"
            time.sleep(0.05)
        self.count_known = True

    @invariant()
    def the_picture_is_what_the_engine_holds(self) -> None:
        self.settle()
        service = self.server.service

        async def look():
            service.sync_generation()
            return service.slots[0], await service.engine.slots()

        held, engine_slots = self.server.call(look())
        if self.count_known:
            assert held.tokens is not None, ("the picture lost count after a complete step", held)
        engine_held = engine_slots[0].tokens
        if engine_held is None:
            return  # a slot that never ran a task: the engine does not say what it holds
        if held.tokens is not None:
            assert held.tokens == engine_held, (held, engine_slots[0])
        if engine_held == 0:
            assert held.key is None or held.tokens is None, held
        if held.key is not None and engine_held:
            name, possible = self.counts[held.key]
            assert engine_held in possible, (f"the picture names {name}, whose state is {possible.start:,} to "
                                             f"{possible.stop - 1:,} tokens; the slot holds {engine_held:,}", held)
        if held.file_current and held.key is not None:
            parking = service.state["auto_sessions"]
            # The file of the sibling the slot holds: a conversation restarted from its first
            # turn under a key parked further on does not continue it, and is a sibling of its own.
            sidecar = parking.store.sidecar(held.key, held.sibling)
            assert sidecar is not None and sidecar.sibling == held.sibling and sidecar.tokens == engine_held, (
                held, sidecar)


def test_the_picture_matches_the_engine_after_every_step(server):
    PictureMatchesTheEngine.server = server
    counts = {}
    for name in CONVERSATIONS:
        messages = conversation(name)
        key = server.service.conversation_key(StrataRequest(route="chat", body={"messages": messages}))
        first = server.prompt_tokens(messages)
        counts[key] = (name, range(first - 8, first + GROWTH))  # (the engine's own BOS, or not)
    spans = sorted((possible for _, possible in counts.values()), key=lambda span: span.start)
    assert all(one.stop < two.start for one, two in zip(spans, spans[1:])), f"the counts could meet: {spans}"
    PictureMatchesTheEngine.counts = counts
    run_state_machine_as_test(
        PictureMatchesTheEngine,
        settings=settings(max_examples=6, stateful_step_count=STEPS, deadline=None,
                          suppress_health_check=list(HealthCheck)),
    )
    assert server.service.slots.corrections == 0


def test_a_slot_the_engine_still_works_in_has_no_final_count():
    from strata_serve import SlotReport
    from strata_serve.slot_state import SlotRegistry

    picture = SlotRegistry.for_engine(2)
    picture[0].key, picture[0].tokens = "a", 1001
    # The client left; the engine goes on generating until it notices.
    picture.adopt_engine_counts([SlotReport(id=0, tokens=1010, processing=True), SlotReport(id=1, tokens=0)])
    assert picture[0].tokens is None and picture[0].key == "a" and picture.corrections == 0
    picture.adopt_engine_counts([SlotReport(id=0, tokens=1044)])
    assert picture[0].tokens == 1044 and picture.corrections == 0
