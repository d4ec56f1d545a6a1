"""session_header: the client names its conversation, and the name becomes the key.

Where the name is looked for, in the configured order (``plugins.session_header.sources``):

- the ids real clients send for their own reasons (:data:`CLIENT_SOURCES`): Claude
  Code's ``X-Claude-Code-Session-Id`` header and the ``session_id`` in its
  ``metadata.user_id``, the Responses API's ``prompt_cache_key`` and Codex's
  ``session-id`` (older builds: ``session_id``) header, Open WebUI's
  ``X-OpenWebUI-Chat-Id``;
- ``header``: the ``X-Session-Id`` header (or the one named by ``plugins.session_header.header``);
- ``metadata``: ``metadata.session_id`` in the body;
- ``user``: the OpenAI ``user`` field, only when listed in ``sources`` (it is not by
  default: ``user`` names a person, and chat UIs send the same one with every
  conversation, which would give all of them one key and one file).

A client's own id names a *session*, which may hold several conversations: Claude Code
sends its session-title request, with another system prompt, under the id of the main
turn, and its parallel sub-agents under that id too. Such an id's key is therefore
``<id>_<digest>``, the digest (:func:`conversation_digest`) naming the conversation
within the session by what stays fixed in it across turns and compaction: the system
prompt (less Claude Code's billing line, which changes with the first message), the
tools' names and Claude Code's agent id. ``X-Session-Id`` and ``metadata.session_id``
are sent for strata-serve alone and name the conversation itself: their key is the id.

A session id is 1 to 64 of letters, digits, ``-`` and ``_`` (a key names a file). A
header or ``metadata.session_id`` that breaks the rule is refused with a 400: the
client sent it for us and would otherwise lose its session without knowing. The
clients' own ids and ``user`` are filled for other reasons: one that is not a usable
id (or, for a client's id, longer than :data:`CLIENT_ID_LENGTH`, or holding ``--``)
is passed over, so installing this plugin never breaks such a client. Without a
usable name the plugin defers to the next keying plugin.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

import strata_serve
from strata_serve import StrataRequest, message_text, opening

NAME = "session_header"
#: The plugin's name when registered by hand (tests); the entry point gives the same.
strata_name = NAME

MAX_LENGTH = 64
SESSION_ID = re.compile(rf"[A-Za-z0-9_-]{{1,{MAX_LENGTH}}}")
#: Hex digits of a client id's conversation digest.
DIGEST_LENGTH = 8
#: The longest client id used as it is: ``<id>_<digest>`` fits a key's 64 characters.
CLIENT_ID_LENGTH = MAX_LENGTH - 1 - DIGEST_LENGTH

CLAUDE_CODE_SESSION = "X-Claude-Code-Session-Id"
#: The longest ``metadata.user_id`` read as JSON (Claude Code's is about 150 characters).
MAX_USER_ID = 1024
CLAUDE_CODE_AGENT = "X-Claude-Code-Agent-Id"
CODEX_SESSIONS = ("session-id", "session_id")
OPEN_WEBUI_CHAT = "X-OpenWebUI-Chat-Id"
#: Claude Code's first system block: a cache-busting line that changes with the first
#: user message (``cc_version=2.1.197.0df`` became ``.f9d`` after a compaction).
BILLING_LINE = "x-anthropic-billing-header:"

Source = Literal[
    "claude_code", "claude_code_metadata", "prompt_cache_key", "codex", "open_webui",
    "header", "metadata", "user",
]
#: The sources that are a client's own id (keyed ``<id>_<digest>``, passed over when unusable).
CLIENT_SOURCES: tuple[Source, ...] = (
    "claude_code", "claude_code_metadata", "prompt_cache_key", "codex", "open_webui",
)
DEFAULT_SOURCES: tuple[Source, ...] = (*CLIENT_SOURCES, "header", "metadata")


class SessionHeaderConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    #: The header that carries the session id.
    header: str = Field("X-Session-Id", min_length=1)
    #: Where to look, first to last. ``user`` is not a default: it names a person, not a
    #: conversation. Add it last, for clients that put a conversation id there.
    sources: list[Source] = Field(default_factory=lambda: list(DEFAULT_SOURCES))


@strata_serve.hookimpl
def on_config(settings):
    settings.plugin_config(NAME, SessionHeaderConfig)  # refuse a bad section before the start


# tryfirst: a client's own name beats any guess from the prompt (system_prompt_key, the
# built-in default), whatever order the plugins were installed in.
@strata_serve.hookimpl(tryfirst=True)
def conversation_key(request: StrataRequest, service) -> strata_serve.ConversationKey | None:
    key = _key(request, service.plugin_config(NAME, SessionHeaderConfig))
    # The client named it: one conversation (auto-sessions keeps one file for it).
    return None if key is None else strata_serve.ConversationKey(key, named=True)


def _key(request: StrataRequest, config: SessionHeaderConfig) -> str | None:
    for source in config.sources:
        if source in CLIENT_SOURCES:
            client_id = _client_id(source, request)
            if client_id is not None:
                return f"{client_id}_{conversation_digest(request)}"
        elif source == "header":
            value = request.headers.get(config.header)
            if value is not None:
                return checked(value, config.header)
        elif source == "metadata":
            metadata = request.body.get("metadata")
            if isinstance(metadata, dict) and "session_id" in metadata:
                return checked(metadata["session_id"], "metadata.session_id")
        else:
            user = request.body.get("user")
            if isinstance(user, str) and SESSION_ID.fullmatch(user):
                return user
    return None


def _client_id(source: Source, request: StrataRequest) -> str | None:
    """The usable id ``source`` holds in ``request``, else None."""
    headers = request.headers
    if source == "claude_code":
        return usable_client_id(headers.get(CLAUDE_CODE_SESSION))
    if source == "claude_code_metadata":
        metadata = request.body.get("metadata")
        user_id = metadata.get("user_id") if isinstance(metadata, dict) else None
        if not isinstance(user_id, str) or len(user_id) > MAX_USER_ID:
            return None
        try:
            fields = json.loads(user_id)
        except (ValueError, RecursionError):
            return None
        return usable_client_id(fields.get("session_id") if isinstance(fields, dict) else None)
    if source == "prompt_cache_key":
        return usable_client_id(request.body.get("prompt_cache_key"))
    if source == "codex":
        for name in CODEX_SESSIONS:
            found = usable_client_id(headers.get(name))
            if found is not None:
                return found
        return None
    return usable_client_id(headers.get(OPEN_WEBUI_CHAT))


def usable_client_id(value: object) -> str | None:
    """``value`` if a client's own id can name a session in a key, else None (passed over)."""
    if (
        isinstance(value, str)
        and len(value) <= CLIENT_ID_LENGTH
        and SESSION_ID.fullmatch(value)
        # A key holding the tenants' separator is refused by the core: a 400 the user never chose.
        and strata_serve.tenant_of(value) is None
    ):
        return value
    return None


