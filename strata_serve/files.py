"""Files that hold conversations: private to the user running strata-serve."""

from __future__ import annotations

import logging
import os
from pathlib import Path

log = logging.getLogger("strata_serve")

#: Slot files hold what was said in a conversation: only their owner may list or read them.
PRIVATE_DIR_MODE = 0o700
PRIVATE_FILE_MODE = 0o600


def make_private_dir(path: Path) -> None:
    """Create ``path`` (and missing parents) with the directory itself at 0700, whatever the umask.

    A directory that exists already is the user's choice and is left as it is (it may
    be a shared place such as /tmp); one that others can enter is warned about.
    """
    path = Path(path)
    try:
        path.mkdir(mode=PRIVATE_DIR_MODE, parents=True)
    except FileExistsError:
        try:
            mode = path.stat().st_mode & 0o777
        except OSError:
            return
        if mode & 0o077:
            log.warning("[strata] %s is open to other users (mode %03o) and slot files hold conversations; "
                        "chmod 700 it", path, mode)
        return
    # mkdir's mode passes through the umask; chmod does not.
    os.chmod(path, PRIVATE_DIR_MODE)
