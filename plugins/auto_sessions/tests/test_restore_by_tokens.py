"""With blocks, what comes back is decided by tokens, not by names: the engine tokenizes
the incoming prompt, and the longest stored chain of blocks that prefixes it is restored,
whichever conversation stored it (docs/sessions.md, "Restoring by tokens"). Each test runs
the same requests without blocks as its control, where the key alone decides."""

from __future__ import annotations

import asyncio
import copy
import logging

import pytest

import strata_auto_sessions
import strata_serve
import strata_session_header
from strata_serve.api import SERVICE
from strata_serve.api.anthropic import MESSAGES
from strata_serve.api.responses import RESPONSES_API
from strata_serve.testing import ask, until

from plugins.session_header.tests.client_shapes import (
    CODEX_OPENING, SESSION_A, SESSION_B, claude_code_body, claude_code_headers, claude_code_opening, codex_body,
    codex_headers,
)

from .conftest import MIN_TOKENS
from .test_auto_sessions import log_lines, parking
from .test_block_parking import agent, words

BLOCK = 64


@pytest.fixture(autouse=True)
def plugin_logs(caplog):
    caplog.set_level(logging.INFO, logger="strata_auto_sessions")


def other_opening() -> list[dict[str, str]]:
    """A conversation that shares nothing with an agent's opening (not even a system prompt)."""
    return [{"role": "user", "content": "Unrelated: " + words("zz", 80)}]


async def shared_tokens(client, one: list[dict[str, str]], other: list[dict[str, str]]) -> int:
    """How many tokens two prompts share from their first, as the engine tokenizes them."""
    engine = client.app[SERVICE].engine
    a, b = [await engine.prompt_tokens("/v1/chat/completions", {"messages": m}) for m in (one, other)]
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


async def test_a_new_session_reads_the_opening_another_session_parked_from_its_blocks(auto_client, tmp_path,
                                                                                    caplog):
    """A second agent session (another key) arriving after an unrelated chat took the slot:
    the opening the first session parked is restored by its tokens, not read again."""
    reused = {}
    for blocks in (True, False):
        client = await auto_client(engine={"slot_save_path": str(tmp_path / f"slots-{blocks}")}, blocks=blocks,
                                   idle_save_s=0)
        await ask(client, agent("a"), max_tokens=1)
        await ask(client, other_opening(), max_tokens=1)  # "a" is parked; the slot holds an unrelated chat
        caplog.clear()
        answer = await ask(client, agent("b"), max_tokens=1)
        reused[blocks] = answer["timings"]["cache_n"]
        stats = parking(client).stats
        if blocks:
            assert stats.restores_by_tokens == 1, stats
            assert any("the longest stored prefix of its prompt" in line for line in log_lines(caplog))
            # every whole block of what "a" and "b" share, as the engine tokenizes them
            shared = await shared_tokens(client, agent("a"), agent("b"))
            assert reused[blocks] >= shared // BLOCK * BLOCK, (reused, shared)
        else:
            assert stats.restores_by_tokens == 0
        await client.close()
    assert reused[True] >= 1000, reused
    assert reused[False] < 100, reused


async def test_where_tokens_and_the_key_disagree_tokens_win(auto_client, tmp_path):
    """A client resumes its session "one" with the history its fork "two" grew: the fork's
    blocks hold more of the prompt than "one"'s own state, and they are what comes back."""
    ids = {name: {"X-Session-Id": name} for name in ("one", "two", "three")}
    reused, own = {}, {}
    for blocks in (True, False):
        client = await auto_client(strata_session_header, engine={"slot_save_path": str(tmp_path / f"s-{blocks}"),
                                                                         "ctx_size": 8192},
                                   blocks=blocks, idle_save_s=0)
        start = agent("fork", size=10)
        a1 = await ask(client, start, max_tokens=4, headers=ids["one"])
        grown = start + [{"role": "assistant", "content": a1["choices"][0]["message"]["content"]},
                         {"role": "user", "content": "Go on: " + words("more", 30)}]
        a2 = await ask(client, grown, max_tokens=4, headers=ids["two"])  # "one" is parked
        await ask(client, other_opening(), max_tokens=1, headers=ids["three"])  # "two" is parked
        resumed = grown + [{"role": "assistant", "content": a2["choices"][0]["message"]["content"]},
                           {"role": "user", "content": "And now?"}]
        answer = await ask(client, resumed, max_tokens=1, headers=ids["one"])
        reused[blocks], own[blocks] = answer["timings"]["cache_n"], a1["timings"]["prompt_n"]
        assert parking(client).stats.restores_by_tokens == (1 if blocks else 0)
        await client.close()
    # with blocks: "two"'s state, past all of "one"'s; without: "one"'s own file, no further
    assert reused[True] >= a2["timings"]["prompt_n"] - BLOCK, (reused, a2["timings"])
    assert reused[False] <= own[False] + 8, (reused, own)


