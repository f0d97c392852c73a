"""With a machine profile (`vllm-dualgpu calibrate`'s measured bandwidths) `plan` and the executor
still give the same answer: the same cards' figures (plan matches `--gpus` names, the executor
NVML UUIDs), the same split, pool and predicted decode, and the same words about the profile
(test_plan_matches_executor.py holds the two requests together without one)."""

from __future__ import annotations

import json

import pytest
from plan_match import executor_plan, forget_the_split, sandbox
from test_plan_matches_executor import DENSE  # the same dense model as the TP-1 test

from vllm_dualgpu.cli import main
from vllm_dualgpu.envs import MACHINE_PROFILE
from vllm_dualgpu.nvml import VisibleGpu
from vllm_dualgpu.planner import parse_gpus

GPUS = "RTX 4070 Ti SUPER:16GiB:15GiB,RTX 5090:32GiB:30GiB"
NVML_NAMES = ["NVIDIA GeForce RTX 4070 Ti SUPER", "NVIDIA GeForce RTX 5090"]
SERVE = {"max_model_len": 32768, "max_num_seqs": 8, "max_num_batched_tokens": 4096,
         "kv_cache_dtype": "fp8", "mamba_ssm_cache_dtype": "float32"}  # CPU platform: see the TP-1 test
# Hand-written: the 5090 reaches far less than its datasheet, the 4070 Ti SUPER nearly all of it.
MEASURED = [650.0, 700.0]
PROFILE = {
    "schema": 1, "created": "2026-05-02T08:30:00+00:00", "torch": "2.9.0", "vllm": "0.33.0",
    "gpus": [{"uuid": f"GPU-{i}", "name": NVML_NAMES[i], "pci_bus_id": f"00000000:0{i + 1}:00.0",
              "total_bytes": t, "datasheet_gbps": d, "read_gbps": MEASURED[i], "copy_gbps": MEASURED[i] * 0.9}
             for i, (t, d) in enumerate([(16 * 1024**3, 672), (32 * 1024**3, 1792)])],
}



@pytest.fixture
def model_dir(tmp_path, monkeypatch):
    yield from sandbox(tmp_path, monkeypatch, DENSE, "model")


def plan_json(model_dir, capsys) -> dict:
    argv = ["plan", str(model_dir), "--gpus", GPUS, "--json"]
    for k, v in SERVE.items():
        argv += [f"--{k.replace('_', '-')}", str(v)]
    capsys.readouterr()  # what vLLM printed before
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


def executor_apply(model_dir, monkeypatch):
    # NVML reports the cards the --gpus line describes, with NVML's names and UUIDs
    seen = [VisibleGpu(g.index, NVML_NAMES[g.index], g.total_bytes, g.free_bytes, g.capability, g.bandwidth_gbps,
                       f"GPU-{g.index}") for g in parse_gpus(GPUS)]
    _, applied, messages = executor_plan(model_dir, monkeypatch, SERVE, seen)
    return applied.plan, messages


def test_plan_and_executor_agree_with_a_profile(model_dir, capsys, monkeypatch):
    profile = model_dir.parent / "machine-profile.json"
    profile.write_text(json.dumps(PROFILE))
    without, _ = executor_apply(model_dir, monkeypatch)  # the session's VLLM_DUALGPU_MACHINE_PROFILE=none
    forget_the_split()

    monkeypatch.setenv(MACHINE_PROFILE, str(profile))  # the default file, as calibrate leaves it
    printed = plan_json(model_dir, capsys)
    forget_the_split()
    applied, messages = executor_apply(model_dir, monkeypatch)

    bandwidths = {r["gpu"]["index"]: r["gpu"]["bandwidth_gbps"] for r in printed["plan"]["ranks"]}
    assert bandwidths == {0: MEASURED[0], 1: MEASURED[1]}
    assert sorted(r.gpu.bandwidth_gbps for r in applied.ranks) == sorted(MEASURED)
    assert printed["plan"]["order"] == list(applied.order)
    assert printed["plan"]["partition"] == list(applied.partition)
    assert printed["plan"]["num_blocks"] == applied.num_blocks
    assert printed["plan"]["predicted_decode_ms"] == pytest.approx(applied.predicted_decode_ms, rel=1e-3)
    # the profile made a difference: each rank's read bytes now over the slower measured figures
    assert applied.predicted_decode_ms > without.predicted_decode_ms
    line = (f"Decode speed: measured bandwidths from {profile} (calibrated 2026-05-02): "
            "GPU 0 650 of 672 GB/s, GPU 1 700 of 1,792 GB/s")
    assert printed["profile"]["line"] == line
    assert [m for m in messages if m.startswith("Decode speed:")] == [line]
    assert [m["matched_by"] for m in printed["profile"]["gpus"]] == ["name", "name"]
