"""Requests shaped like Claude Code's and Codex's, scaled down to the tiny demo model.

The shapes follow what the clients send (the plugin's README says what was measured):
Claude Code's three system blocks (a billing line whose fingerprint follows the first
user message, an identity line, the agent prompt), its tools, a first user message of
reminders then the prompt, its session id in a header and in ``metadata.user_id``; its
session-title request under the same id; Codex's instructions, tools, developer and
``AGENTS.md`` items, its conversation id in ``prompt_cache_key`` and the ``session-id``
header.
"""

from __future__ import annotations

import json
from typing import Any

SESSION_A = "b5b1fbbf-ba96-40de-8923-ca1fdfb5dba9"
SESSION_B = "d2338925-2f8c-47f0-b6b3-c154e652ee4b"

IDENTITY = "You are Claude Code, Anthropic's official CLI for Claude."
AGENT_PROMPT = "You are an interactive agent that helps users with software engineering tasks.\n" + "\n".join(
    f"Rule {n}: read the file before you edit it, run tool {n} with care." for n in range(8)
)
TITLE_PROMPT = ("You are naming a coding session. Read the user's first message and answer with a "
                "title of three to five words, as JSON {\"title\": ...}.")
TOOL_NAMES = ("Bash", "Read", "Edit", "Write", "Grep")
REMINDERS = ("<system-reminder>\nAs you answer the user's questions, you can use the following context:\n"
             "# claudeMd\n" + " ".join(f"Keep style rule {n}." for n in range(6))
             + "\n# currentDate\nToday's date is 2026-09-30.\n</system-reminder>")
PROMPT = "Fix the failing test in utils.py"
SUMMARY = ("This session is being continued from a previous conversation that ran out of context. "
           "Summary: " + " ".join(f"step {n} changed utils.py line {n * 7}." for n in range(8)))


def billing(fingerprint: str = "0df") -> str:
    # The suffix follows the first user message: it changed after a compaction (measured).
    return f"x-anthropic-billing-header: cc_version=2.1.197.{fingerprint}; cc_entrypoint=cli;"


def file_text(name: str) -> str:
    """A source file a tool read: about 600 tokens on the demo model, different for every ``name``."""
    return "\n".join(f"def {name}_{n}(x):  # {name} helper {n}\n    return x * {n} + {len(name)}" for n in range(10))


def claude_code_headers(session: str | None, agent: str | None = None) -> dict[str, str]:
    headers = {"anthropic-version": "2023-06-01", "x-app": "cli", "user-agent": "claude-cli/2.1.197 (external, cli)"}
    if session is not None:
        headers["X-Claude-Code-Session-Id"] = session
    if agent is not None:
        headers["X-Claude-Code-Agent-Id"] = agent
    return headers


def claude_code_metadata(session: str) -> dict[str, str]:
    return {"user_id": json.dumps({"device_id": "ec13" * 16, "account_uuid": "", "session_id": session})}


