"""Patches of vLLM's linear-kernel selection: SM89 ranks prefer the Triton block-FP8 kernel, and
each rank asks whether CUTLASS block FP8 runs on its own card.

``choose_scaled_mm_linear_kernel`` is called as a module global (by ``init_fp8_linear_kernel``
and the other ``init_*`` selectors of the same module) and no other module holds a copy
(vLLM 0.30.0). The wrapper only touches calls that pass the module's own
``_POSSIBLE_FP8_BLOCK_KERNELS``, and decides per call by the current device (see
:mod:`vllm_dualgpu.kernels.fp8_preference`), and notes the block-FP8 kernel each rank took in that
rank's summary line (vLLM says it for the first rank only).
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable

from vllm_dualgpu import rank_summary
from vllm_dualgpu.kernels import fp8_preference
from vllm_dualgpu.patching.core import like


def wrap_choose_scaled_mm_linear_kernel(original: Callable) -> Callable:
    module = sys.modules[original.__module__]

    @functools.wraps(original)
    def choose_scaled_mm_linear_kernel(config, possible_kernels, compute_capability=None,
                                       force_kernel=None, *, quantization):
        block_kernels = getattr(module, "_POSSIBLE_FP8_BLOCK_KERNELS", None)
        vllms_block_list = possible_kernels is block_kernels and block_kernels is not None
        if vllms_block_list:
            possible_kernels = fp8_preference.reordered_kernels(
                possible_kernels, module.PlatformEnum.CUDA, compute_capability
            )
        chosen = original(config, possible_kernels, compute_capability, force_kernel,
                          quantization=quantization)
        if vllms_block_list:
            rank_summary.add(BLOCK_KERNEL_KEY, getattr(chosen, "__name__", str(chosen)))
        return chosen

    return choose_scaled_mm_linear_kernel


BLOCK_KERNEL_KEY = "block-fp8 kernel"
"""``rank_summary`` key: the block-FP8 kernel(s) this rank selected. vLLM logs its "Selected ..."
line once for the whole run (``info_once``, scope global), so only the first rank says its own."""


SUMMARY_KEY = "cutlass-block-fp8"
"""``rank_summary`` key: said where a rank's answer differs from vLLM's import-time one."""


def wrap_cutlass_block_fp8_is_supported(original: Callable) -> Callable:
    """``CutlassFp8BlockScaledMMKernel.is_supported(cls, compute_capability=None)``, asked of the
    current device at each call.

    vLLM's method reads ``CUTLASS_BLOCK_FP8_SUPPORTED``, which ``w8a8_utils`` computes once at
    import; a worker imports it with its worker class, before it sets its device, so the answer
    is device 0's on every rank. The replacement mirrors the method (the registry pins its
    source) with the constant replaced by vLLM's own ``cutlass_block_fp8_supported()``, evaluated
    now: the current device's capability once CUDA is initialised (capability-per-rank), device
    0's before, as vLLM's import did.
    """
    from vllm.model_executor.layers.quantization.utils import w8a8_utils

    module = sys.modules[original.__module__]

    def is_supported(cls, compute_capability=None):
        live = w8a8_utils.cutlass_block_fp8_supported()
        here = w8a8_utils.current_platform.get_device_capability()
        sm = here.as_version_str() if here is not None else "unknown"
        imported = getattr(module, "CUTLASS_BLOCK_FP8_SUPPORTED", live)
        if live != imported:  # the rank's summary line says where it parts from vLLM's answer
            rank_summary.note(SUMMARY_KEY, f"{'on for' if live else 'off on'} this rank (SM {sm}); vLLM's "
                                           f"import-time answer (device 0's) was {'on' if imported else 'off'}")
        if not live:
            return (
                False,
                f"vLLM's CUTLASS block-FP8 kernels do not support this rank's device (compute capability {sm}).",
            )
        return True, None

    return like(original, is_supported)
