"""docs/recipes.md: each recipe's ``vllm serve`` command, run through ``plan`` on the cards it
names, gives the plan the recipe states (its "Plan:" line), so a changed planner or a changed
doc fails here. ``python tests/unit/test_recipes.py`` prints each recipe's line as the planner
computes it now (to update the doc after a planner change, checking every number that moved).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shlex
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "recipes.md"
DRAFTER = ROOT / "tests" / "fixtures" / "dflash2_drafter_standin.json"
GIB = 1 << 30


def recipes(text: str | None = None) -> list[dict]:
    """Each '### ' section with a ```bash block: its title, command, plan arguments and Plan: line."""
    text = DOC.read_text() if text is None else text
    out = []
    for section in text.split("\n### ")[1:]:
        title = section.splitlines()[0].strip()
        m = re.search(r"```bash\n(.*?)```", section, re.S)
        if not m:
            continue
        command = m.group(1).replace("\\\n", " ")
        planned = re.search(r"^Planned with: `([^`]*)`", section, re.M)
        line = re.search(r"^Plan: (.*)$", section, re.M)
        out.append({"title": title, "command": " ".join(command.split()),
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


def plan_of(recipe: dict, models: Path) -> tuple[int, dict]:
    from vllm_dualgpu.cli import main

    words = shlex.split(recipe["command"].replace("$MODELS", str(models)))
    env = {}
    while "=" in words[0] and not words[0].startswith("-"):
        k, _, v = words.pop(0).partition("=")
        env[k] = v
    assert words[:2] == ["vllm", "serve"], recipe["title"]
    argv = ["plan", *words[2:], *shlex.split(recipe["plan_args"] or ""), "--json"]
    saved = {k: os.environ.get(k) for k in (*env, "VLLM_DUALGPU_RESERVE", "VLLM_PP_LAYER_PARTITION")}
    os.environ.pop("VLLM_DUALGPU_RESERVE", None)
    os.environ.pop("VLLM_PP_LAYER_PARTITION", None)
    os.environ.update(env)
    buf = io.StringIO()
    try:
        with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(io.StringIO()):
            rc = main(argv)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return rc, json.loads(buf.getvalue())


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