def claude_code_tools() -> list[dict[str, Any]]:
    return [{"name": name, "description": f"The {name} tool.",
             "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}}}
            for name in TOOL_NAMES]


def claude_code_body(messages: list[dict[str, Any]], session: str | None, *, fingerprint: str = "0df",
                     max_tokens: int = 8) -> dict[str, Any]:
    """A main turn: billing, identity and agent prompt, the tools, ``messages``."""
    body: dict[str, Any] = {
        "model": "claude-sonnet-4-6", "max_tokens": max_tokens, "temperature": 0,
        "system": [{"type": "text", "text": billing(fingerprint)},
                   {"type": "text", "text": IDENTITY, "cache_control": {"type": "ephemeral"}},
                   {"type": "text", "text": AGENT_PROMPT, "cache_control": {"type": "ephemeral"}}],
        "tools": claude_code_tools(),
        "messages": messages,
    }
    if session is not None:
        body["metadata"] = claude_code_metadata(session)
    return body


def claude_code_title_body(session: str | None, prompt: str = PROMPT) -> dict[str, Any]:
    """The session-title request sent at the same instant as a main turn: another system
    prompt after the same billing and identity blocks, no tools."""
    body: dict[str, Any] = {
        "model": "claude-sonnet-4-6", "max_tokens": 8, "temperature": 0,
        "system": [{"type": "text", "text": billing()}, {"type": "text", "text": IDENTITY},
                   {"type": "text", "text": TITLE_PROMPT}],
        "messages": [{"role": "user", "content": f"<session> {prompt} </session> Write the title."}],
    }
    if session is not None:
        body["metadata"] = claude_code_metadata(session)
    return body


def claude_code_opening(prompt: str = PROMPT) -> list[dict[str, Any]]:
    return [{"role": "user", "content": [{"type": "text", "text": REMINDERS},
                                         {"type": "text", "text": prompt, "cache_control": {"type": "ephemeral"}}]}]


def claude_code_tool_turn(name: str, n: int = 1) -> list[dict[str, Any]]:
    """The canned tool call of a turn and the file it read."""
    call = f"toolu_{name}_{n}"
    return [{"role": "assistant", "content": [{"type": "text", "text": "Let me look."},
                                              {"type": "tool_use", "id": call, "name": "Read",
                                               "input": {"path": f"/repo/{name}.py"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call,
                                          "content": file_text(name)}]}]


def claude_code_short_turn(text: str) -> list[dict[str, Any]]:
    return [{"role": "assistant", "content": [{"type": "text", "text": "Done."}]},
            {"role": "user", "content": [{"type": "text", "text": text}]}]


CODEX_INSTRUCTIONS = "You are Codex, a coding agent running in a terminal.\n" + "\n".join(
    f"Guideline {n}: keep changes small and run the tests after step {n}." for n in range(8)
)
CODEX_OPENING = [
    {"type": "message", "role": "developer",
     "content": [{"type": "input_text", "text": "<permissions instructions>workspace-write, network off</permissions instructions>"}]},
    {"type": "message", "role": "user", "content": [
        {"type": "input_text", "text": "# AGENTS.md instructions for /repo\n\n<INSTRUCTIONS>\n"
         + " ".join(f"Repository rule {n}." for n in range(6)) + "\n</INSTRUCTIONS>"},
        {"type": "input_text", "text": "<environment_context>\n  <cwd>/repo</cwd>\n  <shell>bash</shell>\n</environment_context>"}]},
    {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Add a --verbose flag to cli.py"}]},
]


def codex_tools() -> list[dict[str, Any]]:
    return [{"type": "function", "name": name, "description": f"The {name} tool.",
             "parameters": {"type": "object", "properties": {"command": {"type": "string"}}}}
            for name in ("shell", "update_plan")]


def codex_headers(session: str | None, *, header: str = "session-id") -> dict[str, str]:
    headers = {"originator": "codex_cli_rs"}
    if session is not None:
        headers[header] = session
    return headers


def codex_body(items: list[dict[str, Any]], cache_key: str | None) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": "local-model", "instructions": CODEX_INSTRUCTIONS, "tools": codex_tools(),
        "tool_choice": "auto", "parallel_tool_calls": False, "store": False,
        "input": items, "max_output_tokens": 16, "temperature": 0,
    }
    if cache_key is not None:
        body["prompt_cache_key"] = cache_key
    return body


def codex_tool_turn(name: str, n: int = 1) -> list[dict[str, Any]]:
    call = f"call_{name}_{n}"
    return [{"type": "function_call", "call_id": call, "name": "shell",
             "arguments": json.dumps({"command": f"cat {name}.py"})},
            {"type": "function_call_output", "call_id": call, "output": file_text(name)}]


def codex_short_turn(text: str) -> list[dict[str, Any]]:
    return [{"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Done."}]},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}]
