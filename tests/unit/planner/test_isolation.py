"""The planner and ``vllm-dualgpu plan`` import neither vLLM, torch nor pynvml."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap


def test_planner_and_cli_plan_import_nothing_heavy(tmp_path):
    code = textwrap.dedent(
        """
        import io, contextlib, json, sys
        from vllm_dualgpu.planner import ModelSpec, PlanRequest, plan, reference_config, reference_pair, stock_estimate
        m = ModelSpec.from_hf_config(reference_config())
        p = plan(m, reference_pair(), PlanRequest(kv_cache_dtype="fp8"))
        p.table(); p.to_json(); stock_estimate(m, reference_pair(), PlanRequest(kv_cache_dtype="fp8"))
        from vllm_dualgpu.cli import main
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            rc1 = main(["plan"])
            rc2 = main(["plan", "--json", "--speculative-config", '{"method": "mtp", "num_speculative_tokens": 2}'])
        heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("vllm", "torch", "pynvml"))
        print(json.dumps({"heavy": heavy, "rc": [rc1, rc2]}))
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "VLLM_PP_LAYER_PARTITION"}
    env["VLLM_DUALGPU_RESERVE"] = "0"  # MTP at 262,144 tokens fits the reference pair only then
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    import json

    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert res == {"heavy": [], "rc": [0, 0]}


def test_the_planner_reads_no_environment():
    """The planner takes inputs: no module of vllm_dualgpu/planner reads os.environ or getenv
    (what vLLM or the user set reaches it through PlanRequest and GpuFacts)."""
    import ast
    from pathlib import Path

    import vllm_dualgpu.planner

    readers = []
    for path in sorted(Path(vllm_dualgpu.planner.__file__).parent.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv", "environb"):
                readers.append(f"{path.name}:{node.lineno}")
    assert readers == []
