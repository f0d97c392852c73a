"""Mismatched capabilities with an fp8 KV cache run one attention backend on every rank.

On the virtual pair (rank 0 an RTX 4070 Ti SUPER at capability 8.9, rank 1 an H200 at 9.0) vLLM
0.33 picked FlashInfer on rank 0 and FlashAttention on rank 1 for an fp8 KV cache; their KV specs
did not group and a request claimed blocks in several attention groups (docs/gpu-runs.md,
eleventh session). The executor now sets FlashInfer for every rank
(vllm_dualgpu/engine/attention_backend.py): the engine says so, no rank runs FlashAttention,
and generation runs (vLLM's padding lines are recorded, to read the grouping).
"""

from __future__ import annotations

import functools

import pytest

import gpu_tokens as tok
from gpu_harness import (assert_ran, gpu_count, gpu_out, grep, model_dir, needs_pair, pair_env,  # noqa: F401
                         run_llm, uses_virtual_pair)
from test_gpu_passthrough import generate


@needs_pair()
@pytest.mark.skipif(not uses_virtual_pair(), reason="needs ranks of different capability: the virtual pair on "
                                                    f"one GPU or DUALGPU_VIRTUAL_PAIR; NVML sees {gpu_count()}")
@pytest.mark.timeout(600)
def test_fp8_kv_on_mismatched_ranks_runs_flashinfer_on_both(model_dir, gpu_out, record_property):
    folder = model_dir(tok.PRESETS["hybrid"], "random")
    prompts = tok.build_prompts(seed=0)
    kw = {**tok.engine_kwargs("hybrid", folder, 2, "bfloat16"), "kv_cache_dtype": "fp8"}
    res = run_llm(kw, functools.partial(generate, prompts=prompts), log=gpu_out / "fp8-kv.log",
                  timeout=480, env={**tok.run_env("bfloat16"), **pair_env([16.0, 32.0])})
    assert_ran(res)
    log = res["log"]
    lines = grep(log, r"vllm-dualgpu: attention backend FLASHINFER on every rank")
    record_property("backend line", lines[:1])
    assert len(lines) == 1, "the executor did not set one backend"
    assert not grep(log, r"Using FLASH_ATTN attention backend"), "a rank ran FlashAttention"
    # vLLM pads groups of unequal buckets; one attention bucket pads nothing here
    record_property("padding lines", grep(log, r"padding layers")[:4])
    for i, out in enumerate(res["outputs"]):
        assert len(out) == prompts["max_tokens"][i], f"prompt {i}: {len(out)} tokens"
