"""Switches left to the engine's RAM prompt cache, while it has room (``ram_first``).

llama-server keeps prompts in RAM (``--cache-ram``, 8,192 MiB unless set). When a slot
takes a task whose prompt shares less than half of what the slot holds, the engine
copies the slot's state into that cache first, then copies back the cached prompt that
best prefixes the new one (``tools/server/server-context.cpp``, ``get_available_slot``;
``server-task.cpp``, ``server_prompt_cache``). Both copies are memory copies: such a
switch costs the engine a few milliseconds, where a park to disk costs a save of the
whole state and a restore. The cache drops its oldest prompts first to stay within its
bytes; a prompt loaded back into a slot leaves it.

So while the cache has room, a switch need not touch the disk at all: the outgoing
conversation is left to the engine, and an incoming one the engine holds comes back
from RAM. :class:`EngineRam` follows what the engine caches at each switch, oldest
first, and keeps one rule: the cache never fills beyond half its bytes
(:data:`BUDGET_SHARE`: room for the estimate's error), so the engine never evicts, and
every conversation left there is there when it returns. A switch is left to the engine
when

- the engine's cache is on and its budget known (a managed engine; an attached one says
  nothing of its flags), no shared tier is configured (the other servers need each
  state on the tier), and the engine runs one slot;
- the incoming conversation is one left to the engine, or has nothing parked;
- the outgoing conversation fits within the half with what is cached already, and its
  prompt shares at most :data:`MAX_SHARED` of its characters with the incoming one (the
  engine keeps a prompt sharing half or more in the slot, and caches nothing).

When the incoming conversation is in RAM and the outgoing one cannot be left there, the
outgoing one is parked to disk and the slot emptied: the engine then caches nothing and
brings the incoming one back. Otherwise the switch parks to disk, as without this module.
The first state of an engine is saved to disk either way: its size is measured so.

Belief is checked: a conversation believed in RAM that comes back with less than half
its tokens reused was not there, and from then on every switch parks to disk until the
engine restarts. And a conversation parked from the slot is in the slot, so it is not
believed in RAM from then on: the request that would have had the engine cache it may
have been cut off before it reached the engine.

At a normal stop, each conversation left in RAM is brought back into the slot by its
last request sent again for one token (the engine loads it from RAM, and re-reads only
the last answer), and saved: a stop still leaves every conversation on disk. The price
of the mode is a crash: a conversation left in RAM and not saved since (``idle_save_s``)
loses its newest turns if the engine dies; its file, if any, holds an older turn.
"""

from __future__ import annotations

import logging
import math
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from strata_serve import StrataRequest

from strata_auto_sessions.prefix import shared_links

if TYPE_CHECKING:
    from strata_serve import Service, SlotState

log = logging.getLogger("strata_auto_sessions")

#: llama-server's default ``--cache-ram``, in MiB.
ENGINE_DEFAULT_MIB = 8192
#: The share of the cache's bytes the conversations left there may fill.
BUDGET_SHARE = 0.5
#: The share of the outgoing prompt's characters the incoming prompt may share for the
#: engine to be sure to cache it (it does below one half, counted in tokens).
MAX_SHARED = 0.4
#: A conversation believed in RAM whose next request reused less than this share of the
#: tokens it was left with was not in RAM.
REUSED_SHARE = 0.5

#: One conversation: (tenant, key, sibling).
Ident = tuple[str | None, str, int]


@dataclass(frozen=True)
class Left:
    """A conversation left to the engine's RAM cache: its tokens then, and the engine path
    and body of its last request (to bring it back into the slot at a stop)."""

    tokens: int
    path: str | None = None
    body: dict[str, Any] | None = None
    #: Its prompt's signature (:func:`strata_auto_sessions.prompts.prompt_signature`), and
    #: when the slot began holding it (``SlotState.since``: a removal by hand since drops it).
    prompt: dict[str, Any] | None = None
    since: float | None = None

    def replay(self) -> dict[str, Any] | None:
        """Its last request's body, asking for one token, not streamed (None: not known)."""
        if self.path is None or self.body is None:
            return None
        body = {k: v for k, v in self.body.items() if k not in ("stream", "stream_options")}
        body["n_predict"] = 1
        for limit in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
            if limit in body or (limit == "max_tokens" and self.path.endswith("/messages")):
                body[limit] = 1
        return body


