"""``DualGpuExecutor``: vLLM's multiprocess executor, planned for two mismatched GPUs.

Selected with ``--distributed-executor-backend dualgpu``. Keep this module free of side
effects: EngineCore unpickles the config (which names this class) before plugins load.
"""

from __future__ import annotations

import multiprocessing.connection

from vllm.v1.executor.multiproc_executor import MultiprocExecutor

from vllm_dualgpu.engine.plan_scope import planning_applies
from vllm_dualgpu.engine.planned_executor import PlannedExecutor
from vllm_dualgpu.log import logger


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
                how += (" (a rank that fails in warm-up or runs out of GPU memory while serving ends itself: "
                        "see its ERROR line above)")
        who = (f"pipeline rank {h.rank}" if tp_size == 1
               else f"rank {h.rank} (stage {h.rank // tp_size}, TP rank {h.rank % tp_size})")
        lines.append(f"vllm-dualgpu: {who}{where} {how}; the engine shuts down "
                     "and fails its requests")
    return lines


class DualGpuExecutor(PlannedExecutor, MultiprocExecutor):
    """Multiprocess executor that applies a dualgpu plan before spawning its workers."""

    supports_pp: bool = True

    def _init_executor(self) -> None:
        from vllm_dualgpu.engine.planning import apply_plan

        self.start_planned(planning_applies, apply_plan, "vLLM's multiprocess executor")
        super()._init_executor()

    def register_failure_callback(self, callback) -> None:
        """vLLM calls ``callback`` when a worker process died; first say which rank and GPU."""

        def name_dead_ranks_then_fail():
            self._name_dead_ranks()
            callback()

        super().register_failure_callback(name_dead_ranks_then_fail)

    def shutdown(self) -> None:
        """vLLM's worker monitor marks the executor failed and shuts it down (waiting for the other
        workers, then terminating them) before it calls the failure callback, while the engine
        fails its requests at once: a server stopped a second after a SIGKILL never logged the
        callback's line (vLLM 0.33, 2026-12-03). So the dead ranks are named here, first, and
        only the ranks that had died before the shutdown ended the others."""
        if getattr(self, "is_failed", False):
            self._name_dead_ranks()
        super().shutdown()

    def _name_dead_ranks(self) -> None:
        if getattr(self, "_dead_ranks_named", False):
            return
        self._dead_ranks_named = True
        workers = getattr(self, "workers", None) or []
        sentinels = [s for h in workers if (s := getattr(h.proc, "sentinel", None)) is not None]
        ended = set(multiprocessing.connection.wait(sentinels, timeout=0)) if sentinels else set()
        for h in workers:
            if h.proc.exitcode is None and getattr(h.proc, "sentinel", None) in ended:
                # its pipe closes as it exits, a moment before the kernel lets it be reaped
                h.proc.join(timeout=1.0)
        for line in dead_rank_lines(workers, getattr(self.dualgpu, "gpus", None), getattr(self.dualgpu, "tp_size", 1)):
            logger.error(line)
