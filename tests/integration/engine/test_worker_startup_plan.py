"""vLLM 0.33's startup plan (``VLLM_ENABLE_STARTUP_PLAN=1``) under the dualgpu worker.

vLLM's ``Worker.determine_available_memory`` applies a plan saved by an earlier boot by setting
``cache_config.kv_cache_memory_bytes`` on its first line, and then skips its profile. The dualgpu
worker chose its branch (profiled, or a set KV size) before calling it, so with a saved plan it
ran its unmeasured warm-up pass and logged a "profiled" rank whose KV size vLLM had in fact taken
from the file. vLLM saves ``requested_memory - non-KV - 150 MiB`` (gpu_worker.py:1012-1068), which
does not hold the hidden states a later stage receives (``pp_receive_bytes``): the worker's
profiled path takes those off, so the plan's size must lose them too.
"""

from __future__ import annotations

import json
import logging
from contextlib import contextmanager
from types import SimpleNamespace

import pytest
import torch

startup_plan = pytest.importorskip("vllm.v1.worker.startup_plan",
                                   reason="vLLM's startup plan is new in 0.33 (VLLM_ENABLE_STARTUP_PLAN)")
from vllm.v1.worker.gpu_worker import Worker  # noqa: E402

from vllm_dualgpu import rank_summary  # noqa: E402
from vllm_dualgpu.engine import profile_pass  # noqa: E402
from vllm_dualgpu.engine import worker as w  # noqa: E402

GiB = 1024**3
MiB = 1024**2
SAVED_KV = 7_000_000_000  # what an earlier boot's file says
RECEIVED = 40 * MiB  # the hidden states this stage receives


@pytest.fixture
def rank(monkeypatch, tmp_path, caplog):
    """Rank 1 with a plan file where vLLM looks for it (VLLM_CACHE_ROOT), vLLM's own loader, and
    vLLM's pass replaced by one that returns the KV size it was given (what it does with a set
    size) or, unset, a profiled figure."""
    caplog.set_level(logging.INFO, logger="vllm.dualgpu")
    logging.getLogger("vllm.dualgpu").propagate = True
    rank_summary.clear()
    monkeypatch.setenv("VLLM_ENABLE_STARTUP_PLAN", "1")
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path))
    monkeypatch.setattr(startup_plan, "compute_plan_fingerprint", lambda cfg, rank, world: "f00d")
    plan = tmp_path / "startup_plan" / "startup_plan_f00d.json"
    plan.parent.mkdir()
    plan.write_text(json.dumps({"schema": startup_plan.PLAN_SCHEMA_VERSION, "fingerprint": "f00d",
                                "kv_cache_memory_bytes": SAVED_KV, "free_memory_baseline": 30 * GiB}))
    seen = {"passes": [], "warm_pass": 0}

    def vllm_pass(self):
        startup_plan.maybe_apply_startup_plan(self)  # vLLM's first line (gpu_worker.py:654)
        seen["passes"].append(self.cache_config.kv_cache_memory_bytes)
        return self.cache_config.kv_cache_memory_bytes or int(9 * GiB)

    @contextmanager
    def scoped(max_split_size_mb):
        yield

    def warm_pass(self):
        seen["warm_pass"] += 1
        return ""

    monkeypatch.setattr(Worker, "determine_available_memory", vllm_pass)
    monkeypatch.setattr(w.DualGpuWorker, "_warm_pp_communicators", lambda self: None)
    monkeypatch.setattr(profile_pass, "first_profile_pass", warm_pass)
    monkeypatch.setattr(w, "pp_receive_bytes", lambda runner, tp=1: RECEIVED)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda d=None: int(11.6 * GiB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda d=None: int(12.2 * GiB))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    r = object.__new__(w.DualGpuWorker)
    r.rank, r.device = 1, "cuda:1"
    r.vllm_config = None
    r.parallel_config = SimpleNamespace(world_size=2, tensor_parallel_size=1)
    r.init_snapshot = SimpleNamespace(free_memory=31 * GiB)
    r.cache_config = SimpleNamespace(kv_cache_memory_bytes=None)
    r.model_runner = SimpleNamespace(model_memory_usage=int(10.5 * GiB))
    r.requested_memory = int(13.9 * GiB)
    r._dualgpu_rank = None
    r._scoped_allocator_max_split = scoped
    r.seen, r.plan = seen, plan
    yield r
    rank_summary.clear()


def _rank_lines(caplog) -> list[str]:
    return [rec.getMessage() for rec in caplog.records if "vllm-dualgpu rank 1" in rec.getMessage()]


def test_a_saved_plan_sets_the_kv_size_and_is_named(rank, caplog):
    got = rank.determine_available_memory()
    assert rank.seen["passes"] == [SAVED_KV]
    assert rank.seen["warm_pass"] == 0, "the unmeasured warm-up pass ran although vLLM skips its profile"
    assert got == SAVED_KV - RECEIVED
    (line,) = _rank_lines(caplog)
    assert "startup plan" in line and "VLLM_ENABLE_STARTUP_PLAN" in line and "profiled:" not in line
    assert "--kv-cache-memory-bytes" not in line


def test_without_a_plan_file_the_rank_profiles(rank, caplog):
    rank.plan.unlink()
    assert rank.determine_available_memory() == 9 * GiB - RECEIVED
    assert rank.seen["passes"] == [None] and rank.seen["warm_pass"] == 1
    (line,) = _rank_lines(caplog)
    assert "profiled:" in line and "startup plan" not in line


def test_a_set_kv_size_keeps_its_own_path(rank, caplog):
    """--kv-cache-memory-bytes wins over a saved plan (vLLM applies none then) and keeps the whole size."""
    rank.cache_config.kv_cache_memory_bytes = 5_000_000_000
    assert rank.determine_available_memory() == 5_000_000_000
    (line,) = _rank_lines(caplog)
    assert "--kv-cache-memory-bytes" in line and "startup plan" not in line
