"""A rank that fails in warm-up (after the KV cache was sized) ends its process, whatever else
fails while it says why: its peer would otherwise wait in a pipeline receive for ever. Only an
out-of-memory error gets the advice to keep more memory free.

vLLM's warm-up is replaced by one that raises; torch.cuda's queries are left to fail as they do
after a sticky CUDA fault (every later CUDA call raises the same error)."""

from __future__ import annotations

import pytest

from vllm_dualgpu import envs
from worker_fakes import ending_rank

GiB = 1024**3
ILLEGAL = "CUDA error: an illegal memory access was encountered"


@pytest.fixture
def rank(monkeypatch, caplog):
    from vllm.v1.worker.gpu_worker import Worker

    r = ending_rank(monkeypatch, caplog, 1, "NVIDIA H200", 256 * 1024**2, 29)

    def fails_with(exc):
        def warm_up(self):
            raise exc
        monkeypatch.setattr(Worker, "compile_or_warm_up_model", warm_up)

    r.fails_with = fails_with
    return r


def sticky_fault(monkeypatch):
    import torch

    def raises(*a, **k):
        raise RuntimeError(ILLEGAL)

    monkeypatch.setattr(torch.cuda, "mem_get_info", raises)
    monkeypatch.setattr(torch.cuda, "get_device_name", raises)


def healthy_gpu(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d: (441 * 1024**2, 140 * GiB))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d: "NVIDIA H200")


def test_a_sticky_cuda_fault_still_ends_the_worker(rank, monkeypatch, caplog):
    sticky_fault(monkeypatch)
    rank.fails_with(RuntimeError(ILLEGAL))
    with pytest.raises(SystemExit) as done:
        rank.compile_or_warm_up_model()
    assert done.value.code == 1
    text = caplog.text
    assert "rank 1" in text and "failed during warm-up" in text and ILLEGAL in text
    assert envs.RESERVE not in text  # not an out-of-memory error: no memory advice


def test_out_of_memory_after_a_sticky_fault_still_ends_the_worker_with_advice(rank, monkeypatch, caplog):
    import torch

    sticky_fault(monkeypatch)
    rank.fails_with(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 544.00 MiB"))
    with pytest.raises(SystemExit) as done:
        rank.compile_or_warm_up_model()
    assert done.value.code == 1
    assert "ran out of memory during warm-up" in caplog.text
    assert "Tried to allocate 544.00 MiB" in caplog.text and f"{envs.RESERVE} (e.g. 1.25 GiB)" in caplog.text


def test_other_errors_get_no_memory_advice(rank, monkeypatch, caplog):
    healthy_gpu(monkeypatch)
    rank.fails_with(RuntimeError("NCCL error: unhandled system error"))
    with pytest.raises(SystemExit):
        rank.compile_or_warm_up_model()
    assert "NCCL error: unhandled system error" in caplog.text
    assert "NVIDIA H200" in caplog.text and "0.43 GiB free of 140.00 GiB" in caplog.text
    assert envs.RESERVE not in caplog.text and "allocation" not in caplog.text


def test_out_of_memory_on_a_healthy_gpu_names_the_state_and_the_fix(rank, monkeypatch, caplog):
    import torch

    healthy_gpu(monkeypatch)
    rank.fails_with(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 544.00 MiB"))
    with pytest.raises(SystemExit):
        rank.compile_or_warm_up_model()
    msg = [r.getMessage() for r in caplog.records if "ran out of memory" in r.getMessage()][0]
    assert "rank 1 (NVIDIA H200) ran out of memory during warm-up" in msg
    assert "0.43 GiB free of 140.00 GiB; reserve 0.25 GiB" in msg and f"{envs.RESERVE} (e.g. 1.25 GiB)" in msg
