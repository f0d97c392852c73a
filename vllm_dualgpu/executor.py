"""``DualGpuExecutor``: vLLM's multiprocess executor, planned for two mismatched GPUs.

Selected with ``--distributed-executor-backend dualgpu``. Keep this module free of side
effects: EngineCore unpickles the config (which names this class) before plugins load.
"""

from __future__ import annotations

import os

from vllm.v1.executor.multiproc_executor import MultiprocExecutor

from vllm_dualgpu.log import logger
from vllm_dualgpu.process import ACTIVE_ENV


class DualGpuExecutor(MultiprocExecutor):
    """Multiprocess executor that applies a dualgpu plan before spawning its workers."""

    supports_pp: bool = True

    def _init_executor(self) -> None:
        # Workers are spawned by super()._init_executor() and inherit this environment; the
        # worker-side patches act only where it is set.
        os.environ[ACTIVE_ENV] = "1"
        logger.info(
            "DualGpuExecutor: %d rank(s), pipeline_parallel_size=%d",
            self.world_size,
            self.parallel_config.pipeline_parallel_size,
        )
        super()._init_executor()
