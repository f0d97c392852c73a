"""One attention backend on every rank when mismatched cards would pick different ones.

vLLM picks each rank's attention backend from that rank's GPU. With an fp8 KV cache, ranks of
different compute capability can pick different backends (seen on the virtual pair with vLLM
0.33: FlashInfer on the capability-8.9 rank, FlashAttention on the 9.0 one). In vLLM 0.33 (not
0.30) a layer's KV spec carries its backend's block-stride alignment (FlashInfer: a multiple of
64 tokens; FlashAttention: none), so the two ranks' full-attention layers no longer merge into one
KV cache group. vLLM then groups a Qwen3.5 hybrid's 65 KV layers in 22 groups of 3 instead of 4
of 16/17, and a request claims blocks in six attention groups instead of one: on the headline's
fp8-mtp arm (split 15/49) rank 0's 4.60 GiB held 112,000 tokens where one group holds 262,144.

Under dualgpu with PP > 1, when the ranks differ in capability, the KV cache is fp8, and the user
chose no backend, the executor sets FlashInfer (which runs on every capability the planner knows,
with fp8 KV) for every rank, before the workers start, in the config they receive.

A DFlash drafter whose target runs FlashInfer gets TRITON_ATTN unless the user chose its backend
(``speculative_config.attention_backend``): the planner's rule, ``planner.memory.
drafter_attention_backend``, which says why.
"""

from __future__ import annotations

from collections.abc import Iterable

from vllm_dualgpu.log import logger

COMMON_BACKEND = "FLASHINFER"


def decide_common_backend(capabilities: Iterable[tuple[int, int]], kv_cache_dtype: str,
                          user_backend: object, specs_carry_alignment: bool,
                          uses_mla: bool = False) -> tuple[str | None, str]:
    """(the backend to set on every rank, or None; why)."""
    caps = sorted({(int(c[0]), int(c[1])) for c in capabilities if c is not None})
    if user_backend is not None:
        return None, f"the attention backend was chosen ({user_backend})"
    if uses_mla:
        return None, "the model uses MLA, whose backends are not FlashInfer's"
    if len(caps) < 2:
        return None, "the ranks share one compute capability"
    if not str(kv_cache_dtype).startswith("fp8"):
        return None, f"the KV cache is {kv_cache_dtype}, where vLLM's choices share one block layout"
    if not specs_carry_alignment:
        return None, "this vLLM's KV specs do not carry the backend's block alignment"
    listed = ", ".join(f"{a}.{b}" for a, b in caps)
    return COMMON_BACKEND, (
        f"ranks differ in compute capability ({listed}) with an fp8 KV cache: vLLM may pick "
        "FlashInfer on one and FlashAttention on another, whose KV specs do not group together "
        "(a request then claims blocks in several attention groups: up to 6x the KV per token); "
        "pass --attention-backend to choose another")


def apply_common_backend(vllm_config, capabilities: Iterable[tuple[int, int]]) -> str | None:
    """Executor side, before the workers spawn: set ``attention_config.backend`` where
    :func:`decide_common_backend` says so, and log it. Returns the backend set, or None."""
    attention = getattr(vllm_config, "attention_config", None)
    if attention is None or not hasattr(attention, "backend"):
        return None
    from vllm.v1.kv_cache_interface import AttentionSpec

    fields = getattr(AttentionSpec, "__dataclass_fields__", {})
    backend, why = decide_common_backend(
        capabilities, vllm_config.cache_config.cache_dtype, attention.backend,
        "block_stride_alignment" in fields, bool(getattr(vllm_config.model_config, "use_mla", False)))
    if backend is None:
        logger.debug("vllm-dualgpu: attention backend left to vLLM: %s", why)
        return None
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    attention.backend = AttentionBackendEnum[backend]
    logger.info("vllm-dualgpu: attention backend %s on every rank: %s", backend, why)
    return backend


def apply_drafter_backend(vllm_config, capabilities: Iterable[tuple[int, int]]) -> str | None:
    """Executor side, before the workers spawn: the drafter's attention backend where the
    planner's rule sets one the user did not (``speculative_config.attention_backend``), asked
    as the planner asks it (the target on FlashInfer: ``attention_uses_flashinfer``). Returns the
    backend set, or None."""
    from vllm_dualgpu.planner.memory import attention_uses_flashinfer, drafter_attention_backend

    spec = getattr(vllm_config, "speculative_config", None)
    if spec is None or not hasattr(spec, "attention_backend") or spec.attention_backend is not None:
        return None
    target = attention_uses_flashinfer(str(vllm_config.cache_config.cache_dtype), list(capabilities))
    backend = drafter_attention_backend({"method": spec.method}, target)
    if backend is None:
        return None
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    spec.attention_backend = AttentionBackendEnum[backend]
    logger.info("vllm-dualgpu: the %s drafter's attention on %s (its window layers are a KV group of their "
                "own; on FlashInfer the last rank would hold a second workspace); set \"attention_backend\" in "
                "--speculative-config to choose another", spec.method, backend)
    return backend
