"""With ``--kv-cache-memory-bytes`` the worker runs vLLM's profile pass under the allocator split
limit vLLM applies only to its measured profile.

Seen on a GPU (vLLM 0.33, PP=2, rank 1 held to a 32 GiB card): rank 1 died allocating its KV cache
with 2.01 GiB "reserved by PyTorch but unallocated" although allocated + requested fitted the
cap: small blocks carved out of freed multi-GiB blocks during the pass pinned those segments.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from types import SimpleNamespace

import pytest
import torch
from vllm.v1.worker.gpu_worker import Worker

from vllm_dualgpu import rank_summary
from vllm_dualgpu.engine import worker as w

GiB = 1024**3


@pytest.fixture
def rank(monkeypatch, caplog):
    """A rank as ``determine_available_memory`` reads it, with vLLM's pass and the allocator's
    scoped limit replaced by recorders: ``seen`` says whether the pass ran inside the scope,
    with which limit, and when torch's cache was emptied."""
    caplog.set_level(logging.INFO, logger="vllm.dualgpu")
    logging.getLogger("vllm.dualgpu").propagate = True
    rank_summary.clear()
    seen = {"inside": False, "events": [], "limits": []}

    @contextmanager
    def scoped(max_split_size_mb):
        seen["limits"].append(max_split_size_mb)
        seen["inside"] = True
        try:
            yield
        finally:
            seen["inside"] = False

    def vllm_pass(self):
        seen["events"].append(("pass", seen["inside"]))
        return int(8.38 * GiB)

    monkeypatch.setattr(Worker, "determine_available_memory", vllm_pass)
    monkeypatch.setattr(w.DualGpuWorker, "_warm_pp_communicators", lambda self: None)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda d=None: int(11.61 * GiB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda d=None: int(12.25 * GiB))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache",
                        lambda: seen["events"].append(("empty_cache", seen["inside"])))
    r = object.__new__(w.DualGpuWorker)
    r.rank, r.device = 1, "cuda:1"
    r.cache_config = SimpleNamespace(kv_cache_memory_bytes=9_000_000_000)
    r.model_runner = SimpleNamespace(model_memory_usage=int(10.52 * GiB))
    r.requested_memory = int(13.94 * GiB)
    r._scoped_allocator_max_split = scoped
    r.seen = seen
    yield r
    rank_summary.clear()


def _rank_lines(caplog) -> list[str]:
    return [rec.getMessage() for rec in caplog.records if "vllm-dualgpu rank 1" in rec.getMessage()]


def test_a_set_kv_size_profiles_under_the_split_limit(rank, caplog):
    assert rank.determine_available_memory() == int(8.38 * GiB)
    assert rank.seen["limits"] == [20]
    # The pass inside the limit, then torch's wholly free segments released outside it.
    assert rank.seen["events"] == [("pass", True), ("empty_cache", False)]
    (line,) = _rank_lines(caplog)
    assert "--kv-cache-memory-bytes" in line and "split limit (max_split_size_mb 20)" in line


def test_no_empty_cache_without_cuda(rank, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    rank.determine_available_memory()
    assert rank.seen["events"] == [("pass", True)]


def test_the_profiled_path_is_left_to_vllm(rank, caplog):
    """vLLM 0.33 applies the same limit around its measured pass itself."""
    rank.cache_config.kv_cache_memory_bytes = None
    rank._dualgpu_rank = None
    rank.determine_available_memory()
    assert rank.seen["limits"] == [] and rank.seen["events"] == [("pass", False)]
    (line,) = _rank_lines(caplog)
    assert "profiled:" in line and "split limit" not in line


def test_a_vllm_without_the_scoped_limit_runs_the_pass_as_before(rank, monkeypatch, caplog):
    del rank._scoped_allocator_max_split
    monkeypatch.delattr(Worker, "_scoped_allocator_max_split")
    assert rank.determine_available_memory() == int(8.38 * GiB)
    assert rank.seen["events"] == [("pass", False), ("empty_cache", False)]
    (line,) = _rank_lines(caplog)
    assert "--kv-cache-memory-bytes" in line and "split limit" not in line