def cache_budget(service: Service) -> float | None:
    """Bytes of the engine's RAM prompt cache (``math.inf``: no limit); None when it is off
    or its size is not known."""
    info = service.engine.info
    if not info.managed or "ram_cache" not in getattr(service.engine, "capabilities", ()):
        return None
    if info.clears_idle_slots is not False:
        return None  # it caches idle slots on its own as well
    mib = info.cache_ram_mib
    extra = list(service.settings.engine.extra_args)
    for flag, value in zip(extra, extra[1:]):
        if flag in ("-cram", "--cache-ram"):
            try:
                mib = int(value)
            except ValueError:
                return None
    if mib is None:
        mib = ENGINE_DEFAULT_MIB
    if mib == 0:
        return None
    return math.inf if mib < 0 else mib * 2**20


def shared_share(held: dict[str, Any] | None, request_signature: dict[str, Any]) -> float | None:
    """The share of ``held``'s prompt (a prompt signature) whose messages the incoming
    prompt repeats from its start, in characters; None when the signatures do not say."""
    if not held or "chain" not in held or "chain" not in request_signature:
        return None
    sizes = held.get("sizes") or []
    tools = held.get("tools_chars", 0)
    total = tools + (sizes[-1] if sizes else 0)
    if total <= 0:
        return None
    shared = shared_links(held["chain"], request_signature["chain"])
    if shared == 0:
        return 0.0
    return (tools + sizes[shared - 1]) / total


@dataclass
class EngineRam:
    """What the engine's RAM cache holds, as auto-sessions left it there. One per service,
    written by :class:`strata_auto_sessions.parking.AutoSessions` alone."""

    budget: float
    #: What the engine cached at the switches auto-sessions left to it, oldest first: a
    #: conversation by its :data:`Ident`, or an unnamed state by a number of its own.
    held: OrderedDict[Ident | int, Left] = field(default_factory=OrderedDict)
    #: False once a conversation believed in RAM was not: every switch parks to disk.
    trusted: bool = True
    _unnamed: int = 0

    def fits(self, tokens: int, bytes_per_token: float) -> bool:
        """Whether a state of ``tokens`` fits beside what the cache holds, within the half."""
        return (tokens + sum(left.tokens for left in self.held.values())) * bytes_per_token \
            <= self.budget * BUDGET_SHARE

    def cached(self, ident: Ident | None, left: Left) -> None:
        """The engine caches the outgoing state ``ident`` (None: unnamed) at this switch.
        An older state of the conversation is dropped (the engine drops a prompt the new
        one contains)."""
        if ident is None:
            self._unnamed += 1
            self.held[self._unnamed] = left
            return
        self.held.pop(ident, None)
        self.held[ident] = left

    def holds(self, ident: Ident) -> bool:
        return self.trusted and ident in self.held

    def take_back(self, ident: Ident) -> int | None:
        """``ident`` goes back into a slot (and leaves the cache): its tokens when left."""
        left = self.held.pop(ident, None)
        return None if left is None else left.tokens

    def came_back(self, ident: Ident, expected: int, reused: int) -> bool:
        """A conversation believed in RAM came back reusing ``reused`` tokens: whether it was
        there. When it was not, belief is given up until the engine restarts."""
        if reused >= REUSED_SHARE * expected:
            return True
        if self.trusted:
            log.warning("[strata] auto sessions: %s was left to the engine's RAM cache with %d tokens, and "
                        "came back reusing %d: it was not there. Every switch parks to disk from now on.",
                        ident[1], expected, reused)
        self.trusted = False
        self.held.clear()
        return False

    def conversations(self) -> list[tuple[Ident, Left]]:
        """The conversations held, newest first."""
        return [(ident, left) for ident, left in reversed(self.held.items()) if isinstance(ident, tuple)]

    def restarted(self) -> None:
        """The engine restarted: its RAM cache is empty, and worth trusting again."""
        self.held.clear()
        self.trusted = True


def leaving_ident(in_slot: SlotState) -> Ident | None:
    if in_slot.key is None or in_slot.empty:
        return None
    return (in_slot.tenant, in_slot.key, in_slot.sibling)


def request_ident(request: StrataRequest, sibling: int = 0) -> Ident | None:
    key = request.conversation_key
    return None if key is None else (request.tenant, key, sibling)
