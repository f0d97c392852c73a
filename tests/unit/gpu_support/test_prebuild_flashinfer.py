"""scripts/gpu/prebuild_flashinfer.py through the shell: the modules it builds are the ones the
headline's workers built on the GPU (their "Building JIT module" lines in the thirteenth session's
committed log, and the top-k the DFlash2 runs built in the twenty-third session), so a worker finds
them built instead of building them inside an arm's limit."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = ROOT / "scripts" / "gpu" / "prebuild_flashinfer.py"
LOG = ROOT / "benchmarks" / "results" / "2026-12-02-headline-virtual-run4" / "logs" / "fp8-mtp_expert.log"
# the DFlash2 drafter's candidate selector (vLLM's get_top_k_tokens) built FlashInfer's top-k there
TOPK_LOG = ROOT / "benchmarks" / "results" / "2026-12-03-virtual-pair-vllm-0.33" / "10-identity-and-dflash2-lines.txt"
LOGGED_WITH = "0.7.2.post1"  # the FlashInfer that vLLM 0.33.0 ran with there


def test_it_builds_the_modules_the_workers_built(tmp_path):
    torch = pytest.importorskip("torch", reason="torch not installed")
    if torch.version.cuda is None:  # FlashInfer's import asks torch.cuda for the GPU's properties
        pytest.skip(f"torch {torch.__version__} is a CPU build: FlashInfer does not import with it")
    flashinfer = pytest.importorskip("flashinfer", reason="FlashInfer not installed (vLLM's CUDA dependency)")
    if getattr(flashinfer, "__version__", None) != LOGGED_WITH:
        pytest.skip(f"FlashInfer {getattr(flashinfer, '__version__', '?')} here; the log is of {LOGGED_WITH}, "
                    "whose module names this compares")
    env = {**os.environ, "FLASHINFER_WORKSPACE_BASE": str(tmp_path)}
    env.pop("FLASHINFER_CUDA_ARCH_LIST", None)
    r = subprocess.run([sys.executable, str(SCRIPT), "--list"], env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    listed = r.stdout.split()
    built = set(re.findall(r"Building JIT module (batch_\w+);", LOG.read_text()))
    assert len(built) == 2 and built <= set(listed), (built, listed)
    topk = set(re.findall(r"Building JIT module (\w+);", TOPK_LOG.read_text()))
    assert topk == {"topk"} and listed[0] == "topk", (topk, listed)  # first: the DFlash2 runs wait on it
    # runs on torch's top-k leave it out, and only it
    r = subprocess.run([sys.executable, str(SCRIPT), "--list", "--no-topk"], env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == listed[1:], (r.stdout, listed)
