"""FlashInfer's XQA decode on SM 9.0 / 12.x ranks that cannot reach NVIDIA's artifactory (#26).

vLLM's ``supports_trtllm_attention`` answers False unless ``has_nvidia_artifactory()`` (the
``flashinfer-cubin`` package, ``VLLM_HAS_FLASHINFER_CUBIN``, or an HTTP 200 from NVIDIA's
artifactory within 5 s). On SM 9.0 and 12.x the decode kernel it gates is XQA, which FlashInfer
builds from source by JIT and downloads nothing for; without it the FlashInfer backend verifies
speculative tokens as prefills without a KV split, which grows with the context. The wrapper
answers True for decode there, on the rank's current device, when the JIT can build (nvcc and
ninja, as vLLM's ``has_flashinfer()`` tests) and batch invariance is off; every other call is
vLLM's answer. ``can_use_trtllm_attention`` checks ``--attention-config use_trtllm_attention``
first, so a user's explicit False still wins.
"""

from __future__ import annotations

import functools
import os
import shutil
import sys
from collections.abc import Callable

from vllm_dualgpu.log import logger
from vllm_dualgpu.patching.core import like

_said: set[str] = set()


@functools.cache
def jit_can_build(module) -> bool:
    """nvcc where FlashInfer's JIT looks (vLLM 0.32+'s ``_flashinfer_nvcc_path``; the same rule
    on 0.30/0.31, whose ``has_flashinfer`` only asks PATH) and ``ninja`` on PATH."""
    nvcc_path = getattr(module, "_flashinfer_nvcc_path", None)
    if nvcc_path is not None:
        nvcc = nvcc_path()
    else:
        home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
        found = shutil.which("nvcc")
        home = home or (os.path.dirname(os.path.dirname(found)) if found else "/usr/local/cuda")
        nvcc = shutil.which(os.path.join(home, "bin", "nvcc"))
    return nvcc is not None and shutil.which("ninja") is not None


def xqa_sm(module) -> str | None:
    """The current device's capability ("9.0", "12.0") when it is one that decodes with XQA."""
    from vllm_dualgpu.planner.memory import xqa_capability

    cap = module.current_platform.get_device_capability()  # the rank's own (capability-per-rank)
    if cap is None or not xqa_capability((cap.major, cap.minor)):
        return None
    return cap.as_version_str()


def wrap_supports_trtllm_attention(original: Callable) -> Callable:
    module = sys.modules[original.__module__]

    def supports_trtllm_attention(is_prefill: bool = False) -> bool:
        answer = original(is_prefill=is_prefill)
        if answer or is_prefill or module.envs.VLLM_BATCH_INVARIANT or module.has_nvidia_artifactory():
            return answer
        sm = xqa_sm(module)
        if sm is None or not jit_can_build(module):
            return answer
        if sm not in _said:
            _said.add(sm)
            logger.info(
                "vllm-dualgpu rank %s: FlashInfer XQA decode on (SM %s): NVIDIA's artifactory is "
                "unreachable and flashinfer-cubin is not installed, so vLLM would decode without "
                "XQA (with a drafter it verifies speculative tokens as prefills without a KV split: "
                "measured 227 vs 49 ms a step at 250K tokens); FlashInfer builds XQA from source "
                "here (nvcc, ninja)", _rank(), sm)
        return True

    return like(original, supports_trtllm_attention)


def _rank() -> str:
    import torch.distributed as dist

    return str(dist.get_rank()) if dist.is_available() and dist.is_initialized() else "?"
