"""Shared checks of the patches that change behaviour only in a dualgpu run.

Every question goes to :func:`vllm_dualgpu.process.is_dualgpu_run`: code that holds a config
passes it (that works in every process, also before the executor exists); code without one
(model code in a worker) asks the process, where ``DualGpuWorker`` noted its config.
"""

from __future__ import annotations

from vllm_dualgpu.process import is_dualgpu_run


def is_dualgpu_config(vllm_config: object) -> bool:
    """Whether ``vllm_config`` selects a dualgpu executor (``dualgpu`` or ``dualgpu-ray``)."""
    return is_dualgpu_run(vllm_config)


def is_dualgpu_pp(vllm_config: object) -> bool:
    """A dualgpu run with more than one pipeline stage."""
    if not is_dualgpu_run(vllm_config):
        return False
    return vllm_config.parallel_config.pipeline_parallel_size > 1  # type: ignore[attr-defined]


def uses_v2_model_runner(vllm_config: object) -> bool:
    """Whether the workers run vLLM's V2 model runner: ``VllmConfig.use_v2_model_runner`` up to
    vLLM 0.33; vLLM 0.34 removed the V1 runner and the property with it, so there it is always
    the V2 runner."""
    return bool(getattr(vllm_config, "use_v2_model_runner", True))


__all__ = ["is_dualgpu_config", "is_dualgpu_pp", "is_dualgpu_run", "uses_v2_model_runner"]