async def test_a_conversation_whose_own_state_holds_the_most_comes_back_as_named(auto_client, tmp_path):
    """The usual switch back: its own manifest holds the most of the prompt, so nothing is
    restored by tokens and its own state comes back (kept whole in memory, where staged)."""
    client = await auto_client(engine={"slot_save_path": str(tmp_path / "slots")}, blocks=True, idle_save_s=0)
    a = agent("a")
    first = await ask(client, a, max_tokens=2)
    await ask(client, other_opening(), max_tokens=1)
    back = a + [{"role": "assistant", "content": first["choices"][0]["message"]["content"]},
                {"role": "user", "content": "Next."}]
    answer = await ask(client, back, max_tokens=1)
    stats = parking(client).stats
    assert stats.restores == 1 and stats.restores_by_tokens == 0, stats
    assert answer["timings"]["cache_n"] >= first["timings"]["prompt_n"], answer["timings"]
    await client.close()


async def test_a_tenant_never_restores_another_tenants_blocks(strata_client_factory, strata_settings_factory,
                                                             tmp_path):
    """Two tenants with the same opening: the second's first turn finds nothing by tokens
    (a block's name is salted by its tenant), and is read in full."""
    settings = strata_settings_factory(
        server={"api_keys": {"alice": "alice-key", "bob": "bob-key"}},
        engine={"slot_save_path": str(tmp_path / "slots")},
        plugins={"auto_sessions": {"min_tokens": MIN_TOKENS, "blocks": True, "idle_save_s": 0}})
    client = await strata_client_factory(strata_auto_sessions, settings=settings)
    await ask(client, agent("a"), max_tokens=1, key="alice-key")
    await ask(client, other_opening(), max_tokens=1, key="alice-key")
    answer = await ask(client, agent("b"), max_tokens=1, key="bob-key")
    assert parking(client).stats.restores_by_tokens == 0
    assert answer["timings"]["cache_n"] < 100, answer["timings"]
    # alice's own next session does find it
    answer = await ask(client, agent("c"), max_tokens=1, key="alice-key")
    assert parking(client).stats.restores_by_tokens == 1
    assert answer["timings"]["cache_n"] >= 1000, answer["timings"]
    await client.close()


def claude_code_turn(session: str) -> tuple[dict, dict]:
    """A Claude Code session's first turn: the opening every session in a project shares."""
    return claude_code_body(claude_code_opening(f"In session {session}: fix the failing test"), session,
                            max_tokens=1), claude_code_headers(session)


def codex_turn(session: str) -> tuple[dict, dict]:
    """A Codex session's first turn, its conversation named by ``prompt_cache_key``."""
    task = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": f"In {session}: add a flag"}]}
    return {**codex_body(CODEX_OPENING[:-1] + [task], session), "max_output_tokens": 1}, codex_headers(session)


def as_sent(path: str, body: dict) -> dict:
    """``body`` as the engine is sent it (Anthropic's: its billing lines left out)."""
    api = {"/v1/messages": MESSAGES, "/v1/responses": RESPONSES_API}[path]
    return api.prepare(copy.deepcopy(body)) if api.prepare else body


def reused_of(path: str, answer: dict) -> int:
    """The prompt tokens the engine reused, as each API reports them."""
    usage = answer["usage"]
    if path == "/v1/messages":
        return int(usage["cache_read_input_tokens"])
    return int(usage["input_tokens_details"]["cached_tokens"])


@pytest.mark.parametrize("path,turn", [("/v1/messages", claude_code_turn), ("/v1/responses", codex_turn)],
                         ids=["claude code", "codex"])
