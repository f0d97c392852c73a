"""Shared checks for the speculative-decoding-under-PP patches (issue #6).

Every patch of this family changes behaviour only when the ``dualgpu`` executor drives the run.
Code that holds a config asks the config (that works in every process, also before the
executor exists); code without one asks the environment that ``DualGpuExecutor`` sets in its
own process and passes to its workers.
"""

from __future__ import annotations

from vllm_dualgpu.process import dualgpu_active

EXECUTOR_NAME = "DualGpuExecutor"


def is_dualgpu_config(vllm_config: object) -> bool:
    """Whether ``vllm_config`` selects the dualgpu executor (the class, as arg_utils stores it)."""
    parallel = getattr(vllm_config, "parallel_config", None)
    backend = getattr(parallel, "distributed_executor_backend", None)
    return isinstance(backend, type) and backend.__name__ == EXECUTOR_NAME


def is_dualgpu_pp(vllm_config: object) -> bool:
    """A dualgpu run with more than one pipeline stage."""
    if not is_dualgpu_config(vllm_config):
        return False
    return vllm_config.parallel_config.pipeline_parallel_size > 1  # type: ignore[attr-defined]


__all__ = ["EXECUTOR_NAME", "dualgpu_active", "is_dualgpu_config", "is_dualgpu_pp"]
