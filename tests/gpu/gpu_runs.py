"""The engine arguments and prompts of each GPU run, in one place: the GPU tests boot them, and
tests/integration/test_gpu_run_configs.py builds their VllmConfigs on the CPU (e2e runs:
gpu_tokens.engine_kwargs)."""

from __future__ import annotations

import gpu_models as gm
from gpu_models import gdn_prefill_config

NUM_SPEC = 2
EMBEDQ_ENV = {"VLLM_PP_LAYER_PARTITION": "4,4",  # the same split in every arm
              "CUBLAS_WORKSPACE_CONFIG": ":16:8", "CUBLASLT_WORKSPACE_SIZE": "1"}


def spec_kwargs(model_dir, method: str = "mtp", drafter=None, backend: str = "dualgpu") -> dict:
    """Speculative decoding under PP=2: MTP, or EAGLE3 with ``drafter``; ``backend="mp"``: stock."""
    kw = dict(model=str(model_dir), load_format="dummy", skip_tokenizer_init=True, pipeline_parallel_size=2,
              distributed_executor_backend=backend, enforce_eager=True, max_model_len=4096,
              gpu_memory_utilization=0.3, seed=0, additional_config=gdn_prefill_config(),
              speculative_config={"method": "mtp", "num_speculative_tokens": NUM_SPEC},
              disable_log_stats=False)  # LLM.get_metrics() needs the stat loggers (the MTP run recorded
    if method == "eagle3":            # "Stat logging disabled" without it, 2026-12-03)
        kw["speculative_config"] = {"method": "eagle3", "model": str(drafter), "num_speculative_tokens": NUM_SPEC}
    return kw


def spec_prompts() -> list[list[int]]:
    """Three short token-id prompts and one long one (several KV blocks)."""
    def ids(start: int, n: int) -> list[int]:
        return [3 + (start + 7 * i) % 8000 for i in range(n)]

    return [ids(11, 24), ids(500, 90), ids(1234, 300), ids(4321, 1500)]


def vision_kwargs(model_dir, backend: str) -> dict:
    """Images limited to 1 per prompt: a limit of 0 would make stock skip the tower on every rank."""
    return dict(model=str(model_dir), load_format="dummy", pipeline_parallel_size=2,
                distributed_executor_backend=backend, enforce_eager=True, max_model_len=4096,
                gpu_memory_utilization=0.3, seed=0, limit_mm_per_prompt={"image": 1, "video": 0},
                additional_config=gdn_prefill_config())


def vision_prompts() -> list[list[int]]:
    """Two token-id prompts of ordinary tokens (ids below the tokenizer's vision tokens)."""
    return [[3 + (11 + 7 * i) % 600 for i in range(24)], [3 + (500 + 13 * i) % 600 for i in range(90)]]


def embedq_kwargs(model_dir, backend: str) -> dict:
    return dict(model=str(model_dir), load_format="auto", skip_tokenizer_init=True, pipeline_parallel_size=2,
                distributed_executor_backend=backend,
                speculative_config={"method": "mtp", "num_speculative_tokens": NUM_SPEC},
                enforce_eager=True, max_model_len=4096, gpu_memory_utilization=0.3, seed=0,
                additional_config=gdn_prefill_config())


def embedq_prompts() -> list[list[int]]:
    def ids(start: int, n: int) -> list[int]:
        return [3 + (start + 7 * i) % 4000 for i in range(n)]

    return [ids(11, 24), ids(500, 90), ids(1234, 300), ids(2345, 700)]


# DFlash2 (a scaled-down drafter of the reference's shape next to the hybrid): stock vLLM on one rank
# against the plugin under PP=2, token for token. Both runs: bf16, eager, the same seeded weights
# (load_format="auto"), the same GDN prefill kernel, split-K GEMMs off (gpu_tokens.run_env). The
# plugin's split is pinned to 4/4, the split gpu_models.DFLASH_TARGET_LAYER_IDS are spread over.
# The target's attention is Triton's in both: the virtual pair's ranks take it anyway
# (gpu_harness.VIRTUAL_PAIR_ATTENTION), and stock would take FlashAttention on the H200. The
# drafter's backend is vLLM's choice in both (spec_decode/dflash/utils.py:27-33: the drafter's own,
# speculative_config.attention_backend, unset; one that takes its non-causal layers), on the same H200.
DFLASH_TOKENS = 7  # the reference launchers' (benchmarks/headline.py DFLASH_TOKENS)
DFLASH_MAX_MODEL_LEN = 2048  # the long prompt (1500) + 48 new tokens + the drafter's lookahead
DFLASH_MAX_TOKENS = 48
DFLASH_ENV = {"VLLM_PP_LAYER_PARTITION": ",".join(map(str, gm.DFLASH_SPLIT))}


def dflash_kwargs(model_dir, drafter, pp: int) -> dict:
    """pp=1: stock vLLM (no executor named: vLLM's own on one GPU, which it must have to itself,
    gpu_tokens.engine_kwargs); pp=2: the plugin, at the other spec runs' utilization."""
    kw = dict(model=str(model_dir), load_format="auto", skip_tokenizer_init=True, dtype="bfloat16",
              enforce_eager=True, max_model_len=DFLASH_MAX_MODEL_LEN, enable_prefix_caching=True, seed=0,
              additional_config=gdn_prefill_config(), disable_log_stats=False, attention_backend="TRITON_ATTN",
              speculative_config={"method": "dflash", "model": str(drafter), "num_speculative_tokens": DFLASH_TOKENS})
    if pp > 1:
        kw.update(pipeline_parallel_size=pp, distributed_executor_backend="dualgpu", gpu_memory_utilization=0.3)
    return kw
