"""``DualGpuRayExecutor``: vLLM's Ray executor (RayExecutorV2), planned across machines.

Selected with ``--distributed-executor-backend dualgpu-ray``. vLLM 0.30 runs RayExecutorV2 for
``ray`` by default (``VLLM_USE_RAY_V2_EXECUTOR_BACKEND=1``) and 0.33 has no other, so this is
the one Ray executor of the supported range. Keep this module free of side effects: EngineCore
unpickles the config (which names this class) before plugins load.
"""

from __future__ import annotations

import os

from vllm.v1.executor.ray_executor_v2 import RayExecutorV2

from vllm_dualgpu.log import logger
from vllm_dualgpu.process import ACTIVE_ENV


class DualGpuRayExecutor(RayExecutorV2):
    """Ray executor that gathers every node's GPU facts and applies a plan before its workers start."""

    supports_pp: bool = True

    def _init_executor(self) -> None:
        from vllm_dualgpu import plugin
        from vllm_dualgpu.engine import ray_planning
        from vllm_dualgpu.process import ENGINE

        plugin.ensure(frozenset({ENGINE}))
        self.dualgpu = None
        why_not = ray_planning.planning_applies(self.parallel_config)
        if why_not is not None:
            os.environ.pop(ACTIVE_ENV, None)
            logger.info("vllm-dualgpu: %s, running as vLLM's Ray executor", why_not)
        else:
            from vllm_dualgpu.engine import preflight
            from vllm_dualgpu.kernels.flashinfer import apply_flashinfer_autotune_policy

            preflight.check_platform(self.parallel_config)
            plugin.ensure_for_dualgpu(frozenset({ENGINE}))
            try:
                self.dualgpu = ray_planning.apply_cluster_plan(self.vllm_config)
            except (ValueError, RuntimeError) as e:  # the refusals: one ERROR line, then vLLM's traceback
                logger.error("%s", e)
                raise
            apply_flashinfer_autotune_policy(
                self.vllm_config.kernel_config, [g.capability for g in self.dualgpu.gpus]
            )
            # Ray workers get the engine's environment (get_driver_env_vars, with setdefault).
            os.environ[ACTIVE_ENV] = "1"
        super()._init_executor()

    def determine_available_memory(self) -> list[int]:
        available = super().determine_available_memory()
        if self.dualgpu is not None:
            from vllm_dualgpu.engine.context_fit import check_context_fits

            check_context_fits(self.vllm_config, self.get_kv_cache_specs(), available, self.dualgpu)
        return available
