"""A TP rank of a pipeline stage: its worker finds its own hand-off record by its global rank
and its summary line names its stage and TP rank."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from vllm_dualgpu import rank_summary
from vllm_dualgpu.engine import handoff
from vllm_dualgpu.engine import worker as w

GiB = 1024**3


def record(rank, gpu, stage, tp_rank, layers):
    return handoff.RankRecord(rank, gpu, "NVIDIA H200", GiB, None, layers, 5 * GiB, stage, tp_rank)


PLAN = handoff.Handoff(
    ranks=(record(0, 1, 0, 0, 11), record(1, 3, 0, 1, 11), record(2, 0, 1, 0, 29), record(3, 2, 1, 1, 29)),
    partition=(11, 29), partition_source="plan", tp_size=2)


@pytest.fixture
def tp_rank(monkeypatch):
    import torch

    rank_summary.clear()
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d: (2 * GiB, 140 * GiB))
    r = object.__new__(w.DualGpuWorker)
    r.rank, r.device = 3, "cuda:3"
    r.cache_config = SimpleNamespace(num_gpu_blocks=1000, block_size=16)
    r.model_config = SimpleNamespace(max_model_len=8192)
    r.model_runner = SimpleNamespace(model_memory_usage=5 * GiB)
    r._pp_position = lambda: (1, 2)
    r._dualgpu_plan = PLAN
    r._dualgpu_rank = PLAN.rank(r.rank)
    yield r
    rank_summary.clear()


def test_the_handoff_round_trips_with_stage_and_tp_rank():
    back = handoff.Handoff.from_dict(PLAN.to_dict())
    assert back == PLAN and back.rank(3).tp_rank == 1 and back.rank(3).physical_gpu_id == 2


def test_summary_names_stage_and_tp_rank(tp_rank, caplog):
    caplog.set_level(logging.INFO, logger="vllm.dualgpu")
    logging.getLogger("vllm.dualgpu").propagate = True
    tp_rank._log_summary()
    lines = [r.getMessage() for r in caplog.records if "vllm-dualgpu rank" in r.getMessage()]
    assert len(lines) == 1
    assert lines[0].startswith("vllm-dualgpu rank 3 (stage 1/2, TP rank 1/2): ")
    assert "layers: 29 of 11/29" in lines[0]
