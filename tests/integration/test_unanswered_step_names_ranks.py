"""When a step times out (vLLM's VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS bound), the executor says
which ranks are stopped and which are not, before vLLM's TimeoutError ends the engine. On the
virtual pair a worker stopped with SIGSTOP failed every stream at the bound with "RPC call to
sample_tokens timed out" and no line naming the rank (2026-12-03). Real worker processes (one
really stopped) and vLLM's own FutureWrapper; only the message queue's wait is replaced by the
TimeoutError it raises at the bound."""

from __future__ import annotations

import collections
import logging
import multiprocessing
import os
import signal
import time
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

from vllm.v1.executor.multiproc_executor import FutureWrapper, MultiprocExecutor  # noqa: E402

from vllm_dualgpu.engine.executor import DualGpuExecutor  # noqa: E402


def _sleep(seconds: float) -> None:
    time.sleep(seconds)


@pytest.fixture
def executor(monkeypatch):
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_sleep, args=(60,)) for _ in range(2)]
    for p in procs:
        p.start()
    ex = object.__new__(DualGpuExecutor)
    ex.is_failed = False
    ex.futures_queue = collections.deque()
    ex.dualgpu = SimpleNamespace(gpus=[SimpleNamespace(physical_id=1, name="RTX 4070 Ti SUPER"),
                                       SimpleNamespace(physical_id=0, name="RTX 5090")], tp_size=1)
    ex.workers = [SimpleNamespace(rank=r, proc=p) for r, p in enumerate(procs)]
    os.kill(procs[1].pid, signal.SIGSTOP)
    deadline = time.time() + 10
    while open(f"/proc/{procs[1].pid}/stat").read().rsplit(")", 1)[1].split()[0] != "T" and time.time() < deadline:
        time.sleep(0.05)
    try:
        yield ex
    finally:
        for p in procs:
            os.kill(p.pid, signal.SIGCONT)
            p.kill()
            p.join(5)


def timed_out(self, method, timeout=None, args=(), kwargs=None, non_block=False, **_):
    """MultiprocExecutor.collective_rpc at its deadline: its queue wait raised, re-raised so."""
    def get_response():
        raise TimeoutError(f"RPC call to {method} timed out.")

    future = FutureWrapper(self.futures_queue, get_response=get_response)
    return future if non_block else future.result()


def lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "vllm.dualgpu" and r.levelno == logging.ERROR]


EXPECTED = ("vllm-dualgpu: no answer to sample_tokens within 30 s (VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS): "
            "pipeline rank 1 (GPU 0: RTX 5090) is stopped (SIGSTOP or a debugger; SIGCONT resumes it); "
            "pipeline rank 0 (GPU 1: RTX 4070 Ti SUPER) is running or waiting for another rank. The engine "
            "fails its requests; if a step legitimately takes longer (a first compile, a long prefill), "
            "raise VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS")


@pytest.mark.parametrize("non_block", [False, True])
def test_a_step_that_times_out_names_the_stopped_rank(executor, monkeypatch, caplog, non_block):
    caplog.set_level(logging.ERROR, logger="vllm.dualgpu")
    logging.getLogger("vllm.dualgpu").propagate = True
    monkeypatch.setattr(MultiprocExecutor, "collective_rpc", timed_out)
    with pytest.raises(TimeoutError, match="RPC call to sample_tokens timed out"):
        out = executor.collective_rpc("sample_tokens", timeout=30, args=(None,), non_block=non_block)
        out.result() if non_block else None
    assert lines(caplog) == [EXPECTED]
    with pytest.raises(TimeoutError):  # a second timeout of the same executor: no second line
        out = executor.collective_rpc("sample_tokens", timeout=30, non_block=non_block)
        out.result() if non_block else None
    assert lines(caplog) == [EXPECTED]


def test_an_answered_step_says_nothing(executor, monkeypatch, caplog):
    caplog.set_level(logging.ERROR, logger="vllm.dualgpu")
    monkeypatch.setattr(MultiprocExecutor, "collective_rpc",
                        lambda self, method, timeout=None, args=(), kwargs=None, non_block=False, **_:
                        FutureWrapper(self.futures_queue, get_response=lambda: ["ok"]) if non_block else ["ok"])
    assert executor.collective_rpc("sample_tokens", timeout=30) == ["ok"]
    assert executor.collective_rpc("sample_tokens", timeout=30, non_block=True).result() == ["ok"]
    assert lines(caplog) == []


def test_another_calls_timeout_names_no_step_setting(executor, monkeypatch, caplog):
    """vLLM bounds its steps with VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS; other calls carry their own
    timeout (check_health: 10 s), and the line does not send the user to the step setting."""
    caplog.set_level(logging.ERROR, logger="vllm.dualgpu")
    logging.getLogger("vllm.dualgpu").propagate = True
    monkeypatch.setattr(MultiprocExecutor, "collective_rpc", timed_out)
    with pytest.raises(TimeoutError):
        executor.collective_rpc("check_health", timeout=10)
    (line,) = lines(caplog)
    assert line.startswith("vllm-dualgpu: no answer to check_health within 10 s: pipeline rank 1 (GPU 0: "
                           "RTX 5090) is stopped") and "VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS" not in line, line
