"""The names of auto-sessions' files in the slot directory, and a key's name in them.

Only files named here are ever touched: ``auto-<name>.bin`` with an ``auto-<name>.json``
sidecar that names the same key, the key's further siblings (other conversations under
the same key) ``auto-<name>.<n>.bin`` and ``.json`` (``n`` from 1, named in their sidecar
too), and ``tmp-auto-<name>-<8 hex>.bin|json`` temporaries,
where ``<name>`` is :func:`file_key` of the key. The core refuses ``/slots`` names that
begin with ``auto-`` or ``tmp-``, and a file without our sidecar is not ours, so a file
saved by hand (under any name, by this version or an older one) is never listed,
pruned or read.

``<name>`` is the key with each upper-case letter written ``+`` and its lower case
(``MyChat`` -> ``+my+chat``): two keys that differ only by case get two files on a
case-insensitive file system (macOS) too.
"""

from __future__ import annotations

import re
import uuid

PREFIX = "auto-"
TEMP_PREFIX = "tmp-auto-"
#: A key as written in a file name: no upper case, ``+x`` for ``X``.
_FILE_KEY = r"(?:[a-z0-9_-]|\+[a-z])+"
#: A sibling's number in a file name: none for the first (0), then ``.1``, ``.2``...
_SIBLING = r"(?:\.(?P<sibling>[1-9][0-9]{0,5}))?"
SESSION_NAME = re.compile(rf"{PREFIX}(?P<key>{_FILE_KEY}){_SIBLING}\.(?P<ext>bin|json)")
#: A temporary: a file being written, an upload's hard link, or a block a fetch brought
#: (``.<its name's first 8 hex digits>.blk``) before it is put in the block store.
TEMP_NAME = re.compile(rf"{TEMP_PREFIX}[a-z0-9_+-]+\.(?:bin|json|[0-9a-f]{{8}}\.blk)")
#: The store's own files, under names no key can take (a key has no ``.``): the sessions
#: removed by hand while a server may hold them, what the running engine is (for
#: ``strata-serve sessions ls``), the conversations the running server holds in its slots
#: (for ``strata-serve sessions rm``), and the lock the running server holds for its
#: lifetime (one server per directory).
REMOVED_NAME = f"{PREFIX}.removed.json"
ENGINE_NAME = f"{PREFIX}.engine.json"
HELD_NAME = f"{PREFIX}.held.json"
SERVER_LOCK_NAME = f"{PREFIX}.server.json"


def file_key(key: str) -> str:
    """``key`` as written in a file name, the same under case folding only for the same key.

    :raises ValueError: for a key strata-serve would never make (outside ``[A-Za-z0-9_-]``).
    """
    if not re.fullmatch(r"[A-Za-z0-9_-]+", key):
        raise ValueError(f"not a conversation key: {key!r}")
    return "".join(f"+{char.lower()}" if "A" <= char <= "Z" else char for char in key)


def key_of_file(name: str) -> str:
    """The key :func:`file_key` wrote as ``name``."""
    return re.sub(r"\+([a-z])", lambda match: match.group(1).upper(), name)


def session_name(key: str, ext: str, sibling: int = 0) -> str:
    """The name of the conversation's state file (``ext`` ``"bin"``) or sidecar (``"json"``);
    ``sibling`` names another conversation under the same key (the first, 0, has the plain name)."""
    return f"{PREFIX}{file_key(key)}{f'.{sibling}' if sibling else ''}.{ext}"


def sibling_of(match: re.Match[str]) -> int:
    """The sibling a :data:`SESSION_NAME` match names (0: the plain name)."""
    return int(match["sibling"] or 0)


def sibling_name(name: str, sibling: int) -> str:
    """The state file of another sibling of the key conversation file ``name`` names
    (``auto-x.bin``, 2 -> ``auto-x.2.bin``).

    :raises ValueError: when ``name`` is not a conversation file's name.
    """
    match = SESSION_NAME.fullmatch(name)
    if match is None:
        raise ValueError(f"not a conversation file: {name!r}")
    return f"{PREFIX}{match['key']}{f'.{sibling}' if sibling else ''}.bin"


def fresh_temp_name(key: str, suffix: str) -> str:
    """A fresh temporary's name for the conversation's ``.bin`` or ``.json`` (``suffix``)."""
    return f"{TEMP_PREFIX}{file_key(key)}-{uuid.uuid4().hex[:8]}{suffix}"


def fresh_json_temp_name() -> str:
    """A fresh temporary's name for one of the store's own JSON files."""
    return f"{TEMP_PREFIX}{uuid.uuid4().hex[:8]}.json"
