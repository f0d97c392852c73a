"""TP groups as pipeline stages (``-pp 2 -tp 2``) through the plugin, on four virtual cards on
GPU 0 (docs/virtual-gpus.md): two 8 GiB cards form stage 0, two 16 GiB cards stage 1. Greedy
tokens against stock vLLM on one rank (float32; TP splits the matmuls, so a near tie may flip:
the non-strict comparison of the e2e tests), and how the TP groups reduced: NCCL, with vLLM's
custom all-reduce off (the plan) and its FlashInfer all-reduce off (the emulated rank), so no
``trtllm_comm`` build."""

from __future__ import annotations

import functools

import pytest

import gpu_tokens as tok
from gpu_harness import assert_ran, gpu_out, grep, model_dir, needs_gpus, run_llm  # noqa: F401
from test_gpu_passthrough import generate

FOUR = "RTX 4060 Ti:8GiB,RTX 4060 Ti:8GiB,RTX 4070 Ti SUPER:16GiB,RTX 4070 Ti SUPER:16GiB"


@needs_gpus(1)
@pytest.mark.timeout(900)
def test_tp_stages_on_four_virtual_cards_give_stocks_tokens(model_dir, gpu_out, record_property):
    folder = model_dir("small-dense", "random")
    prompts = tok.build_prompts(seed=0)
    job = functools.partial(generate, prompts=prompts)
    stock_kw = {**tok.engine_kwargs("dense", folder, 1, "float32"), "gpu_memory_utilization": 0.2}
    stock = run_llm(stock_kw, job, log=gpu_out / "stock.log", timeout=300, env=tok.run_env("float32", gpu="0"))
    assert_ran(stock)
    kw = {**tok.engine_kwargs("dense", folder, 2, "float32"), "tensor_parallel_size": 2}
    env = {**tok.run_env("float32", gpu="0"), "VLLM_DUALGPU_VIRTUAL_GPUS": FOUR,
           "VLLM_WORKER_MULTIPROC_METHOD": "spawn"}
    plugin = run_llm(kw, job, log=gpu_out / "tp-stages.log", timeout=500, env=env)
    assert_ran(plugin)
    assert "DualGpuExecutor" in plugin["executor"], plugin["executor"]
    ranks = grep(plugin["log"], r"vllm-dualgpu rank \d \(stage \d/2, TP rank \d/2\)")
    record_property("rank lines", len(ranks))
    assert len(ranks) == 4, ranks
    c = tok.compare(stock["outputs"], plugin["outputs"], stock["logprobs"], plugin["logprobs"], strict=False)
    record_property("identical", f"{c['identical']}/{c['prompts']}")
    assert c["ok"], f"-pp 2 -tp 2: {c['identical']}/{c['prompts']} identical; first {c['mismatches'][:1]}"
    assert not grep(plugin["log"], "trtllm_comm"), "FlashInfer's all-reduce was built"
    record_property("all-reduce lines", grep(plugin["log"], r"(?i)all.?reduce")[:6])
