"""docs/recipes.md: each recipe's ``vllm serve`` command, run by bash as printed (MODELS set to
stand-in checkpoint folders, ``vllm serve`` standing for ``vllm-dualgpu plan`` on the cards the
recipe names), gives the plan the recipe states (its "Plan:" line), so a changed planner or a changed
doc fails here. ``python tests/unit/test_recipes.py`` prints each recipe's line as the planner
computes it now (to update the doc after a planner change, checking every number that moved).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "recipes.md"
DRAFTER = ROOT / "tests" / "fixtures" / "dflash2_drafter.json"
GIB = 1 << 30


def recipes(text: str | None = None) -> list[dict]:
    """Each '### ' section with a ```bash block: its title, the block as printed, plan arguments
    and Plan: line."""
    text = DOC.read_text() if text is None else text
    out = []
    for section in text.split("\n### ")[1:]:
        title = section.splitlines()[0].strip()
        m = re.search(r"```bash\n(.*?)```", section, re.S)
        if not m:
            continue
        planned = re.search(r"^Planned with: `([^`]*)`", section, re.M)
        line = re.search(r"^Plan: (.*)$", section, re.M)
        out.append({"title": title, "script": m.group(1),
                    "command": " ".join(m.group(1).replace("\\\n", " ").split()),
                    "plan_args": planned.group(1) if planned else None,
                    "plan_line": line.group(1).strip() if line else None})
    return out


def model_root(tmp: Path) -> Path:
    """$MODELS for the recipes: each checkpoint folder holds the bundled reference config (the
    drafter folder the stand-in drafter config); --weight-format in 'Planned with' says the format."""
    from vllm_dualgpu.planner import reference_config

    cfg = reference_config()
    cfg.pop("_vllm_dualgpu")
    for name in ("Qwen3.8-27B-Uncensored-NVFP4", "Qwen3.8-27B-huihui-abliterated-INT8-W8A16-DFlash2",
                 "Qwen3.8-27B-Uncensored-FP8", "Qwen3.8-27B-NVFP4"):
        (tmp / name).mkdir(parents=True, exist_ok=True)
        (tmp / name / "config.json").write_text(json.dumps(cfg))
    (tmp / "Qwen3.8-27B-DFlash2-W4A16").mkdir(exist_ok=True)
    (tmp / "Qwen3.8-27B-DFlash2-W4A16" / "config.json").write_text(DRAFTER.read_text())
    return tmp


# `vllm` for the recipes' scripts: `vllm serve ARGS` runs `vllm-dualgpu plan ARGS` with the
# recipe's "Planned with" arguments and --json; the script itself is run by bash as printed.
_SHIM = """vllm() {
    if [ "$1" != serve ]; then echo "recipe runs 'vllm $1', not 'vllm serve'" >&2; return 99; fi
    shift
    "$PLAN_PYTHON" -m vllm_dualgpu.cli plan "$@" "${PLAN_ARGS[@]}" --json
}
"""


def run_recipe(recipe: dict, models: Path) -> subprocess.CompletedProcess:
    """The recipe's ```bash block, run by bash with MODELS set and `vllm serve` standing for
    `vllm-dualgpu plan`."""
    plan_args = " ".join(shlex.quote(a) for a in shlex.split(recipe["plan_args"] or ""))
    script = f"PLAN_ARGS=({plan_args})\n{_SHIM}{recipe['script']}"
    env = {k: v for k, v in os.environ.items() if k not in ("VLLM_DUALGPU_RESERVE", "VLLM_PP_LAYER_PARTITION")}
    env.update({"MODELS": str(models), "PLAN_PYTHON": sys.executable,
                "PYTHONPATH": os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])})
    return subprocess.run(["bash", "-c", script], capture_output=True, text=True, env=env, timeout=120)


def plan_of(recipe: dict, models: Path) -> tuple[int, dict]:
    p = run_recipe(recipe, models)
    assert p.returncode in (0, 1), (recipe["title"], p.returncode, p.stderr[-2000:])
    return p.returncode, json.loads(p.stdout)


