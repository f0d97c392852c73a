"""PP=1 through the plugin on one GPU: ``distributed_executor_backend="dualgpu"`` with one stage
boots, plans nothing away, and gives stock vLLM's greedy tokens (small-dense, seeded weights)."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest

import gpu_tokens as tok
from gpu_harness import assert_ran, gpu_out, model_dir, needs_gpus, plugin_lines, run_llm  # noqa: F401


def generate(llm, prompts: dict) -> dict:
    from vllm import SamplingParams

    sp = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True, logprobs=tok.LOGPROBS) for m in prompts["max_tokens"]]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts["prompts"]], sp, use_tqdm=False)
    cfg = llm.llm_engine.vllm_config
    return {"outputs": [list(o.outputs[0].token_ids) for o in outs], "logprobs": [tok.token_logprobs(o.outputs[0]) for o in outs],
            "executor": str(cfg.parallel_config.distributed_executor_backend), "num_gpu_blocks": cfg.cache_config.num_gpu_blocks}


@needs_gpus(1)
@pytest.mark.timeout(600)
def test_pp1_through_the_plugin_gives_stocks_tokens(model_dir, gpu_out, record_property):
    folder = model_dir("small-dense", "random")
    prompts = tok.build_prompts(seed=0)
    job = functools.partial(generate, prompts=prompts)
    runs = {}
    for backend in ("mp", "dualgpu"):
        kw = {**tok.engine_kwargs("dense", folder, 1, "bfloat16"), "distributed_executor_backend": backend,
              "gpu_memory_utilization": 0.5}
        runs[backend] = run_llm(kw, job, log=gpu_out / f"{backend}.log", timeout=240, env=tok.run_env("bfloat16", gpu="0"))
        assert_ran(runs[backend])
    stock, plugin = runs["mp"], runs["dualgpu"]
    assert "DualGpuExecutor" in plugin["executor"], plugin["executor"]
    record_property("num_gpu_blocks stock / plugin", f"{stock['num_gpu_blocks']} / {plugin['num_gpu_blocks']}")
    c = tok.compare(stock["outputs"], plugin["outputs"], stock["logprobs"], plugin["logprobs"], strict=False)
    record_property("identical", f"{c['identical']}/{c['prompts']}")
    assert c["ok"], f"PP=1 through the plugin: {c['identical']}/{c['prompts']} identical; first {c['mismatches'][:1]}"
    # The engine applies its patches and says it runs as vLLM's mp executor. The stock worker of a
    # PP=1 run (forked, so vLLM loads no plugins there) has nothing to apply and logs nothing:
    # seen on vLLM 0.33.0 on one H200 (docs/gpu-runs.md).
    assert plugin_lines(plugin["log"], "engine"), "no engine plugin line"
    log = Path(plugin["log"]).read_text()
    assert "pipeline_parallel_size=1, running as vLLM's multiprocess executor" in log, "no passthrough line"
