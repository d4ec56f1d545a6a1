"""Quantized models on this machine's engine, and the engine's CPU code.

The engine once died of SIGILL on the first request to any quantized model: it was
built with the compiler's native flags on a CPU that advertises AMX, and the machine
refused AMX instructions. F16 models never reach that code. Here Q4_0 and Q8_0 models,
made with the engine's own ``llama-quantize`` from a demo model, run through a switch
and back with auto-sessions parking, and the engine's CPU library is checked for AMX
instructions (see docs/engine-build.md).
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import subprocess
from pathlib import Path

import gguf
import pytest

import strata_auto_sessions
from strata_serve.demo_model import write_demo_model
from strata_serve.engine.llama_server import ENGINE_DISTRIBUTION, library_dirs, packaged_binary
from strata_serve.testing import conversation
from tests.parked_state import (
    TOLERANCE,
    WRONG_STATE_DISTANCE,
    logprob_distance,
    reordered,
    replayed_answer,
    switch_and_back,
    text_of,
    wrong_state_answer,
)

KINDS = {"Q4_0": gguf.GGMLQuantizationType.Q4_0, "Q8_0": gguf.GGMLQuantizationType.Q8_0}
MAX_TOKENS = 6
#: AMX instructions (Intel SDM, "Intel AMX"): tile configuration, loads, stores, dot products.
AMX_INSTRUCTION = re.compile(r"\s(ldtilecfg|sttilecfg|tilerelease|tilezero|tileloadd\w*|tilestored|tdp\w+)\s")


def engine_tool(name: str) -> Path:
    """A program of the installed engine package (built beside llama-server), found by its metadata."""
    dist = importlib.metadata.distribution(ENGINE_DISTRIBUTION)
    for file in dist.files or []:
        if file.name == name and file.parent.name == "bin":
            return Path(dist.locate_file(file))
    pytest.fail(f"{name} is not in the {ENGINE_DISTRIBUTION} package (`make setup` installs it)")


def engine_env() -> dict[str, str]:
    binary = packaged_binary()
    assert binary is not None, f"the {ENGINE_DISTRIBUTION} package is not installed"
    return {**os.environ, "LD_LIBRARY_PATH": os.pathsep.join(str(d) for d in library_dirs(binary))}


@pytest.fixture(scope="session")
def quantized_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    work = tmp_path_factory.mktemp("quantized")
    f16 = write_demo_model(work / "quant-F16.gguf", size="quant")
    models = {}
    for kind in KINDS:
        out = work / f"quant-{kind}.gguf"
        done = subprocess.run([str(engine_tool("llama-quantize")), str(f16), str(out), kind],
                              env=engine_env(), capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
        models[kind] = out
    return models


@pytest.mark.parametrize("kind", KINDS)
def test_llama_quantize_writes_the_kind_asked(quantized_models, kind):
    reader = gguf.GGUFReader(quantized_models[kind])
    types = {t.name: t.tensor_type for t in reader.tensors}
    matmul_weights = [name for name in types
                      if re.fullmatch(r"blk\.\d+\.(attn_(q|k|v|output)|ffn_(gate|up|down))\.weight", name)]
    assert len(matmul_weights) == 2 * 7
    assert {types[name] for name in matmul_weights} == {KINDS[kind]}


@pytest.mark.parametrize("kind", KINDS)
async def test_quantized_model_switch_and_back_reuses_its_parked_state(
    kind, quantized_models, strata_client_factory, strata_settings_factory, llama_server_factory
):
    model = quantized_models[kind]
    settings = strata_settings_factory(engine={"model": str(model)}, plugins={"auto_sessions": {"min_tokens": 100}})
    client = await strata_client_factory(strata_auto_sessions, settings=settings)
    a, b = conversation("alpha"), conversation("beta")
    a2, back = await switch_and_back(client, a, b, MAX_TOKENS)

    fresh = await llama_server_factory(model=model)
    reference = await replayed_answer(fresh, a, a2, MAX_TOKENS)
    assert text_of(back) == text_of(reference)
    assert logprob_distance(back, reference) <= TOLERANCE

    wrong = await wrong_state_answer(fresh, fresh.info.slot_save_path, a, reordered(a), a2, MAX_TOKENS)
    assert logprob_distance(wrong, reference) > WRONG_STATE_DISTANCE


def disassembly(compiled: Path) -> str:
    return subprocess.run(["objdump", "-d", "--no-show-raw-insn", str(compiled)],
                          capture_output=True, text=True, timeout=300, check=True).stdout


def amx_instructions(listing: str) -> set[str]:
    return {match.group(1) for match in AMX_INSTRUCTION.finditer(listing)}


def test_the_engine_has_no_amx_code_and_keeps_the_cpus_simd(tmp_path):
    """No AMX instruction in the engine's CPU code, whatever this CPU advertises.

    With AMX compiled in, ggml's AMX kernels (chosen for quantized weights) are there
    to be run, and a machine that refuses AMX kills the engine with SIGILL.
    """
    binary = packaged_binary()
    assert binary is not None
    libraries = [p for p in binary.resolve().parent.iterdir()
                 if p.name.startswith("libggml-cpu") and not p.is_symlink()]
    assert libraries, "no CPU backend library beside the engine"

    # The search finds AMX where it is: a function compiled with AMX enabled.
    probe = tmp_path / "probe.c"
    probe.write_text("#include <immintrin.h>\nvoid strata_probe(void) { _tile_zero(0); _tile_release(); }\n")
    subprocess.run(["cc", "-O2", "-mamx-tile", "-c", str(probe), "-o", str(tmp_path / "probe.o")],
                   check=True, timeout=60)
    assert amx_instructions(disassembly(tmp_path / "probe.o")) == {"tilezero", "tilerelease"}

    cpu_flags = set(re.search(r"^flags\s*:(.*)$", Path("/proc/cpuinfo").read_text(), re.M).group(1).split())
    for library in libraries:
        code = disassembly(library)
        assert amx_instructions(code) == set(), f"{library.name} holds AMX instructions"
        # Native flags minus AMX keep the vector units this CPU has.
        if "avx512f" in cpu_flags:
            assert "%zmm" in code, f"{library.name} does not use AVX-512 on a CPU that has it"
        if "avx2" in cpu_flags:
            assert "%ymm" in code, f"{library.name} does not use AVX2 on a CPU that has it"
