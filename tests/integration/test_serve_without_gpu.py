"""``vllm serve ... --distributed-executor-backend dualgpu`` on a machine where NVML sees no
NVIDIA GPU (no driver, no card): the plugin's one line says so and names ``vllm-dualgpu doctor``,
instead of vLLM's traceback ending in "Failed to infer device type".

Through the real ``vllm serve`` command line in a subprocess, with no device chosen for vLLM
(no VLLM_TARGET_DEVICE): what a user without a GPU meets. Skipped where NVML sees a GPU.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_dualgpu.engine import no_gpu


def _vllm() -> list[str]:
    script = Path(sys.executable).with_name("vllm")
    return [str(script)] if script.exists() else [sys.executable, "-m", "vllm.entrypoints.cli.main"]


@pytest.mark.slow
def test_serve_without_a_gpu_says_so_first_and_names_doctor(tiny_model_dir):
    if no_gpu.nvml_sees_no_gpu() is None:
        pytest.skip("NVML sees a GPU here")
    env = {k: v for k, v in os.environ.items() if k not in ("VLLM_TARGET_DEVICE", "VLLM_LOGGING_LEVEL")}
    env["HF_HUB_OFFLINE"] = "1"
    p = subprocess.run([*_vllm(), "serve", str(tiny_model_dir), "-pp", "2", "--distributed-executor-backend",
                        "dualgpu", "--port", "18139"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                       text=True, env=env, timeout=240, start_new_session=True)
    out = p.stdout
    assert p.returncode != 0, out[-3000:]
    lines = out.rstrip().splitlines()
    # vLLM 0.30 starts a line with its level; 0.33 prefixes the process, "(APIServer pid=N) ERROR"
    ours = [i for i, line in enumerate(lines) if re.match(r"(\(\S+ pid=\d+\) )?ERROR ", line)]
    assert ours, out[-3000:]
    first = lines[ours[0]]
    assert "no NVIDIA GPU" in first and "vllm-dualgpu doctor" in first, first
    assert "Traceback" not in out and "Failed to infer device type" not in out, out[-3000:]
    assert lines[-1] == first  # nothing after it