def conversation_digest(request: StrataRequest) -> str:
    """What tells one conversation of a session from another, the same on every turn.

    The system prompt (each part's lines, less Claude Code's billing line), the names
    of the tools, sorted, and Claude Code's agent id; for a request with neither a
    system prompt nor tools (a probe, a chat UI's title task), its first user message
    too, since nothing else tells it from the session's other requests. The first user
    message is otherwise left out: after a compaction a summary takes its place, in
    the same conversation.
    """
    system = [_stable(part) for part in _system_parts(request)]
    system = [part for part in system if part]
    tools = sorted(_tool_names(request.body.get("tools")))
    identity: dict[str, Any] = {"system": system, "tools": tools}
    agent = request.headers.get(CLAUDE_CODE_AGENT)
    if agent:
        identity["agent"] = agent
    if not system and not tools:
        start = opening(request)
        if start is not None:
            identity["user"] = start.user
            if start.media:
                identity["media"] = start.media
    framed = json.dumps(identity, ensure_ascii=False, sort_keys=True, separators=(",", ":"))
    return hashlib.sha1(framed.encode("utf-8")).hexdigest()[:DIGEST_LENGTH]


def _system_parts(request: StrataRequest) -> list[str]:
    if request.route == "messages":
        # Block by block: Claude Code's billing line is a block of its own.
        system = request.body.get("system")
        if isinstance(system, list):
            return [message_text([block]) for block in system]
        return [system] if isinstance(system, str) else []
    start = opening(request)
    return start.system if start is not None else []


def _stable(part: str) -> str:
    return "\n".join(line for line in part.splitlines() if not line.startswith(BILLING_LINE))


def _tool_names(tools: Any) -> list[str]:
    names = []
    for tool in tools if isinstance(tools, list) else []:
        if not isinstance(tool, Mapping):
            continue
        function = tool.get("function")
        name = tool.get("name") or (function.get("name") if isinstance(function, Mapping) else None)
        name = name or tool.get("type")  # a built-in tool (web_search) has no name
        if isinstance(name, str):
            names.append(name)
    return names


def checked(value: object, param: str) -> str:
    """``value`` if it is a usable session id.

    :raises strata_serve.KeyRefused: naming ``param`` and what is wrong with it.
    """
    if not isinstance(value, str):
        raise strata_serve.KeyRefused(f"{param} must be a string", param=param)
    if len(value) > MAX_LENGTH:
        raise strata_serve.KeyRefused(
            f"{param} is {len(value)} characters long; a session id has at most {MAX_LENGTH}", param=param
        )
    if not SESSION_ID.fullmatch(value):
        raise strata_serve.KeyRefused(
            f"{param} must be 1 to {MAX_LENGTH} of letters, digits, '-' and '_'", param=param
        )
    return value
