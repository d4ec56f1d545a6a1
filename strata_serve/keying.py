"""Where a conversation's key is chosen: the ``conversation_key`` hook asked, its answer checked.

The keying plugins answer with a value (:class:`~strata_serve.ConversationKey`, or a plain
``str`` for a key that is a guess from the prompt); the core checks it (1-64 of letters,
digits, ``-`` and ``_``, no ``--``), puts it in the tenant's namespace and hands it back.
This module writes nothing: ``Service.conversation_key`` records the answer on the request
(``conversation_named``; the relay sets ``conversation_key`` from it), and a plugin
returns, it never sets them (``tests/test_layers.py`` holds the code to this).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable

import pluggy

from strata_serve.hook_calls import first_result
from strata_serve.hook_types import ConversationKey, KeyRefused, StrataRequest
from strata_serve.tenants import TENANT_SEPARATOR, tenant_key

log = logging.getLogger("strata_serve.service")

#: What a keying plugin may return: 1-64 of letters, digits, ``-`` and ``_`` (whole string).
KEY_PATTERN = re.compile(r"[A-Za-z0-9_-]{1,64}")

_legacy_warned: list[bool] = []


def choose_key(pm: pluggy.PluginManager, request: StrataRequest, service: object, *,
               order: Iterable[str] = ()) -> ConversationKey | None:
    """The key of ``request``'s conversation, in its tenant's namespace, or None (no key).

    A named tenant's keys are ``<tenant>--<key>``; the unnamed tenant's (the plain
    ``server.api_key``, or no key at all) are the plugin's key as is. A plugin's key may
    not contain ``--``, so neither can reach the other's namespace.

    :raises KeyRefused: when a keying plugin refuses the request's input, or its key
        contains ``--``.
    """
    said_before = request.conversation_named
    answer = first_result(pm, "conversation_key", order=order, passthrough=(KeyRefused,),
                          request=request, service=service)
    if isinstance(answer, ConversationKey):
        key, named = answer.key, answer.named
    else:
        # A plain str is a guess from the prompt, unless its plugin said otherwise the way it
        # did before the hook returned a value: by setting request.conversation_named now.
        key, named = answer, request.conversation_named and not said_before
        if named:
            _warn_legacy()
    if key is None:
        return None
    if not isinstance(key, str) or not KEY_PATTERN.fullmatch(key):
        log.warning("[strata] ignoring conversation key %r: not 1-64 of [A-Za-z0-9_-]", key)
        return None
    if TENANT_SEPARATOR in key:
        # Without this, a key chosen by the client ("alice--s1") would name another
        # tenant's conversation; refused whatever the key's source, tenants or not.
        raise KeyRefused(
            f"the conversation key {key!r} contains {TENANT_SEPARATOR!r}, which is reserved: "
            "it separates a tenant's name from its conversation keys"
        )
    # Tenants never share a key, whichever plugin made it.
    return ConversationKey(tenant_key(request.tenant, key), named=bool(named))


def _warn_legacy() -> None:
    """Once per process: a keying plugin set ``request.conversation_named`` instead of returning it."""
    if _legacy_warned:
        return
    _legacy_warned.append(True)
    log.warning("[strata] a conversation_key plugin set request.conversation_named; return "
                "strata_serve.ConversationKey(key, named=True) instead: the field is the core's to set")
