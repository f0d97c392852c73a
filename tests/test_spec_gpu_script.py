"""scripts/gpu/spec_decode_pp.py: the CPU dry run and the checks applied to a GPU run's facts."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu" / "spec_decode_pp.py"


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("spec_decode_pp", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_dry_run_builds_the_engine_config(tmp_path):
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu"}
    proc = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path), "--dry-run"], env=env,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "spec_decode_pp.json").read_text())
    assert result["ok"] and all(result["checks"].values())
    facts = result["facts"]
    assert facts["draft_architectures"] == ["Qwen3_5MTP"]
    assert facts["executor"] == "DualGpuExecutor" and facts["pipeline_parallel_size"] == 2
    assert facts["is_hybrid"] and facts["mamba_cache_mode"] == "align"
    cfg = json.loads((tmp_path / "model" / "config.json").read_text())
    layer_kinds = cfg["num_hidden_layers"] // cfg["full_attention_interval"]
    assert layer_kinds >= 2 and cfg["num_hidden_layers"] % 2 == 0  # attention on both PP ranks


def good_run(script) -> dict:
    line = "INFO x [plugin.py:46] vllm-dualgpu 0.1.0 ({}, vLLM 0.30.0): applied executor-by-name, {}; skipped none"
    return {
        "child": {
            "outputs": [[1]] * len(script.prompts()),
            "workers": [
                {"pp_rank": 1, "max_concurrent_batches": 2, "drafter": "Qwen3_5MTP",
                 "drafter_embed_is_target_embed": True},
                {"pp_rank": 0, "max_concurrent_batches": 2},
            ],
        },
        "plugin_lines": [
            line.format("frontend", "x"),
            line.format("engine", ", ".join(script.ENGINE_PATCHES)),
            line.format("worker", ", ".join(script.WORKER_PATCHES)),
            line.format("worker", ", ".join(script.WORKER_PATCHES)),
        ],
    }


def test_checks_pass_on_a_good_run(script):
    assert all(script.checks(good_run(script)).values())


@pytest.mark.parametrize(
    "breakage, failed",
    [
        (lambda r: r["child"]["workers"][0].update(max_concurrent_batches=3),
         "workers see max_concurrent_batches == pp_size"),
        (lambda r: r["child"]["workers"][0].update(drafter_embed_is_target_embed=False),
         "drafter embedding is the target's"),
        (lambda r: r["plugin_lines"].__setitem__(1, r["plugin_lines"][1].replace("mamba-hit-drop-last-block", "")),
         "engine applied its issue #6 patches"),
        (lambda r: r["plugin_lines"].__setitem__(3, r["plugin_lines"][3].replace("drafter-shares", "x")),
         "workers applied their issue #6 patches"),
        (lambda r: r["child"]["workers"][1].update(drafter="X"), "drafter on the last rank only"),
    ],
)
def test_checks_catch_each_failure(script, breakage, failed):
    run = good_run(script)
    breakage(run)
    result = script.checks(run)
    assert not result[failed]
    assert sum(not v for v in result.values()) == 1
