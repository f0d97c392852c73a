"""Patch of ``vllm.model_executor.kernels.linear``: SM89 ranks prefer the Triton block-FP8 kernel.

``choose_scaled_mm_linear_kernel`` is called as a module global (by ``init_fp8_linear_kernel``
and the other ``init_*`` selectors of the same module) and no other module holds a copy
(vLLM 0.30.0). The wrapper only touches calls that pass the module's own
``_POSSIBLE_FP8_BLOCK_KERNELS``, and decides per call by the current device (see
:mod:`vllm_dualgpu.kernels.fp8_preference`).
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable

from vllm_dualgpu.kernels import fp8_preference


def wrap_choose_scaled_mm_linear_kernel(original: Callable) -> Callable:
    module = sys.modules[original.__module__]

    @functools.wraps(original)
    def choose_scaled_mm_linear_kernel(config, possible_kernels, compute_capability=None,
                                       force_kernel=None, *, quantization):
        block_kernels = getattr(module, "_POSSIBLE_FP8_BLOCK_KERNELS", None)
        if possible_kernels is block_kernels and block_kernels is not None:
            possible_kernels = fp8_preference.reordered_kernels(
                possible_kernels, module.PlatformEnum.CUDA, compute_capability
            )
        return original(config, possible_kernels, compute_capability, force_kernel,
                         quantization=quantization)

    return choose_scaled_mm_linear_kernel
