"""Patch of ``vllm.model_executor.layers.quantization.utils.fp8_utils``: per-rank config lookup.

``get_w8a8_block_fp8_configs(N, K, block_n, block_k)`` is lru_cached and called as a module
global by ``w8a8_triton_block_scaled_mm`` on every block-FP8 Triton GEMM; no other module holds a
copy (vLLM 0.30.0). The replacement names the card by the current CUDA device and searches the
user folder, the package's ``kernel_configs/`` and vLLM's folder (see
:mod:`vllm_dualgpu.kernels.fp8_configs`). Until CUDA is initialised it is vLLM's function.
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable

from vllm_dualgpu.kernels import fp8_configs


def vllm_configs_dir(original: Callable) -> str | None:
    """The ``configs/`` folder next to the module defining ``original``, as vLLM computes it."""
    module = sys.modules.get(getattr(original, "__module__", ""), None)
    path = getattr(module, "__file__", None)
    if path is None:
        return None
    return os.path.join(os.path.dirname(os.path.realpath(path)), "configs")


def wrap_get_w8a8_block_fp8_configs(original: Callable) -> Callable:
    vllm_dir = vllm_configs_dir(original)
    current = fp8_configs.current_device_file_name
    lookup = fp8_configs.cached_lookup

    @functools.wraps(original)
    def get_w8a8_block_fp8_configs(N, K, block_n, block_k):
        device_name = current()
        if device_name is None:
            return original(N, K, block_n, block_k)
        return lookup(N, K, block_n, block_k, device_name, vllm_dir)

    def cache_clear() -> None:
        fp8_configs.reset_for_tests()
        if hasattr(original, "cache_clear"):
            original.cache_clear()

    get_w8a8_block_fp8_configs.cache_clear = cache_clear  # type: ignore[attr-defined]
    get_w8a8_block_fp8_configs.cache_info = lookup.cache_info  # type: ignore[attr-defined]
    return get_w8a8_block_fp8_configs
