"""On SM89 ranks, prefer vLLM's native block-FP8 Triton kernel over Marlin.

vLLM 0.30 picks the kernel of a block-FP8 linear layer by walking
``_POSSIBLE_FP8_BLOCK_KERNELS[PlatformEnum.CUDA]`` (model_executor/kernels/linear/__init__.py)
in order: FlashInfer-DeepGEMM, DeepGEMM, CUTLASS, B12x, Marlin, Humming, Triton, torch. On SM89
(RTX 40 series, L4, L40) the first three need SM90+ and B12x needs SM120, so Marlin wins: it
expands the FP8 weights to 16 bit and runs a weight-only GEMM, although the card has FP8 tensor
cores that the Triton kernel uses. The reference setup measured Triton +1% per decode step with
tuned configs (+9% untuned) and 12-18% faster prefill on an RTX 4070 Ti SUPER.

The list is a module-level dict that ``init_fp8_linear_kernel`` passes, at call time, to
``choose_scaled_mm_linear_kernel``. Wrapping the latter (no module holds a copy of it) lets each
rank decide by its own current device when its layers are built, after ``init_device``; other
ranks, other lists and other platforms are passed through untouched, so the copies of
``init_fp8_linear_kernel`` held by the quantization modules need no rebinding.
``VLLM_DUALGPU_SM89_TRITON_FP8=0`` keeps vLLM's order. ``VLLM_DISABLED_KERNELS`` and
``--linear-backend`` keep working (vLLM applies them after the reordering).
"""

from __future__ import annotations

import os
import threading

from vllm_dualgpu.log import logger

ENV = "VLLM_DUALGPU_SM89_TRITON_FP8"
SUMMARY_KEY = "fp8-kernel"
TRITON = "TritonFp8BlockScaledMMKernel"
MARLIN = "MarlinFP8ScaledMMLinearKernel"
SM89 = (8, 9)

_lock = threading.Lock()
_logged = False


def enabled(env: dict | None = None) -> bool:
    value = (os.environ if env is None else env).get(ENV, "1").strip().lower()
    return value not in ("0", "false", "no", "off")


def current_capability() -> tuple[int, int] | None:
    """(major, minor) of the current CUDA device as vLLM's platform answers it, the answer vLLM's
    own kernel checks (``is_supported_and_can_implement_kernel``) decide by; None while CUDA is
    not initialised. Asked for the current device's visible ordinal, which vLLM's CUDA platforms
    take for capabilities. On the virtual pair (docs/virtual-gpus.md) the platform answers the
    card a rank presents while torch answers the physical GPU: the virtual pair's 14B FP8 run on
    vLLM 0.33.0 (2026-12-03) read torch's 9.0 on the rank presenting SM 8.9, and vLLM chose
    Marlin there."""
    import torch

    if not torch.cuda.is_initialized():
        return None
    from vllm.platforms import current_platform

    cap = current_platform.get_device_capability(torch.cuda.current_device())
    return None if cap is None else (int(cap[0]), int(cap[1]))


def capability_of(compute_capability: int | None) -> tuple[int, int] | None:
    """The capability to decide by: an explicit one from the caller (89 -> (8, 9)), else the
    current device's."""
    if compute_capability is not None:
        return divmod(int(compute_capability), 10)
    return current_capability()


def triton_first(kernels: list) -> list:
    """``kernels`` with the Triton block-FP8 kernel moved just ahead of Marlin (so also ahead of
    anything after Marlin); the same list object when there is nothing to move."""
    names = [k.__name__ for k in kernels]
    if TRITON not in names or MARLIN not in names:
        return kernels
    t, m = names.index(TRITON), names.index(MARLIN)
    if t < m:
        return kernels
    out = list(kernels)
    triton = out.pop(t)
    out.insert(m, triton)
    return out


def prefer_triton_here(compute_capability: int | None = None, env: dict | None = None) -> bool:
    """True on SM89 devices unless turned off."""
    return enabled(env) and capability_of(compute_capability) == SM89


def _note(reordered: bool) -> None:
    global _logged
    from vllm_dualgpu import rank_summary

    with _lock:
        first = not _logged
        _logged = True
    if reordered:
        rank_summary.note(SUMMARY_KEY, f"Triton ahead of Marlin (SM89; {ENV}=0 keeps vLLM's order)")
    if first and reordered:
        logger.info(
            "vllm-dualgpu: SM89 GPU on this rank: block-FP8 layers use %s ahead of %s "
            "(%s=0 keeps vLLM's order)", TRITON, MARLIN, ENV,
        )


def reordered_kernels(possible_kernels: dict, cuda_key: object, compute_capability: int | None):
    """``possible_kernels`` as this rank should see it: a copy with the CUDA list reordered on
    SM89 ranks, else the same dict."""
    if not prefer_triton_here(compute_capability):
        return possible_kernels
    kernels = possible_kernels.get(cuda_key)
    if not kernels:
        return possible_kernels
    new = triton_first(kernels)
    if new is kernels:
        return possible_kernels
    _note(True)
    return {**possible_kernels, cuda_key: new}


def reset_for_tests() -> None:
    global _logged
    with _lock:
        _logged = False
