"""``DualGpuRayExecutor``: vLLM's Ray executor (RayExecutorV2), planned across machines.

Selected with ``--distributed-executor-backend dualgpu-ray``. vLLM 0.30 runs RayExecutorV2 for
``ray`` by default (``VLLM_USE_RAY_V2_EXECUTOR_BACKEND=1``) and 0.33 has no other, so this is
the one Ray executor of the supported range. Keep this module free of side effects: EngineCore
unpickles the config (which names this class) before plugins load.
"""

from __future__ import annotations

from vllm.v1.executor.ray_executor_v2 import RayExecutorV2

from vllm_dualgpu.engine.planned_executor import PlannedExecutor


class DualGpuRayExecutor(PlannedExecutor, RayExecutorV2):
    """Ray executor that gathers every node's GPU facts and applies a plan before its workers start."""

    supports_pp: bool = True

    def _init_executor(self) -> None:
        import os

        from vllm_dualgpu.engine import ray_planning

        # The plan exports the bundle indices for vLLM's worker start only: once the workers run
        # (or failed to start), the process's environment is as before, so a later engine in it
        # plans afresh instead of meeting this one's value.
        before = os.environ.get(ray_planning.BUNDLE_ENV)
        try:
            self.start_planned(ray_planning.planning_applies, ray_planning.apply_cluster_plan,
                               "vLLM's Ray executor")
            super()._init_executor()
        finally:
            if before is None:
                os.environ.pop(ray_planning.BUNDLE_ENV, None)
            else:
                os.environ[ray_planning.BUNDLE_ENV] = before
