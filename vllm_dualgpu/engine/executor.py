"""``DualGpuExecutor``: vLLM's multiprocess executor, planned for two mismatched GPUs.

Selected with ``--distributed-executor-backend dualgpu``. Keep this module free of side
effects: EngineCore unpickles the config (which names this class) before plugins load.
"""

from __future__ import annotations

import multiprocessing.connection
from concurrent.futures import Future

from vllm.v1.executor.multiproc_executor import MultiprocExecutor

from vllm_dualgpu.engine.plan_scope import planning_applies
from vllm_dualgpu.engine.planned_executor import PlannedExecutor
from vllm_dualgpu.engine.rank_faults import dead_rank_lines, method_name, unanswered_line
from vllm_dualgpu.log import logger


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
        workers, gpus, tp_size = self._ranks()
        sentinels = [s for h in workers if (s := getattr(h.proc, "sentinel", None)) is not None]
        ended = set(multiprocessing.connection.wait(sentinels, timeout=0)) if sentinels else set()
        for h in workers:
            if h.proc.exitcode is None and getattr(h.proc, "sentinel", None) in ended:
                # its pipe closes as it exits, a moment before the kernel lets it be reaped
                h.proc.join(timeout=1.0)
        for line in dead_rank_lines(workers, gpus, tp_size):
            logger.error(line)

    def _ranks(self) -> tuple[list, list | None, int]:
        """The worker handles, the plan's GPU per rank and the TP size the rank lines name (vLLM's
        own where the executor runs as stock: no plan, but TP ranks are still TP ranks)."""
        if self.dualgpu is not None:
            tp_size = getattr(self.dualgpu, "tp_size", 1)
        else:
            tp_size = getattr(getattr(self, "parallel_config", None), "tensor_parallel_size", 1) or 1
        return (getattr(self, "workers", None) or [], getattr(self.dualgpu, "gpus", None), tp_size)

    def collective_rpc(self, method, timeout=None, *args, **kwargs):
        """vLLM's, and when a call runs past its bound (VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS for a
        step) one line first saying which ranks are stopped and which are not: vLLM's own
        TimeoutError names only the method."""
        try:
            out = super().collective_rpc(method, timeout, *args, **kwargs)
        except TimeoutError:
            self._name_unanswering_ranks(method, timeout)
            raise
        if isinstance(out, Future):  # non_block: the wait happens in result()
            out.add_done_callback(lambda f: not f.cancelled() and isinstance(f.exception(), TimeoutError)
                                  and self._name_unanswering_ranks(method, timeout))
        return out

    def _name_unanswering_ranks(self, method, timeout) -> None:
        """Once per method: a server's later steps time out the same way."""
        named = self.__dict__.setdefault("_unanswered_named", set())
        if method_name(method) in named:
            return
        named.add(method_name(method))
        logger.error(unanswered_line(*self._ranks(), method, timeout))