async def test_a_new_agent_session_on_an_anthropic_or_responses_api_restores_the_shared_opening(
        auto_client, tmp_path, path, turn):
    """Claude Code and Codex send their own APIs, which llama-server converts to a chat: a
    second session of the same agent (another id, so another key) restores the opening the
    first one parked, by its tokens, after an unrelated chat took the slot."""
    reused = {}
    for blocks in (True, False):
        client = await auto_client(strata_session_header, engine={"slot_save_path": str(tmp_path / f"s-{blocks}")},
                                   blocks=blocks, idle_save_s=0)
        engine = client.app[SERVICE].engine
        body_a, headers_a = turn(SESSION_A)
        body_b, headers_b = turn(SESSION_B)
        resp = await client.post(path, json=body_a, headers=headers_a)
        assert resp.status == 200, await resp.text()
        await ask(client, other_opening(), max_tokens=1)  # A is parked; the slot holds an unrelated chat
        resp = await client.post(path, json=body_b, headers=headers_b)
        assert resp.status == 200, await resp.text()
        reused[blocks] = reused_of(path, await resp.json())
        assert parking(client).stats.restores_by_tokens == (1 if blocks else 0)
        if blocks:
            a, b = [await engine.prompt_tokens(path, as_sent(path, body)) for body in (body_a, body_b)]
            shared = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
            assert reused[blocks] >= shared // BLOCK * BLOCK >= 4 * BLOCK, (reused, shared)
        await client.close()
    assert reused[False] < BLOCK, reused


class EditsTheOpening:
    """A plugin acting after auto-sessions that changes what "b" sends: the prompt the engine
    reads then differs from the one auto-sessions had tokenized."""

    strata_name = "edits_the_opening"

    @strata_serve.hookimpl(trylast=True)
    def pre_request(self, request):
        messages = request.body.get("messages") or []
        if len(messages) > 1 and str(messages[1].get("content", "")).startswith("Task b"):
            messages[0] = {**messages[0], "content": "Edited. " + messages[0]["content"]}


async def test_a_restore_by_tokens_the_engine_did_not_reuse_never_pauses_parking(auto_client, tmp_path, caplog):
    """Its tokens were the prompt as auto-sessions saw it; a plugin after it changed the
    prompt, so the engine reused little. That says nothing of the engine's restores: counted
    as diverged, said, and parking goes on (a restore "not reused" could pause it)."""
    client = await auto_client(EditsTheOpening(), engine={"slot_save_path": str(tmp_path / "slots")}, blocks=True,
                               idle_save_s=0)
    await ask(client, agent("a"), max_tokens=1)
    await ask(client, other_opening(), max_tokens=1)
    answer = await ask(client, agent("b"), max_tokens=1)
    stats = parking(client).stats
    assert stats.restores_by_tokens == 1 and answer["timings"]["cache_n"] < 100, (stats, answer["timings"])
    assert stats.restores_diverged == 1 and stats.restores_not_reused == 0, stats
    assert any("the engine read the prompt otherwise than it tokenized it" in line for line in log_lines(caplog))
    assert parking(client).mode.parks
    await client.close()


class SeesTheSlotBeforeTheEngine:
    """A plugin acting after auto-sessions: what the picture says of the slot when the
    request is about to go to the engine (after any restore made for it)."""

    strata_name = "sees_the_slot_before_the_engine"

    def __init__(self) -> None:
        self.seen: list[tuple[str | None, int | None, bool]] = []

    @strata_serve.hookimpl(trylast=True)
    def pre_request(self, request, service):
        state = service.slots[request.slot]
        self.seen.append((state.key, state.tokens, state.file_current))


