"""A --max-model-len the plan's KV budgets cannot hold is refused before the weights load.

After profiling, the executor caps each rank's KV room at the plan's KV budget
(context_fit.cap_to_plan) and then checks the context on the capped figures with vLLM's
arithmetic (context_fit.check_context_fits). So a length the plan predicts short, however little,
cannot fit after profiling whatever vLLM's profile measures: going ahead only loads the weights
and runs the profile to be refused. Real vLLM config on CPU, the GPUs NVML would report faked.
"""

from __future__ import annotations

import pytest
import torch
from plan_exports import restore_environ  # noqa: F401  (autouse: the plan's exports undone)
from test_planning import big_first_pair, make_config  # noqa: F401  (fixtures)

from vllm_dualgpu.engine import planning as apply

GiB = 1024**3


def rank_specs(partition, block_size):
    """The Qwen3-14B-class model's KV specs per rank (8 KV heads x 128, bf16), as its workers report them."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=8, head_size=128, dtype=torch.bfloat16)
    out, start = [], 0
    for n in partition:
        out.append({f"model.layers.{i}.self_attn.attn": spec for i in range(start, start + n)})
        start += n
    return out


def test_a_length_just_past_the_plan_cannot_fit_after_profiling_so_it_is_refused_first(make_config, big_first_pair):
    from vllm.v1.kv_cache_layout import KVCacheLayout

    from vllm_dualgpu.engine.context_fit import ContextDoesNotFit, cap_to_plan, check_context_fits
    from vllm_dualgpu.planner import ContextTooLong

    with pytest.raises(ContextTooLong) as err:
        apply.apply_plan(make_config(max_model_len=262144))
    largest = err.value.largest_fitting_max_model_len
    short = int(largest * 1.03)  # 3% past what the plan holds

    # The premise: at the largest length the plan fits; a run of `short` tokens on that plan's
    # split, even where vLLM's profile leaves every rank twice the plan's KV budget, is capped to
    # the plan's budgets and refused by the after-profiling check.
    at_largest = apply.apply_plan(make_config(max_model_len=largest))
    cfg = make_config(max_model_len=short)
    cfg.cache_config.kv_cache_layout = next(iter(KVCacheLayout)).name  # as EngineCore resolves it
    generous = [2 * r.kv_budget_bytes for r in at_largest.plan.ranks]
    capped = cap_to_plan(cfg, generous, at_largest)
    assert capped == [r.kv_budget_bytes for r in at_largest.plan.ranks]
    with pytest.raises(ContextDoesNotFit):
        check_context_fits(cfg, rank_specs(at_largest.plan.partition, cfg.cache_config.block_size), capped,
                           at_largest)

    # So the executor refuses it now, before any worker loads weights, with the planner's message.
    with pytest.raises(ContextTooLong, match=rf"--max-model-len {short:,} does not fit: the largest that fits is "
                                             rf"{largest:,}"):
        apply.apply_plan(make_config(max_model_len=short))
