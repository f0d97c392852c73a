"""Where the dualgpu executor runs as stock vLLM (no plan: pipeline_parallel_size 1, data parallel)
with tensor parallelism, a dead worker is named by its TP rank, not as a pipeline rank it is not."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

from vllm_dualgpu.engine.executor import DualGpuExecutor  # noqa: E402


def test_a_stock_tp_worker_is_not_called_a_pipeline_rank(caplog):
    caplog.set_level(logging.ERROR, logger="vllm.dualgpu")
    logging.getLogger("vllm.dualgpu").propagate = True
    ex = object.__new__(DualGpuExecutor)
    # -tp 2 -pp 1: planning_applies says "pipeline_parallel_size=1", the executor runs as stock
    ex.is_failed, ex.failure_callback, ex.dualgpu = False, None, None
    ex.parallel_config = SimpleNamespace(tensor_parallel_size=2, pipeline_parallel_size=1)
    ex.workers = [SimpleNamespace(rank=r, proc=SimpleNamespace(exitcode=-9 if r == 1 else None)) for r in range(2)]
    ex.register_failure_callback(lambda: None)
    ex.failure_callback()  # what MultiprocExecutor's monitor does
    (line,) = [r.getMessage() for r in caplog.records if r.name == "vllm.dualgpu"]
    assert "pipeline rank" not in line
    assert line.startswith("vllm-dualgpu: rank 1 (stage 0, TP rank 1) was killed by signal 9")
