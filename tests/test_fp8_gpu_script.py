"""scripts/gpu/tune_and_bench_fp8.py without a GPU: --dry-run and --unpack."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from vllm_dualgpu.kernels import fp8_configs as fc
from vllm_dualgpu.kernels import fp8_tuner as ft

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu" / "tune_and_bench_fp8.py"


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "VLLM_TARGET_DEVICE": "cpu"}, cwd=ROOT)


def test_dry_run_prints_the_plan_and_checks_vllm(tmp_path):
    r = run(str(tmp_path / "out"), "--dry-run", "--jobs", "12", "--budget", "300")
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout
    for N, K in [(14336, 5120), (16384, 5120), (34816, 5120), (5120, 17408), (5120, 6144)]:
        assert str(tmp_path / "out" / "configs" / fc.config_file_name(N, K, "NVIDIA_H200")) in out
        assert f"bench N={N},K={K}:" in out
    assert "batch sizes 1,8,16,32,64,128,256,512,1024,2048,4096" in out
    assert "signature: OK" in out
    assert "patch fp8-configs-per-rank: applied" in out and "patch sm89-triton-fp8: applied" in out
    assert "12 processes" in out
    assert not (tmp_path / "out").exists()


def test_unpack_writes_the_bundled_files(tmp_path):
    files = sorted((ROOT / "kernel_configs").glob("N=*.json"))
    bundle = tmp_path / "fp8_configs.json"
    bundle.write_text(json.dumps(ft.bundle_config_files(files)))
    r = run(str(tmp_path), "--unpack", str(tmp_path / "dest"))
    assert r.returncode == 0, r.stderr
    for f in files:
        assert (tmp_path / "dest" / f.name).read_bytes() == f.read_bytes()
