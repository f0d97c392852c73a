"""The coverage analysis on the installed vLLM's real ``_C_stable_libtorch.abi3.so`` (a file read;
nothing is loaded, no CUDA needed).

The expected numbers are not the analyser's: the calls of get_sm_version_num's PLT stub are
counted again here from ``objdump -d`` (and were counted so in the 0.31-0.33 port map: 23 on hot
paths + 4 on ``.cold`` paths in 0.30/0.31, 4 ``.cold`` ones in 0.32/0.33); the inlined queries of
0.33 are the port map's 21 in 17 functions, plus two calls the compiler merged into a block that
two branches jump to (0xc6d4e0 in ``cutlass_fp4_group_mm``, 0xca5700 in
``cutlass_mxfp4_group_mm``, read by hand from the disassembly: docs/sm-hook.md). 0.34.0's are
0.33's: its 4 PLT calls are the ones ``objdump -d`` shows (the test below) and its inlined queries
sit in the same 16 dispatchers; they were not read by hand.
"""

from __future__ import annotations

import importlib.metadata
import re
import shutil
import subprocess

import pytest

from vllm_dualgpu.kernels import sm_coverage
from vllm_dualgpu.kernels.sm_coverage import ATTR_SYMBOL, SM_SYMBOL
from vllm_dualgpu.kernels.sm_hook import SmHookError, coverage_report, installed_library

pytest.importorskip("capstone", reason="the coverage analysis needs capstone")

VERSION = importlib.metadata.version("vllm")

# vLLM release -> (get_sm_version_num calls through the PLT, inlined device-0 queries, functions)
EXPECTED = {"0.30.0": (27, 0, 0), "0.31.0": (27, 0, 0), "0.32.0": (4, 23, 17), "0.33.0": (4, 23, 17),
            "0.34.0": (4, 23, 17)}

# The dispatchers the port map names for 0.32/0.33 (dispatch_scaled_mm: two instantiations).
DISPATCHERS = {
    "cutlass_scaled_mm", "dispatch_scaled_mm", "cutlass_moe_mm", "cutlass_scaled_mm_azp",
    "cutlass_scaled_fp4_mm", "cutlass_fp4_group_mm", "cutlass_mxfp4_group_mm",
    "get_cutlass_moe_mm_data", "get_cutlass_batched_moe_mm_data",
    "get_cutlass_moe_mm_problem_sizes_from_expert_offsets", "mxfp4_experts_quant",
    "scaled_fp4_quant_out", "scaled_fp4_experts_quant", "silu_and_mul_nvfp4_quant",
    "silu_and_mul_mxfp4_experts_quant", "silu_and_mul_scaled_fp4_experts_quant",
}


@pytest.fixture(scope="module")
def library() -> str:
    try:
        return installed_library()
    except SmHookError as exc:
        pytest.skip(f"no vLLM CUDA library installed: {exc}")


@pytest.fixture(scope="module")
def coverage(library):
    return sm_coverage.analyse(library)


def _name(mangled: str) -> str:
    m = re.match(r"_Z(\d+)", mangled)
    return mangled[m.end() : m.end() + int(m.group(1))] if m else mangled


@pytest.mark.skipif(VERSION not in EXPECTED, reason=f"no expected numbers for vLLM {VERSION}")
def test_queries_and_coverage_of_the_installed_vllm(coverage):
    sm_calls, inlined, functions = EXPECTED[VERSION]
    assert len(coverage.sm_calls) == sm_calls
    assert all(q.route == "plt" for q in coverage.queries)
    assert len(coverage.inlined) == inlined and coverage.functions(coverage.inlined) == functions
    assert len(coverage.minor) == inlined  # each inlined major query has its minor beside it
    assert coverage.covered == coverage.total == sm_calls + inlined
    if inlined:
        assert {_name(q.function) for q in coverage.inlined} == DISPATCHERS
        # The 0.30-style hook alone covers only the calls through get_sm_version_num's slot.
        assert sm_coverage.analyse(coverage.path, hooked=(SM_SYMBOL,)).covered == sm_calls
    assert coverage_report() == "sm hook: " + coverage.line()


@pytest.mark.skipif(shutil.which("readelf") is None, reason="needs readelf")
def test_slots_are_the_jump_slot_relocations_readelf_shows(coverage, library):
    text = subprocess.run(["readelf", "-rW", library], capture_output=True, text=True).stdout
    for symbol in (SM_SYMBOL, ATTR_SYMBOL):
        offsets = [
            int(line.split()[0], 16) for line in text.splitlines()
            if "R_X86_64_JUMP_SLOT" in line and re.search(rf"\s{symbol}(@\S+)?\s", line)
        ]
        assert offsets and coverage.slots[symbol] == tuple(offsets)


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("objdump") is None, reason="needs objdump")
def test_plt_calls_are_the_ones_objdump_shows(coverage, library):
    text = subprocess.run(["objdump", "-d", "--no-show-raw-insn", library], capture_output=True, text=True).stdout
    sites = {
        int(m.group(1), 16)
        for m in re.finditer(rf"^\s+([0-9a-f]+):\s+(?:call|jmp)\s+[0-9a-f]+ <{SM_SYMBOL}@plt>$", text, re.M)
    }
    assert {q.address for q in coverage.sm_calls} == sites
