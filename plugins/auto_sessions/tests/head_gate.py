"""A test plugin for the race of two replicas (test_shared_replicas.py): the shared tier
the config names, with each upload's head write held, while the gate is armed, until
every replica racing for that head has reached it.

Two replicas saving the same turn at once do not, on their own, reach the head at the
same moment: most runs, one upload lands before the other reads the head, and the
second drops itself on the generation alone. Held at the gate, both have read the same
head and written their objects before either writes it, so the race is the one the
compare-and-swap decides, every run.

It is loaded into the replicas' own processes through its entry point
(:func:`install`: a distribution's metadata and this module, in a directory the test
puts on ``PYTHONPATH``), and it reads its gate from ``STRATA_TEST_HEAD_GATE``: a
directory where each replica leaves a file when it reaches a head, armed while it holds
a file named ``armed`` that says how many must meet.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any

import strata_serve

from strata_auto_sessions.shared import Head, SharedTier, tier_for

GATE_VARIABLE = "STRATA_TEST_HEAD_GATE"
NAME = "head_gate"
#: How long a replica waits at the gate for the others before it goes on alone.
WAIT_S = 20.0
log = logging.getLogger("strata_auto_sessions")


class GatedTier:
    """``tier``, its uploads' head writes held at ``gate`` while it is armed."""

    def __init__(self, tier: SharedTier, gate: Path):
        self.tier, self.gate = tier, gate
        self.where = tier.where

    def __getattr__(self, name: str) -> Any:
        return getattr(self.tier, name)

    async def put_head(self, name: str, head: Head, expect: str | None) -> str:
        if head.upload is not None:  # an upload's head: not a removal, not the start check's probe
            await self._meet(name)
        return await self.tier.put_head(name, head, expect)

    async def _meet(self, name: str) -> None:
        armed = self.gate / "armed"
        try:
            writers = int(await asyncio.to_thread(armed.read_text))
        except (OSError, ValueError):
            return
        arrival = self.gate / f"{name}.{os.getpid()}"
        await asyncio.to_thread(arrival.write_text, "")
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:
            arrived = await asyncio.to_thread(lambda: len(list(self.gate.glob(f"{name}.*"))))
            if arrived >= writers:
                log.info("[strata] head gate: %s: %d writers met", name, arrived)
                return
            await asyncio.sleep(0.01)
        log.info("[strata] head gate: %s: went on alone after %g s", name, WAIT_S)


@strata_serve.hookimpl(optionalhook=True)
def auto_sessions_shared_tier(config: Any) -> SharedTier | None:
    gate = os.environ.get(GATE_VARIABLE)
    if not gate:
        return None
    return GatedTier(tier_for(config), Path(gate))


def install(site: Path) -> Path:
    """This module and a distribution naming it as a strata_serve plugin, in ``site``: a
    directory for ``PYTHONPATH``."""
    site.mkdir(parents=True, exist_ok=True)
    shutil.copy(__file__, site / f"strata_test_{NAME}.py")
    info = site / f"strata_test_{NAME}-0.0.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: strata-test-{NAME.replace('_', '-')}\n"
                                   "Version: 0.0.0\n")
    (info / "entry_points.txt").write_text(f"[strata_serve]\n{NAME} = strata_test_{NAME}\n")
    return site
