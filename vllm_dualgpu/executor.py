"""The dualgpu executor's public path: ``vllm_dualgpu.executor.DualGpuExecutor``.

What a user types in vLLM's ``module.Class`` form (``--distributed-executor-backend
vllm_dualgpu.executor.DualGpuExecutor``), the same class as the bare name ``dualgpu``. The
class lives in :mod:`vllm_dualgpu.engine.executor`, beside the rest of the engine side.
"""

from __future__ import annotations

from vllm_dualgpu.engine.executor import DualGpuExecutor

__all__ = ["DualGpuExecutor"]