async def test_a_prefix_restored_by_tokens_is_not_taken_for_the_conversations_file(auto_client, tmp_path):
    """A restore by tokens loads a prefix of blocks (here another session's opening): the
    slot then holds part of a state, so no file is current for it, and a request cut off
    before the engine ran it leaves a slot that must be saved at the next switch. Its
    control: the conversation's own state restored whole, whose file is current."""
    seen = SeesTheSlotBeforeTheEngine()
    client = await auto_client(seen, engine={"slot_save_path": str(tmp_path / "slots")}, blocks=True,
                               idle_save_s=0)
    a = agent("a")
    first = await ask(client, a, max_tokens=2)
    await ask(client, other_opening(), max_tokens=1)  # "a" is parked
    await ask(client, agent("b"), max_tokens=1)  # "b" starts from "a"'s opening, by its tokens
    stats = parking(client).stats
    assert stats.restores_by_tokens == 1, stats
    key_b, tokens_b, current_b = seen.seen[-1]
    assert key_b is not None and tokens_b, seen.seen
    assert current_b is False, seen.seen  # a prefix of "a"'s blocks is not "b"'s file
    back = a + [{"role": "assistant", "content": first["choices"][0]["message"]["content"]},
                {"role": "user", "content": "Next."}]
    await ask(client, back, max_tokens=1)  # "a" comes back: its own state, restored as named
    assert parking(client).stats.restores_by_tokens == 1
    assert seen.seen[-1][2] is True, seen.seen  # the control: its own file is current
    await client.close()


class HeldTurn:
    """Holds the ``post_request`` of a request sent with ``X-Hold`` until released: the
    FIFO is held meanwhile, and the next request waits in line."""

    strata_name = "held_turn"

    def __init__(self) -> None:
        self.entered, self.release = asyncio.Event(), asyncio.Event()

    @strata_serve.hookimpl
    async def post_request(self, request):
        if request.headers.get("X-Hold"):
            self.entered.set()
            await self.release.wait()


async def test_the_prompt_is_tokenized_while_the_request_waits_in_line_not_in_its_switch(auto_client, tmp_path):
    """A request whose conversation no slot holds has its prompt tokenized as it arrives,
    while the request before it still holds the line; its switch then finds the tokens
    asked and restores by them. Control: a request continuing what the slot holds, which
    needs no switch, asks nothing."""
    held = HeldTurn()
    client = await auto_client(held, engine={"slot_save_path": str(tmp_path / "slots")}, blocks=True, idle_save_s=0)
    service = client.app[SERVICE]
    asked, plain = [], service.engine.prompt_tokens

    async def counted(path, body):
        asked.append(body)
        return await plain(path, body)

    service.engine.prompt_tokens = counted
    await ask(client, agent("a"), max_tokens=1)

    async def behind_a_held_turn(holding, waiting, asked_ahead: bool):
        """``waiting`` sent while ``holding``'s turn holds the line: its answer, and how
        many prompts were asked while it waited and during its own turn."""
        held.entered.clear(), held.release.clear()
        # its own connection: the server would read the next request on this one only
        # once the held turn's handler ended
        holder = asyncio.ensure_future(ask(client, holding, max_tokens=1,
                                           headers={"X-Hold": "1", "Connection": "close"}))
        await until(held.entered.is_set, what="the held turn's post_request")
        try:
            before = len(asked)
            behind = asyncio.ensure_future(ask(client, waiting, max_tokens=1))
            await until(lambda: service.fifo.waiting, what="the request behind it in line")
            if asked_ahead:
                await until(lambda: len(asked) > before, what="its prompt asked")
            while_waiting = len(asked) - before
        finally:
            held.release.set()
        await holder
        answer = await behind
        return answer, while_waiting, len(asked) - before - while_waiting

    # "a" is parked as the unrelated chat takes the slot; "b" arrives while that chat's turn holds the line
    answer, while_waiting, in_its_turn = await behind_a_held_turn(other_opening(), agent("b"), True)
    assert (while_waiting, in_its_turn) == (1, 0), "asked once, as it arrived, while the line was held"
    assert asked[-1]["messages"][-1] == agent("b")[-1]
    stats = parking(client).stats
    assert stats.restores_by_tokens == 1, stats
    shared = await shared_tokens(client, agent("a"), agent("b"))
    assert answer["timings"]["cache_n"] >= shared // BLOCK * BLOCK, (answer["timings"], shared)
    # control: "b" goes on in the slot that holds it, behind its own held turn: no switch, no ask
    b2 = agent("b") + [{"role": "assistant", "content": answer["choices"][0]["message"]["content"]},
                       {"role": "user", "content": "Next."}]
    b3 = b2 + [{"role": "assistant", "content": "x"}, {"role": "user", "content": "And then?"}]
    answer, while_waiting, in_its_turn = await behind_a_held_turn(b2, b3, False)
    assert (while_waiting, in_its_turn) == (0, 0)
    await client.close()
