"""`vllm-dualgpu plan` and the executor keep the same memory free on each card for the same NVML
facts: 1 GiB on a card that drives a display (or that NVML cannot say about), 256 MiB on a card
without one, ``VLLM_DUALGPU_RESERVE`` over both; the same reserves give the same split and pool
(test_plan_matches_executor.py holds the two requests together)."""

from __future__ import annotations

import json

import pytest
from plan_match import executor_plan, forget_the_split, sandbox
from test_plan_matches_executor import DENSE  # the same dense model as the TP-1 test

from vllm_dualgpu import envs
from vllm_dualgpu.cli import main
from vllm_dualgpu.engine import handoff
from vllm_dualgpu.nvml import VisibleGpu

GiB, MiB = 1024**3, 1024**2
SERVE = {"max_model_len": 32768, "max_num_seqs": 8, "max_num_batched_tokens": 4096,
         "kv_cache_dtype": "fp8", "mamba_ssm_cache_dtype": "float32"}  # CPU platform: see the TP-1 test


def nvml_cards(display_5090, display_4070):
    """What NVML reports on the reference box: the RTX 5090 first in PCI order."""
    return [VisibleGpu(0, "NVIDIA GeForce RTX 5090", 32607 * MiB, 30 * GiB, (12, 0), None, "GPU-0",
                       display=display_5090),
            VisibleGpu(1, "NVIDIA GeForce RTX 4070 Ti SUPER", 16376 * MiB, 15 * GiB, (8, 9), None, "GPU-1",
                       display=display_4070)]



@pytest.fixture
def model_dir(tmp_path, monkeypatch):
    yield from sandbox(tmp_path, monkeypatch, DENSE)




def plan_json(model_dir, capsys, gpus: str) -> dict:
    argv = ["plan", str(model_dir), "--gpus", gpus, "--json"]
    for k, v in SERVE.items():
        argv += [f"--{k.replace('_', '-')}", str(v)]
    capsys.readouterr()
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


def plan_reserves(printed: dict) -> dict[int, int]:
    """CUDA index -> the reserve `plan` kept free on that card."""
    return {r["gpu"]["index"]: r["gpu"]["reserve_bytes"] for r in printed["plan"]["ranks"]}


def executor_apply(model_dir, monkeypatch, seen):
    return executor_plan(model_dir, monkeypatch, SERVE, seen)


def executor_reserves(cfg) -> dict[int, int]:
    return {r.physical_gpu_id: r.reserve_bytes for r in handoff.load(cfg).ranks}


@pytest.mark.parametrize("displays,expected", [
    ((True, False), {0: GiB, 1: 256 * MiB}),  # the reference box: the 5090 drives the desktop
    ((False, False), {0: 256 * MiB, 1: 256 * MiB}),  # a headless server
    ((None, True), {0: GiB, 1: GiB}),  # NVML cannot say: kept as for a display
])
def test_plan_local_and_the_executor_keep_the_same_free(model_dir, capsys, monkeypatch, displays, expected):
    import vllm_dualgpu.nvml

    seen = nvml_cards(*displays)
    monkeypatch.setattr(vllm_dualgpu.nvml, "read_visible_gpus", lambda: seen)  # plan --gpus local
    printed = plan_json(model_dir, capsys, "local")
    forget_the_split()
    cfg, applied, _ = executor_apply(model_dir, monkeypatch, seen)
    assert plan_reserves(printed) == executor_reserves(cfg) == expected
    assert printed["plan"]["partition"] == list(applied.plan.partition)
    assert printed["plan"]["num_blocks"] == applied.plan.num_blocks


def test_offline_display_keys_give_what_the_executor_gives_for_those_nvml_facts(model_dir, capsys, monkeypatch):
    printed = plan_json(model_dir, capsys, "RTX 5090:32607MiB:30GiB:display=yes,"
                                           "RTX 4070 Ti SUPER:16376MiB:15GiB:display=no")
    cfg, applied, _ = executor_apply(model_dir, monkeypatch, nvml_cards(True, False))
    assert plan_reserves(printed) == executor_reserves(cfg) == {0: GiB, 1: 256 * MiB}
    assert printed["plan"]["partition"] == list(applied.plan.partition)
    assert printed["plan"]["num_blocks"] == applied.plan.num_blocks


def test_the_environment_overrides_the_display_on_both_sides(model_dir, capsys, monkeypatch):
    import vllm_dualgpu.nvml

    monkeypatch.setenv(envs.RESERVE, "512MiB,2GiB")
    seen = nvml_cards(True, False)
    monkeypatch.setattr(vllm_dualgpu.nvml, "read_visible_gpus", lambda: seen)
    printed = plan_json(model_dir, capsys, "local")
    forget_the_split()
    cfg, _, _ = executor_apply(model_dir, monkeypatch, seen)
    assert plan_reserves(printed) == executor_reserves(cfg) == {0: 512 * MiB, 1: 2 * GiB}


def test_the_executor_says_why_each_card_keeps_what_it_keeps(model_dir, monkeypatch):
    cfg, _, messages = executor_apply(model_dir, monkeypatch, nvml_cards(True, False))
    reasons = {r.physical_gpu_id: r.reserve_reason for r in handoff.load(cfg).ranks}
    assert reasons == {0: "display active", 1: "no display on this card"}
    (line,) = [m for m in messages if "kept free" in m]
    assert "GPU 0 (NVIDIA GeForce RTX 5090): 1.00 GiB kept free (display active)" in line
    assert "GPU 1 (NVIDIA GeForce RTX 4070 Ti SUPER): 0.25 GiB kept free (no display on this card)" in line
    forget_the_split()
    monkeypatch.setenv(envs.RESERVE, "1GiB")
    cfg, _, messages = executor_apply(model_dir, monkeypatch, nvml_cards(True, False))
    assert {r.reserve_reason for r in handoff.load(cfg).ranks} == {"VLLM_DUALGPU_RESERVE"}
    (line,) = [m for m in messages if "kept free" in m]
    assert line.count("1.00 GiB kept free (VLLM_DUALGPU_RESERVE)") == 2
