"""When a worker process dies, the executor's error names the pipeline rank and its GPU."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

from vllm_dualgpu.engine.rank_faults import dead_rank_lines  # noqa: E402


def handle(rank, exitcode):
    return SimpleNamespace(rank=rank, proc=SimpleNamespace(exitcode=exitcode))


def test_only_ended_ranks_are_named_with_their_gpu():
    gpus = [SimpleNamespace(physical_id=1, name="RTX 4070 Ti SUPER"), SimpleNamespace(physical_id=0, name="RTX 5090")]
    lines = dead_rank_lines([handle(0, None), handle(1, -9)], gpus)
    assert lines == ["vllm-dualgpu: pipeline rank 1 (GPU 0: RTX 5090) was killed by signal 9 (SIGKILL: out of "
                     "host memory, or killed from outside); the engine shuts down and fails its requests"]


def test_exit_status_one_points_at_the_ranks_own_error_line():
    """A rank ends itself with status 1 after an out-of-memory error in warm-up or while serving
    (engine/worker.py), or any other warm-up error: the line says where the reason is."""
    (line,) = dead_rank_lines([handle(0, 1), handle(1, None)])
    assert line.startswith("vllm-dualgpu: pipeline rank 0 exited with status 1 (a rank that fails in warm-up "
                           "or runs out of GPU memory while serving ends itself: see its ERROR line above)")


def test_no_line_while_every_worker_runs():
    assert dead_rank_lines([handle(0, None), handle(1, None)]) == []


def test_vllms_failure_callback_logs_the_dead_rank_first(caplog):
    """vLLM's worker monitor calls the registered callback once a worker died (and at once when
    the executor already failed); the dualgpu executor's ERROR line comes before it."""
    import logging

    from vllm_dualgpu.engine.executor import DualGpuExecutor

    caplog.set_level(logging.ERROR, logger="vllm.dualgpu")
    logging.getLogger("vllm.dualgpu").propagate = True
    ex = object.__new__(DualGpuExecutor)
    ex.is_failed, ex.failure_callback, ex.dualgpu = False, None, None
    ex.workers = [handle(0, None), handle(1, -9)]
    calls = []
    ex.register_failure_callback(lambda: calls.append(len(caplog.records)))
    assert calls == []
    ex.failure_callback()  # what MultiprocExecutor's monitor does
    assert calls == [1] and "pipeline rank 1" in caplog.records[0].getMessage()
