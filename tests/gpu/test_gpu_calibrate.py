"""`vllm-dualgpu calibrate` on the GPUs here: the profile it writes names every visible GPU, and
each card's measured read bandwidth is between 0.3x and 1.1x its datasheet figure (a pass that
times nothing, or a figure off by a unit, falls outside)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from gpu_harness import child_env, gpu_out, needs_gpus  # noqa: F401


@needs_gpus(1)
def test_calibrate_measures_every_visible_gpu(tmp_path, gpu_out, record_property):
    import pynvml

    out = tmp_path / "machine-profile.json"
    run = subprocess.run([sys.executable, "-m", "vllm_dualgpu.cli", "calibrate", "--output", str(out),
                          "--seconds", "2", "--no-progress"],
                         env=child_env(), capture_output=True, text=True, timeout=300)
    (gpu_out / "calibrate.log").write_text(run.stdout + run.stderr)
    assert run.returncode == 0, run.stdout + run.stderr
    assert out.is_file(), f"calibrate wrote no {out}"
    profile = json.loads(out.read_text())

    pynvml.nvmlInit()
    try:
        handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
        seen = {pynvml.nvmlDeviceGetUUID(h) for h in handles}
    finally:
        pynvml.nvmlShutdown()
    seen = {u.decode() if isinstance(u, bytes) else u for u in seen}
    named = [g["uuid"] for g in profile["gpus"]]
    assert named and len(set(named)) == len(named), profile
    if os.environ.get("CUDA_VISIBLE_DEVICES"):  # some of NVML's cards, each once
        assert set(named) <= seen
    else:
        assert set(named) == seen, f"the profile names {named}; NVML sees {sorted(seen)}"
    for g in profile["gpus"]:
        record_property(f"read_gbps {g['name']}", g["read_gbps"])
        assert g["datasheet_gbps"], f"{g['name']}: no datasheet or NVML figure to compare with"
        ratio = g["read_gbps"] / g["datasheet_gbps"]
        assert 0.3 <= ratio <= 1.1, (f"{g['name']}: read {g['read_gbps']:,.0f} GB/s is {ratio:.2f}x its "
                                     f"datasheet {g['datasheet_gbps']:,.0f} GB/s")
        assert g["copy_gbps"] > 0
