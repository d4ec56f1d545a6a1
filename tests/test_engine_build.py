"""How the Makefile builds and installs the engine, checked whatever CPU runs the tests.

``tests/test_quantized.py`` disassembles the engine built here; on a CPU without AMX a
native build holds none anyway, so that check alone cannot tell whether the build
flags still remove it. These ask the compiler and ``make`` directly.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

#: Compiles only where none of AMX's parts is enabled.
NO_AMX = """
#if defined(__AMX_TILE__) || defined(__AMX_INT8__) || defined(__AMX_BF16__)
#error AMX is enabled
#endif
"""


def make_variable(name: str) -> str:
    """A variable as the Makefile computes it."""
    result = subprocess.run(["make", "-s", "--no-print-directory", "--eval", f"print-var: ; @echo $({name})",
                             "print-var"], cwd=ROOT, capture_output=True, text=True, timeout=60, check=True)
    return result.stdout.strip()


def compiles(tmp_path: Path, flags: list[str]) -> bool:
    source = tmp_path / "probe.c"
    source.write_text(NO_AMX)
    result = subprocess.run(["cc", *flags, "-c", str(source), "-o", str(tmp_path / "probe.o")],
                            capture_output=True, text=True, timeout=60)
    return result.returncode == 0


def test_the_build_flags_turn_amx_off_on_a_cpu_that_has_it(tmp_path):
    """On a CPU that advertises AMX (Sapphire Rapids), ``-march`` for it with the
    Makefile's flags, in either order, leaves AMX off; without them it is on (the
    control: the probe does see AMX)."""
    flags = make_variable("ENGINE_CFLAGS").split()
    assert flags, "the Makefile passes no flags of its own to the engine's build"
    assert "-DGGML_NATIVE=ON" in make_variable("ENGINE_CMAKE_ARGS"), "the build keeps this CPU's SIMD"
    cpu = "-march=sapphirerapids"
    assert not compiles(tmp_path, [cpu]), "the compiler enables AMX for this CPU: the probe must see it"
    assert compiles(tmp_path, [cpu, *flags])
    assert compiles(tmp_path, [*flags, cpu])


def test_an_engine_built_with_other_flags_is_rebuilt_and_reinstalled(tmp_path):
    """pip caches a built wheel by version alone; the Makefile keys its wheelhouse and the
    venv's stamp by the build flags, so a venv whose engine was built with other flags
    (the old, AMX-enabled ones) gets a fresh build installed over it."""
    key = make_variable("ENGINE_KEY")
    assert (ROOT / ".venv" / f".engine-{key}").exists(), "make setup installed the engine of these flags"
    # As the engine is: nothing to do (a dry run of the set-up touches neither).
    now = subprocess.run(["make", "-n", "setup"], cwd=ROOT, capture_output=True, text=True, timeout=120, check=True)
    assert "pip wheel" not in now.stdout and "--force-reinstall" not in now.stdout, now.stdout
    # With other flags: another key, a build of its own, installed over the old engine.
    other = subprocess.run(["make", "-n", "setup", "ENGINE_CFLAGS=-O1"], cwd=ROOT, capture_output=True,
                           text=True, timeout=120, check=True)
    assert "pip wheel" in other.stdout and "--no-cache-dir" in other.stdout, other.stdout
    assert "--force-reinstall" in other.stdout, other.stdout
    assert f"engine-{key}" not in other.stdout, "the other flags get a wheelhouse of their own"


@pytest.fixture(autouse=True)
def _tools():
    for tool in ("make", "cc"):
        assert shutil.which(tool), f"{tool} is needed to build the engine"
