"""A killed worker is named while vLLM's worker monitor shuts the executor down, not only in the
failure callback that comes after the shutdown: on vLLM 0.33 the engine fails its requests at
once ("Executor failed."), so a server stopped a second later never logged the callback's line
(GPU run of 2026-12-03, docs/gpu-runs.md). Real processes and vLLM's own monitor and shutdown."""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import threading
import time
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

from vllm_dualgpu.engine.executor import DualGpuExecutor  # noqa: E402


def _sleep(seconds: float) -> None:
    time.sleep(seconds)


def _stubborn(seconds: float) -> None:  # a survivor that outlives vLLM's shutdown grace period
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    time.sleep(seconds)


class Seen(logging.Handler):
    """Each vllm.dualgpu ERROR line with whether the surviving rank was still running then."""

    def __init__(self, survivor):
        super().__init__(logging.ERROR)
        self.survivor, self.lines = survivor, []

    def emit(self, record):
        self.lines.append((record.getMessage(), self.survivor.is_alive()))


def test_the_killed_rank_is_named_before_the_shutdown_waits_for_the_others(monkeypatch):
    monkeypatch.setenv("VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS", "2")
    ctx = multiprocessing.get_context("spawn")
    survivor, victim = ctx.Process(target=_stubborn, args=(60,)), ctx.Process(target=_sleep, args=(60,))
    survivor.start(), victim.start()
    ex = object.__new__(DualGpuExecutor)
    ex.is_failed, ex.failure_callback, ex.shutting_down = False, None, False
    ex.rpc_broadcast_mq, ex.response_mqs = None, []
    ex.dualgpu = SimpleNamespace(gpus=[SimpleNamespace(physical_id=1, name="RTX 4070 Ti SUPER"),
                                       SimpleNamespace(physical_id=0, name="RTX 5090")], tp_size=1)
    ex.workers = [SimpleNamespace(rank=r, proc=p, death_writer=None, worker_response_mq=None)
                  for r, p in enumerate((survivor, victim))]
    seen = Seen(survivor)
    log = logging.getLogger("vllm.dualgpu")
    log.addHandler(seen)
    called = threading.Event()
    try:
        ex.register_failure_callback(called.set)
        ex.start_worker_monitor()  # vLLM's own thread: wait on the sentinels, shutdown(), callback
        os.kill(victim.pid, signal.SIGKILL)
        assert called.wait(30), "vLLM's monitor never called the failure callback"
    finally:
        log.removeHandler(seen)
        for p in (survivor, victim):
            if p.is_alive():
                p.kill()
            p.join(5)
    named = [(m, alive) for m, alive in seen.lines if "pipeline rank" in m]
    assert [m for m, _ in named] == [
        "vllm-dualgpu: pipeline rank 1 (GPU 0: RTX 5090) was killed by signal 9 (SIGKILL: out of host memory, "
        "or killed from outside); the engine shuts down and fails its requests"], seen.lines
    assert named[0][1], "the rank was named only after the shutdown had ended the surviving rank"
