"""The side lane: small requests run in a second slot, beside the main conversation.

With ``engine.side_slot_tokens`` set (0 by default: one slot), the engine runs two slots over one KV pool (see
``engine/llama_server/command.py``): slot :data:`MAIN` holds the conversation a one-slot
engine would hold, slot :data:`SIDE` takes the requests that fit beside it (a chat UI's
title, tags and follow-ups, an agent's session title, a one-token probe), so the main
conversation never leaves its slot for them.

What fits is decided from the request's size alone, with no call to the engine: its
body's bytes (JSON as sent, plus :data:`TEMPLATE_ALLOWANCE` for the chat template's own
tokens) bound its prompt's tokens, since every token the engine reads from text holds at
least one byte of it. It fits when that bound, plus at least :data:`MIN_GENERATION`
tokens to answer, is within the room the main slot leaves in the pool. Its generation is
then bounded to what is left (its ``max_tokens`` lowered, never raised), so the pool
never fills while it runs and the engine never purges the idle main slot. A request
that does not fit goes to the main slot as on a one-slot engine: its conversation is
parked, the request runs, the main conversation is restored when it returns.
"""

from __future__ import annotations

import json
from typing import Any

from strata_serve.config import EngineSettings
from strata_serve.hook_types import StrataRequest
from strata_serve.slot_state import SlotRegistry

#: The main conversation's slot, and the side slot.
MAIN, SIDE = 0, 1
#: Tokens a chat template may add that are not in the request's bytes (its role markers,
#: a default system prompt, its words around the tools).
TEMPLATE_ALLOWANCE = 256
#: A request is sent to the side slot only with room to answer at least this much.
MIN_GENERATION = 16


def pool_tokens(settings: EngineSettings) -> int:
    """Tokens the engine's one KV pool holds, both slots together."""
    return settings.ctx_size + settings.side_slot_tokens


def prompt_bound(request: StrataRequest) -> int | None:
    """An upper bound on the tokens of ``request``'s prompt; None: none can be told from its size.

    None for an API that does not declare how its generation is bounded
    (``Api.generation_limit``), and for a body that may hold media: an image's tokens
    are not bounded by its bytes.
    """
    api = request.api
    if api is None or not api.generation_limit:
        return None
    raw = json.dumps(request.body).encode()
    if api.media and api.media_words.search(raw):
        return None
    return len(raw) + TEMPLATE_ALLOWANCE


def room(settings: EngineSettings, slots: SlotRegistry) -> int | None:
    """Tokens the side slot may hold while the main slot holds what it does (None: not known)."""
    held = slots[MAIN].tokens
    if held is None:
        return None
    return pool_tokens(settings) - held


def choose_lane(settings: EngineSettings, slots: SlotRegistry, request: StrataRequest) -> tuple[int, int | None]:
    """The slot for ``request`` and the most it may generate there (None: no bound of ours).

    The main slot's conversation stays there; a conversation the side slot holds stays
    there while it fits; an empty or nameless main slot is taken first (displacing it
    costs nothing); any other request goes to the side slot when it fits, else to the
    main slot.
    """
    key, tenant = request.conversation_key, request.tenant

    def holds(slot: int) -> bool:
        state = slots[slot]
        return key is not None and state.key == key and state.tenant == tenant and not state.empty

    if holds(MAIN):
        return MAIN, None
    bound, left = prompt_bound(request), room(settings, slots)
    fits = bound is not None and left is not None and left - bound >= MIN_GENERATION
    if holds(SIDE):
        return (SIDE, left - bound) if fits else (MAIN, None)  # type: ignore[operator]
    main = slots[MAIN]
    if main.empty or (main.key is None and main.tokens is not None):
        return MAIN, None
    return (SIDE, left - bound) if fits else (MAIN, None)  # type: ignore[operator]


def bound_generation(request: StrataRequest, limit: int) -> bool:
    """Lower ``request``'s generation limit to ``limit`` tokens; True when it was lowered.

    Each field of its API's ``generation_limit`` the body sets above ``limit`` (or to
    -1, "until the context is full") is lowered; with none set, the first is set.
    """
    assert request.api is not None
    body: dict[str, Any] = request.body
    fields = request.api.generation_limit
    lowered = False
    present = [name for name in fields if isinstance(body.get(name), int) and not isinstance(body.get(name), bool)]
    for name in present:
        if body[name] < 0 or body[name] > limit:
            body[name] = limit
            lowered = True
    if not present:
        body[fields[0]] = limit
        lowered = True
    return lowered
