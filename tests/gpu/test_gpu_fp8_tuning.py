"""FP8 tuning on one GPU (issue #5): the tuner writes a config file for this card that vLLM's own
lookup returns (with ``fp8-configs-per-rank`` applied and VLLM_DUALGPU_KERNEL_CONFIGS naming the
folder), and vLLM's ``w8a8_triton_block_scaled_mm`` gives the same bits as launching the kernel
with the tuned config. The default-vs-tuned timings are a benchmark: benchmarks/fp8_tuning.py."""

from __future__ import annotations

import functools

import pytest

from gpu_harness import assert_ran, gpu_out, needs_gpus, run_llm  # noqa: F401

SHAPE, BLOCK, TUNE_M = (5120, 6144), (128, 128), [1, 16, 64, 256]


def tune_and_look_up(_llm, config_dir: str) -> dict:
    import os
    from pathlib import Path

    import torch
    import vllm

    from vllm_dualgpu.kernels import fp8_configs, fp8_tuner
    from vllm_dualgpu.patching.core import apply_patch
    from vllm_dualgpu.patching.registry import PATCHES

    N, K = SHAPE
    facts = fp8_tuner.device_facts()
    kernel = fp8_tuner.find_kernel()
    r = fp8_tuner.tune_shape(kernel, N, K, BLOCK, TUNE_M, facts["smem_optin"], time_cap_s=60.0, log=print)
    path = fp8_tuner.write_config_file(Path(config_dir), N, K, facts["file_name"], BLOCK, r.configs)
    tuned = {int(m): c for m, c in r.configs.items()}
    os.environ[fp8_configs.ENV_USER_DIR] = config_dir
    fp8_configs.reset_for_tests()
    outcome = apply_patch(next(p for p in PATCHES if p.name == "fp8-configs-per-rank"), vllm.__version__)
    from vllm.model_executor.layers.quantization.utils import fp8_utils

    got = fp8_utils.get_w8a8_block_fp8_configs(N, K, *BLOCK)
    src = fp8_configs.resolved().get((facts["file_name"], N, K, *BLOCK))
    dev = torch.device("cuda", torch.cuda.current_device())
    B, Bs = fp8_tuner.make_weight(N, K, BLOCK, dev)
    A, As = fp8_tuner.make_activation(64, K, BLOCK, dev)
    via_vllm = fp8_utils.w8a8_triton_block_scaled_mm(A, B, As, Bs, list(BLOCK), torch.bfloat16)
    C = torch.empty(64, N, device=dev, dtype=torch.bfloat16)
    fp8_tuner.launch(kernel, A, B, As, Bs, C, *BLOCK, fp8_configs.pick_config(tuned, 64))
    return {"patch": outcome.status, "file": path.name, "expected_file": fp8_configs.config_file_name(N, K, facts["file_name"]),
            "lookup_is_tuned": {int(k): v for k, v in (got or {}).items()} == tuned, "source": src[0] if src else None,
            "bitwise_equal_at_M64": bool(torch.equal(via_vllm, C)), "tuned_us": r.tuned_us, "default_us": r.default_us}


@needs_gpus(1)
@pytest.mark.timeout(300)
def test_tuned_file_is_what_vllm_reads(tmp_path, gpu_out, record_property):
    job = functools.partial(tune_and_look_up, config_dir=str(tmp_path))
    res = run_llm(None, job, log=gpu_out / "fp8.log", timeout=240)
    assert_ran(res)
    record_property("tuned_us", res["tuned_us"])
    record_property("default_us", res["default_us"])
    assert res["patch"] == "applied", f"fp8-configs-per-rank: {res['patch']}"
    assert res["file"] == res["expected_file"], res
    assert res["source"] == "user", f"vLLM's lookup took the configs from {res['source']}, not the tuned folder"
    assert res["lookup_is_tuned"], "get_w8a8_block_fp8_configs did not return the tuned configs"
    assert res["bitwise_equal_at_M64"], "vLLM's wrapper and the tuned launch differ"
