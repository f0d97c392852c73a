"""The vision tower on the first PP rank only (issue #6 item 3): a Qwen3.5 multimodal model
(gpu_models.write_vision_model, dummy weights) with PP=2 through the plugin holds vision weights
on rank 0 and none on rank 1; stock vLLM ("mp") builds the tower on both (recorded, the claim is
the plugin's). Images limited to 1 per prompt (a limit of 0 would make stock skip the tower too)."""

from __future__ import annotations

import pytest

import gpu_models as gm
from gpu_runs import vision_kwargs as engine_kwargs
from gpu_runs import vision_prompts as prompts
from gpu_harness import (FIRST_GDN_BOOT_S, assert_applied, assert_ran, gpu_out, needs_pair, pair_env,  # noqa: F401
                         patches_in_force, run_llm)

PATCH = "vision-tower-first-rank-only"


def vision_weights(worker) -> dict:
    from vllm.distributed.parallel_state import get_pp_group

    model = worker.model_runner.model
    vision = [p for n, p in model.named_parameters() if n.startswith("visual.")]
    visual = getattr(model, "visual", None)
    return {"pp_rank": get_pp_group().rank_in_group, "use_v2_model_runner": bool(worker.vllm_config.use_v2_model_runner),
            "visual_class": type(visual).__name__, "vision_params": len(vision),
            "vision_bytes": sum(p.numel() * p.element_size() for p in vision)}


def generate_and_probe(llm) -> dict:
    import sys

    import cloudpickle
    from vllm import SamplingParams

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, detokenize=False)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts()], sp, use_tqdm=False)
    return {"outputs": [list(o.outputs[0].token_ids) for o in outs],
            "workers": {w["pp_rank"]: w for w in llm.collective_rpc(vision_weights, timeout=60)}}


@needs_pair()
@pytest.mark.timeout(FIRST_GDN_BOOT_S + 200)
def test_vision_weights_on_rank_0_only(tmp_path, gpu_out, record_property):
    model = gm.write_vision_model(tmp_path / "vision")
    res = run_llm(engine_kwargs(model, "dualgpu"), generate_and_probe, log=gpu_out / "dualgpu.log",
                  timeout=FIRST_GDN_BOOT_S, env=pair_env())
    assert_ran(res)
    assert len(res["outputs"]) == 2, "did not generate"
    w = {int(k): v for k, v in res["workers"].items()}
    assert sorted(w) == [0, 1] and all(x["use_v2_model_runner"] for x in w.values()), w
    record_property("vision bytes per rank", {r: x["vision_bytes"] for r, x in w.items()})
    assert w[0]["vision_bytes"] > 0, f"rank 0 holds no vision weights: {w[0]}"
    assert w[1]["vision_bytes"] == 0 and w[1]["vision_params"] == 0, f"rank 1 holds vision weights: {w[1]}"
    assert_applied(res["log"], "worker", patches_in_force((PATCH,)), at_least=2)
    stock = run_llm(engine_kwargs(model, "mp"), generate_and_probe, log=gpu_out / "stock.log", timeout=150)
    record_property("stock rank 1 vision bytes", (stock.get("workers") or {}).get("1", {}).get("vision_bytes"))
