"""benchmarks/headline.py's expert pools are one 262,144-token request under the KV grouping the
planner prices for the expert's own flags (its split, 1,664- or 1,600-token blocks, 9e9 KV bytes
on each rank, its weight format, fp8 KV, prefix caching, 2 sequences of 1,024 batched tokens, its drafter), plus
vLLM's null block: the reference setup's rule for its 375 / 180, under the grouping that runs."""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import headline as hl  # noqa: E402

from vllm_dualgpu.envs import HEADLESS_RESERVE_BYTES  # noqa: E402
from vllm_dualgpu.patching.runtime import runtime_assumptions  # noqa: E402
from vllm_dualgpu.planner import ModelSpec, PlanRequest, fit, parse_gpus, reference_config  # noqa: E402

DRAFTER = ROOT / "tests" / "fixtures" / "dflash2_drafter.json"
# the recipes' weight formats (docs/recipes.md "Planned with"; the headline's dummy checkpoints)
FORMAT = {"nvfp4-dflash2": "mlp=nvfp4,attention=fp8,linear_attention=fp8", "w8a16-dflash2": "int8-g128,embedding=int8-g128",
          "fp8-dflash2": None, "fp8-mtp": None}


@pytest.mark.parametrize("launcher", hl.LAUNCHERS)
def test_each_expert_pool_is_one_request_under_the_grouping_that_runs(launcher):
    e = hl.EXPERT[launcher]
    spec = hl.speculative(launcher, Path("drafter"))
    if spec["method"] == "dflash":
        spec["draft_config"] = json.loads(DRAFTER.read_text())
    req = PlanRequest(max_model_len=hl.MAX_MODEL_LEN, kv_cache_dtype="fp8", max_num_seqs=2, max_num_batched_tokens=1024,
                      enable_prefix_caching=True, speculative=spec, layer_partition=e["partition"],
                      block_size=e["block_size"], kv_cache_memory_bytes=hl.EXPERT_COMMON["kv_cache_memory_bytes"],
                      num_gpu_blocks_override=hl.EXPERT_BLOCKS[launcher],
                      **runtime_assumptions().request_fields())  # what the installed vLLM's patches give
    cfg = {k: v for k, v in reference_config().items() if k != "_vllm_dualgpu"}
    # as the executor: the virtual cards say no display=yes, so they are headless
    cards = [replace(g, reserve_bytes=HEADLESS_RESERVE_BYTES) for g in parse_gpus(hl.VIRTUAL)]
    f = fit(ModelSpec.from_hf_config(cfg, weight_format=FORMAT[launcher]), cards, req)
    assert f.fits and f.plan.partition == e["partition"]
    assert f.plan.kv.blocks_per_request(hl.MAX_MODEL_LEN) + 1 == hl.EXPERT_BLOCKS[launcher]
    assert f.plan.block_size == (e["block_size"] or hl.MTP_BLOCK)
