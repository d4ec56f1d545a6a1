"""What a request's prompt is made of, and whether a later prompt continues a saved one."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from strata_serve import StrataRequest, prompt_units

from strata_auto_sessions.prefix import message_chain


def _digest(units: list[Any] | str) -> str:
    data = units if isinstance(units, str) else json.dumps(units, sort_keys=True, ensure_ascii=False)
    return hashlib.blake2b(data.encode("utf-8", "replace"), digest_size=16).hexdigest()


def prompt_signature(request: StrataRequest) -> dict[str, Any]:
    """How many units (messages, or characters of a prompt) a request had, as its API
    declares them (:func:`strata_serve.prompt_units`), and their digest; for messages,
    their chain too (:func:`strata_auto_sessions.prefix.message_chain`)."""
    units = prompt_units(request)
    signature: dict[str, Any] = {"units": len(units), "digest": _digest(units)}
    if isinstance(units, list):
        signature.update(message_chain(request.body, units))
        tools = request.body.get("tools")
        # the characters of the tools, which the chain's sizes leave out
        signature["tools_chars"] = len(json.dumps(tools, ensure_ascii=False)) if tools else 0
    return signature


def continues(saved: dict[str, Any] | None, request: StrataRequest) -> bool:
    """Whether a request's prompt starts with what the saved state was made from.

    Only then is a restore that goes unused evidence about the engine; otherwise the
    conversation changed (an edited message, another conversation with the same key).
    """
    if not saved or not isinstance(saved.get("units"), int):
        return False
    units = prompt_units(request)
    return len(units) >= saved["units"] and _digest(units[: saved["units"]]) == saved.get("digest")
