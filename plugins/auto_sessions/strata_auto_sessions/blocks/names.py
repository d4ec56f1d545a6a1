"""Block names: a hash chained over every token before a block and its own, salted.

A block's name is ``H(parent's name, its tokens)``, and the first block's parent is a
root named by everything that makes two states incompatible: the state format's version,
the model's fingerprint, the engine's state layout (cache types, attention kernel, as
the format writes it down) and the tenant. Two conversations that share an opening
therefore share its blocks' names; two tenants, two models or two layouts never do.
(vLLM's prefix caching names its KV blocks the same way: parent hash, token ids, and a
per-tenant salt.)
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

__all__ = ["chain_names", "root_name", "token_bytes"]

#: Changes when names would be computed another way.
NAMES_VERSION = 1


def root_name(*, format_version: str, fingerprint: Mapping[str, Any], layout: bytes, tenant: str | None) -> str:
    """The name every chain of one (format, model, layout, tenant) starts from."""
    salt = json.dumps(
        {"names": NAMES_VERSION, "format": format_version, "model": dict(fingerprint),
         "layout": hashlib.sha256(layout).hexdigest(), "tenant": tenant},
        sort_keys=True, separators=(",", ":"), default=str,
    )
    return hashlib.sha256(b"strata-blocks\0" + salt.encode()).hexdigest()


def token_bytes(tokens: Sequence[int]) -> bytes:
    return struct.pack(f"<{len(tokens)}i", *tokens)


def chain_names(root: str, tokens: Sequence[int], block_tokens: int) -> Iterator[str]:
    """The names of the whole blocks of ``tokens``, first to last (lazily: a walk stops at
    its first miss without hashing the rest)."""
    parent = bytes.fromhex(root)
    for start in range(0, len(tokens) - block_tokens + 1, block_tokens):
        name = hashlib.sha256(parent + token_bytes(tokens[start:start + block_tokens])).digest()
        yield name.hex()
        parent = name
