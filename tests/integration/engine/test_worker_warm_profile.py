"""vLLM's profile pass runs once before the measured one, so a first boot's compilation and
autotuning are not charged to the KV cache.

Seen on a GPU (vLLM 0.33, PP=2 on the virtual pair, W8A16 + DFlash2 at 19/45): on the first boot
rank 1's profile pass peaked 24.19 GiB (torch), on the next boot of the same arm 21.95 GiB. vLLM
measured the first boot's 24.47 GiB of non-KV memory and left rank 1 4.69 GiB for the KV cache, and
the plugin refused --max-model-len 229,376, which the plan holds on a warm boot.
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
    """A profiled rank (no --kv-cache-memory-bytes): vLLM's measured pass and the model runner's
    profile pass replaced by recorders; a cold first pass peaks 2.24 GiB higher than a warm one."""
    caplog.set_level(logging.INFO, logger="vllm.dualgpu")
    logging.getLogger("vllm.dualgpu").propagate = True
    rank_summary.clear()
    seen = {"inside": False, "events": [], "peak": 0}

    @contextmanager
    def scoped(max_split_size_mb):
        seen["events"].append(("split limit", max_split_size_mb))
        seen["inside"] = True
        try:
            yield
        finally:
            seen["inside"] = False

    def profile_run(**kwargs):
        seen["events"].append(("profile_run", seen["inside"]))
        first = [e[0] for e in seen["events"]].count("profile_run") == 1
        seen["peak"] = int((24.19 if first else 21.95) * GiB)  # cold (compiling, autotuning), then warm

    def measured_pass(self):
        if hasattr(self.model_runner, "profile_run"):
            self.model_runner.profile_run()  # vLLM's own pass: measured, warm now
        seen["events"].append(("measured", seen["peak"]))
        return int(7.1 * GiB)

    monkeypatch.setattr(Worker, "determine_available_memory", measured_pass)
    monkeypatch.setattr(w.DualGpuWorker, "_warm_pp_communicators", lambda self: None)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda d=None: seen["peak"])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: seen["events"].append(("empty_cache", seen["inside"])))
    r = object.__new__(w.DualGpuWorker)
    r.rank, r.device = 1, "cuda:1"
    r.vllm_config = None
    r.cache_config = SimpleNamespace(kv_cache_memory_bytes=None)
    r.model_runner = SimpleNamespace(model_memory_usage=int(21.70 * GiB), profile_run=profile_run)
    r.requested_memory = int(29.17 * GiB)
    r._scoped_allocator_max_split = scoped
    r._dualgpu_rank = None
    r.seen = seen
    yield r
    rank_summary.clear()


def test_a_first_pass_runs_before_the_measured_one(rank, caplog):
    assert rank.determine_available_memory() == int(7.1 * GiB)
    ev = rank.seen["events"]
    # the first pass under vLLM's split limit, torch's cache emptied after it, then vLLM's measured pass
    assert ev[:3] == [("split limit", 20), ("profile_run", True), ("empty_cache", False)], ev
    assert ev[-1] == ("measured", int(21.95 * GiB)), ev
    lines = [r.getMessage() for r in caplog.records if "vllm-dualgpu rank 1" in r.getMessage()]
    assert any("first profile pass" in line and "24.19 GiB" in line for line in lines), lines


def test_a_set_kv_size_runs_no_extra_pass(rank):
    """--kv-cache-memory-bytes: vLLM measures nothing, one pass is enough."""
    rank.cache_config.kv_cache_memory_bytes = 9_000_000_000
    rank.determine_available_memory()
    assert [e[0] for e in rank.seen["events"]].count("profile_run") == 1


def test_a_runner_without_profile_run_is_left_to_vllm(rank):
    rank.model_runner = SimpleNamespace(model_memory_usage=int(21.70 * GiB))
    assert rank.determine_available_memory() == int(7.1 * GiB)
    assert [e[0] for e in rank.seen["events"]] == ["measured"]
