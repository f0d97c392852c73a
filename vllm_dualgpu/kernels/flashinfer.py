"""FlashInfer under PP: the CuTe-DSL target per rank, and no autotune across pipeline stages.

- ``CUTE_DSL_ARCH``: the CuTe DSL (``nvidia-cutlass-dsl``, used by FlashInfer's and vLLM's
  CuTe-DSL kernels) compiles for ``CUTE_DSL_ARCH`` when set, else for the capability of CUDA
  device 0 (``cutlass.base_dsl.env_manager.detect_gpu_arch`` asks ``cuDeviceGet(0)``), i.e. the
  other rank's card on rank 1. It reads the variable when ``cutlass`` is first imported, so each
  worker sets it for its own device after the device is chosen and before any CuTe-DSL import:
  :func:`set_cute_dsl_arch_for_current_device`.
- FlashInfer autotune (``kernel_config.enable_flashinfer_autotune``, read by
  ``vllm/model_executor/warmup/kernel_warmup.py``) runs only on ranks with SM 9.0+ and averages
  each tactic's timing over vLLM's *world* group. Pipeline stages run different layers, so
  they tune different ops in different rounds and the collectives stop matching: the boot hangs
  (vLLM issue #52291; the per-stage-group fix, PR #57198, was not merged). Ranks that differ in
  capability hang even sooner (only SM 9.0+ ranks join). With more than one stage, autotune is
  off. The executor decides before it spawns workers, from the capabilities NVML reports for
  the GPUs it uses: :func:`decide_flashinfer_autotune` / :func:`apply_flashinfer_autotune_policy`.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable, MutableMapping

from vllm_dualgpu import rank_summary
from vllm_dualgpu.log import logger

CUTE_DSL_ARCH = "CUTE_DSL_ARCH"


def cute_dsl_arch(capability: tuple[int, int]) -> str:
    """The CuTe DSL's own name for a capability's target, as its auto-detection spells it.

    ``sm_{major}{minor}`` plus the architecture-specific ``a`` from SM 9.0 on (the DSL's
    ``detect_gpu_arch``): (8, 9) -> ``sm_89``, (9, 0) -> ``sm_90a``, (12, 0) -> ``sm_120a``.
    """
    major, minor = (int(x) for x in capability)
    return f"sm_{major}{minor}{'a' if major >= 9 else ''}"


def apply_cute_dsl_arch(
    capability: tuple[int, int], environ: MutableMapping[str, str] | None = None
) -> tuple[str, str]:
    """Set ``CUTE_DSL_ARCH`` for this process's GPU unless the user set it: (value, why)."""
    env = os.environ if environ is None else environ
    user_value = env.get(CUTE_DSL_ARCH)
    if user_value:
        value, why = user_value, "set by the user, left as is"
    else:
        value = env[CUTE_DSL_ARCH] = cute_dsl_arch(capability)
        why = f"from this rank's capability {capability[0]}.{capability[1]}"
        if "cutlass" in sys.modules:
            why += "; the CuTe DSL was imported earlier and may already target device 0"
            logger.warning("vllm-dualgpu: CUTE_DSL_ARCH=%s set after the CuTe DSL was imported; "
                           "its kernels may still target GPU 0's architecture", value)
    rank_summary.note(CUTE_DSL_ARCH, f"{value} ({why})")
    return value, why


def set_cute_dsl_arch_for_current_device() -> tuple[str, str]:
    """Worker side, once its CUDA device is set: :func:`apply_cute_dsl_arch` for that device."""
    import torch

    return apply_cute_dsl_arch(torch.cuda.get_device_capability(torch.cuda.current_device()))


def _cap(c: tuple[int, int]) -> str:
    return f"{c[0]}.{c[1]}"


def decide_flashinfer_autotune(
    capabilities: Iterable[tuple[int, int]], user_value: bool | None
) -> tuple[bool | None, str]:
    """Whether FlashInfer autotune may run, given each rank's capability (rank order).

    ``user_value`` is ``kernel_config.enable_flashinfer_autotune`` as configured (vLLM's
    optimization level fills it in when the user did not). Ranks of different capabilities
    turn it off, whatever it was; so do two or more pipeline stages on equal cards (see the
    module docstring); one rank keeps the configured value.
    """
    caps = [(int(c[0]), int(c[1])) for c in capabilities]
    distinct = sorted(set(caps))
    if len(distinct) > 1:
        listed = ", ".join(f"rank {r}: {_cap(c)}" for r, c in enumerate(caps))
        why = (
            f"ranks differ in compute capability ({listed}): FlashInfer autotune runs only on "
            "SM 9.0+ ranks and averages timings over all of them, so the ranks would wait for "
            "each other forever"
        )
        return False, ("kept off: " if user_value is False else "turned off: ") + why
    if len(caps) > 1:
        why = (
            f"{len(caps)} pipeline stages (capability {_cap(distinct[0])}): vLLM averages autotune "
            "timings over the world group, but each stage tunes different ops, so the ranks' "
            "collectives stop matching and the boot hangs (vLLM #52291, #57198)"
        )
        return False, ("kept off: " if user_value is False else "turned off: ") + why
    same = _cap(distinct[0]) if distinct else "unknown"
    return user_value, f"one rank, capability {same}: left as configured ({user_value})"


def apply_flashinfer_autotune_policy(
    kernel_config, capabilities: Iterable[tuple[int, int]]
) -> bool | None:
    """Executor side, before workers spawn: set ``kernel_config.enable_flashinfer_autotune``.

    Logs a WARNING when mixed capabilities turn a configured ``True`` off, INFO for any other
    change (turning it off for pipeline stages is this package's normal case, not a problem).
    """
    caps = [tuple(c) for c in capabilities]
    before = kernel_config.enable_flashinfer_autotune
    value, why = decide_flashinfer_autotune(caps, before)
    if value != before:
        kernel_config.enable_flashinfer_autotune = value
        log = logger.warning if before and len(set(caps)) > 1 else logger.info
        log("vllm-dualgpu: FlashInfer autotune %s", why)
    else:
        logger.debug("vllm-dualgpu: FlashInfer autotune %s", why)
    return value
