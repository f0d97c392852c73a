"""``DualGpuExecutor``: vLLM's multiprocess executor, planned for two mismatched GPUs.

Selected with ``--distributed-executor-backend dualgpu``. Keep this module free of side
effects: EngineCore unpickles the config (which names this class) before plugins load.
"""

from __future__ import annotations

import os

from vllm.v1.executor.multiproc_executor import MultiprocExecutor

from vllm_dualgpu.log import logger
from vllm_dualgpu.process import ACTIVE_ENV


def planning_applies(parallel_config) -> str | None:
    """None when the dualgpu plan applies, else why the executor behaves like stock."""
    # TP groups as pipeline stages are planned (planner/tp_stages.py); TP alone is stock vLLM's.
    if parallel_config.pipeline_parallel_size < 2:
        return "pipeline_parallel_size=1"
    if parallel_config.data_parallel_size != 1 or parallel_config.nnodes > 1:
        return "data parallel or multi-node runs"
    return None


def dead_rank_lines(workers, gpus=None, tp_size: int = 1) -> list[str]:
    """One line per worker process that has ended: its rank (with TP stages also its stage and
    TP rank), GPU and exit status."""
    lines = []
    for h in workers:
        code = h.proc.exitcode
        if code is None:
            continue
        gpu = gpus[h.rank] if gpus and h.rank < len(gpus) else None
        where = f" (GPU {gpu.physical_id}: {gpu.name})" if gpu else ""
        if code < 0:
            how = f"was killed by signal {-code}"
            if -code == 9:
                how += " (SIGKILL: out of host memory, or killed from outside)"
        else:
            how = f"exited with status {code}"
            if code == 1:
                how += " (a rank that runs out of GPU memory in warm-up ends itself: see its ERROR line above)"
        who = (f"pipeline rank {h.rank}" if tp_size == 1
               else f"rank {h.rank} (stage {h.rank // tp_size}, TP rank {h.rank % tp_size})")
        lines.append(f"vllm-dualgpu: {who}{where} {how}; the engine shuts down "
                     "and fails its requests")
    return lines


class DualGpuExecutor(MultiprocExecutor):
    """Multiprocess executor that applies a dualgpu plan before spawning its workers."""

    supports_pp: bool = True

    def _init_executor(self) -> None:
        from vllm_dualgpu import plugin
        from vllm_dualgpu.process import ENGINE

        # With LLM(...) vLLM forks EngineCore, which then skips general plugins: apply the
        # engine-side patches here (a no-op where register() already did).
        plugin.ensure(frozenset({ENGINE}))
        self.dualgpu = None
        why_not = planning_applies(self.parallel_config)
        if why_not is not None:
            os.environ.pop(ACTIVE_ENV, None)
            logger.info("vllm-dualgpu: %s, running as vLLM's multiprocess executor", why_not)
        else:
            from vllm_dualgpu.engine import preflight
            from vllm_dualgpu.engine.planning import apply_plan

            # The front end refuses this already when an engine starts; a config built on its
            # own (no usage context) reaches the executor unchecked.
            preflight.check_platform(self.parallel_config)
            from vllm_dualgpu.kernels.flashinfer import apply_flashinfer_autotune_policy

            # A dualgpu run does not start half-patched (required patches, interventions).
            plugin.ensure_for_dualgpu(frozenset({ENGINE}))
            try:
                self.dualgpu = apply_plan(self.vllm_config)
            except (ValueError, RuntimeError) as e:  # the plan's refusals (what fits, what to do)
                # One ERROR line first: vLLM's "EngineCore failed to start" traceback follows.
                logger.error("%s", e)
                raise
            apply_flashinfer_autotune_policy(
                self.vllm_config.kernel_config, [g.capability for g in self.dualgpu.gpus]
            )
            # Workers inherit the environment; worker-side patches act only where it is set.
            os.environ[ACTIVE_ENV] = "1"
        super()._init_executor()

    def register_failure_callback(self, callback) -> None:
        """vLLM calls ``callback`` when a worker process died; first say which rank and GPU."""

        def name_dead_ranks_then_fail():
            for line in dead_rank_lines(self.workers, getattr(self.dualgpu, "gpus", None),
                                        getattr(self.dualgpu, "tp_size", 1)):
                logger.error(line)
            callback()

        super().register_failure_callback(name_dead_ranks_then_fail)

    def determine_available_memory(self) -> list[int]:
        available = super().determine_available_memory()
        if self.dualgpu is not None:
            from vllm_dualgpu.engine.context_fit import check_context_fits

            check_context_fits(self.vllm_config, self.get_kv_cache_specs(), available, self.dualgpu)
        return available
