"""Issue #7: stock vLLM on one GPU and the plugin with PP=2 give the same greedy tokens.

Runs ``scripts/gpu/e2e_correctness.py --quick`` once for the module (about 6 minutes on two
H200s: a dense and a Qwen3.5-style hybrid model with MTP, seeded random weights, 32 prompts,
prefix-cache hits and misses; see the script's docstring for what is compared and why) and turns
each of its comparisons into a test. GPU only: ``tests/conftest.py`` skips it when NVML sees no
GPU; on a GPU machine run ``scripts/gpu/run_gpu_suite.sh``. ``DUALGPU_E2E_STRICT=1`` makes any
divergence fail, near ties of the hybrid runs too. ``E2E_DTYPE=float32`` reaches the script: its
float32 mode (every comparison strict; the hybrid's MTP runs use its all-attention twin, as vLLM
0.30 has no float32 GDN prefill), and the runs and comparisons here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu" / "e2e_correctness.py"


sys.path.insert(0, str(SCRIPT.parent))  # the GPU scripts import each other by name
import e2e_correctness as e2e  # noqa: E402

COMPARISONS = [c[0] for c in e2e.planned_comparisons(quick=True)]
RUNS = [r.name for phase in e2e.plan_runs(quick=True) for lane in phase for r in lane]

pytestmark = pytest.mark.gpu


def script_env() -> dict:
    """This process's environment less VLLM_TARGET_DEVICE: tests/conftest.py sets it to ``cpu``
    for the CPU tests, and the script's GPU runs need vLLM's CUDA platform."""
    return {k: v for k, v in os.environ.items() if k != "VLLM_TARGET_DEVICE"}


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    base = os.environ.get("OUT")
    out = Path(base) / "e2e-pytest" if base else tmp_path_factory.mktemp("e2e")
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, str(SCRIPT), str(out), "--quick"]
    if os.environ.get("DUALGPU_E2E_STRICT") == "1":
        cmd.append("--strict")
    with open(out / "e2e_stdout.log", "w") as log:
        proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=1200, cwd=ROOT, env=script_env())
    result = out / "e2e_correctness.json"
    assert result.exists(), f"no {result} (rc={proc.returncode}); see {out / 'e2e_stdout.log'}"
    data = json.loads(result.read_text())
    data["_rc"] = proc.returncode
    return data


@pytest.mark.parametrize("run", RUNS)
def test_run_worked(report, run):
    info = report["runs"].get(run)
    assert info is not None, f"{run} did not run"
    assert info.get("ok"), f"{run}: {info.get('error')}\n" + "\n".join(info.get("log_tail", []))


@pytest.mark.parametrize("name", COMPARISONS)
def test_comparison(report, name):
    c = next((c for c in report["comparisons"] if c["name"] == name), None)
    assert c is not None, f"comparison {name} missing from the report"
    shown = "\n".join(
        f"  prompt {m['prompt']}: first difference at token {m['first_diff']} "
        f"({m['ref_token']} vs {m['got_token']}; logprob gaps {m.get('gap_ref')} / {m.get('gap_got')}"
        f"{', near tie' if m.get('near_tie') else ''})"
        for m in c.get("mismatches", [])[:8]
    )
    assert c["ok"], (f"{name} ({c['a']} vs {c['b']}, strict={c['strict']}): {c.get('reason', '')} "
                     f"{c.get('identical')}/{c.get('prompts')} identical\n{shown}")


def test_script_verdict(report):
    """The script's own exit code agrees with the per-comparison tests."""
    assert report["ok"] and report["_rc"] == 0, f"e2e_correctness exited {report['_rc']}"