def render(rc: int, out: dict) -> str:
    """The Plan: line for a plan (rc 0) or a refusal (rc 1)."""
    if rc == 0:
        p = out["plan"]
        free = " / ".join(f"{r['predicted_free_after_bytes'] / GIB:.2f}" for r in p["ranks"])
        names = " -> ".join(r["gpu"]["name"] for r in p["ranks"])
        return (f"fits. Rank 0 first: {names} (GPU order {p['cuda_visible_devices']}), layer split "
                f"{'/'.join(map(str, p['partition']))}, {p['num_blocks']:,} blocks x {p['block_size']:,} "
                f"tokens, one request up to {p['kv_max_context_tokens']:,} tokens, predicted free "
                f"after start {free} GiB.")
    if out.get("error") == "ContextTooLong":
        return (f"does not fit at --max-model-len {out['requested']:,}: the largest that fits is "
                f"{out['largest_fitting_max_model_len']:,}.")
    if out.get("error") == "ModelDoesNotFit":
        return (f"does not fit: rank {out['rank']} ({out['gpu_name']}) is short by "
                f"{out['short_bytes'] / (1 << 20):,.0f} MiB for the weights, fixed costs and one "
                "request's KV cache.")
    return f"refused: {out.get('message')}"


def test_the_doc_has_the_recipes():
    titles = [r["title"] for r in recipes()]
    assert len(titles) == 6, titles
    for r in recipes():
        assert r["plan_line"] and r["plan_args"] is not None, r["title"]
        assert "--distributed-executor-backend dualgpu" in r["command"], r["title"]
        for gone in ("CUDA_VISIBLE_DEVICES", "VLLM_PP_LAYER_PARTITION", "--num-gpu-blocks-override",
                     "--kv-cache-memory-bytes", "flashinfer-autotune", "LD_PRELOAD", "CUTE_DSL_ARCH",
                     "--gpu-memory-utilization"):
            assert gone not in r["command"], (r["title"], gone)


@pytest.mark.parametrize("index", range(6))
def test_recipe_plans_as_the_doc_says(tmp_path, index):
    recipe = recipes()[index]
    rc, out = plan_of(recipe, model_root(tmp_path))
    assert rc in (0, 1), out
    assert render(rc, out) == recipe["plan_line"], recipe["title"]


@pytest.mark.parametrize("index", range(6))
def test_recipe_runs_as_printed_through_bash(tmp_path, index):
    """The block as a shell runs it: exit 0 (fits) or 1 (the largest length that fits), never
    2 (a path the shell did not expand, an argument plan does not take)."""
    recipe = recipes()[index]
    p = run_recipe(recipe, model_root(tmp_path))
    assert p.returncode in (0, 1), (recipe["title"], p.returncode, p.stderr[-2000:])
    out = json.loads(p.stdout)
    assert "plan" in out or out.get("largest_fitting_max_model_len") or out.get("error") == "ModelDoesNotFit", out


def test_the_shell_expands_models_in_the_drafter_path(tmp_path):
    """With the drafter's folder missing, plan names the path the shell made of $MODELS: the
    JSON reaches vLLM (here plan) with the folder in it, not the text '$MODELS'."""
    recipe = next(r for r in recipes() if "dflash" in r["command"])
    models = model_root(tmp_path)
    (models / "Qwen3.8-27B-DFlash2-W4A16" / "config.json").unlink()
    (models / "Qwen3.8-27B-DFlash2-W4A16").rmdir()
    p = run_recipe(recipe, models)
    assert p.returncode == 2, p.stderr
    assert f"cannot find '{models}/Qwen3.8-27B-DFlash2-W4A16'" in p.stderr, p.stderr


def test_a_changed_number_in_the_doc_fails(tmp_path):
    recipe = recipes()[0]
    changed = re.sub(r"\d", lambda m: str((int(m.group()) + 1) % 10), recipe["plan_line"], count=1)
    rc, out = plan_of(recipe, model_root(tmp_path))
    assert render(rc, out) != changed


if __name__ == "__main__":
    import tempfile

    sys.path.insert(0, str(ROOT))
    with tempfile.TemporaryDirectory() as d:
        for r in recipes():
            print(f"### {r['title']}\nPlan: {render(*plan_of(r, model_root(Path(d))))}\n")
