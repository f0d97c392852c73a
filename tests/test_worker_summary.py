"""The worker's one summary line per rank (GPU, layers, weights, KV, blocks, context, memory)."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from vllm_dualgpu import envs, rank_summary
from vllm_dualgpu import worker as w

GiB = 1024**3


@pytest.fixture
def fake_rank(monkeypatch):
    import torch

    rank_summary.clear()
    monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", "11,29")
    monkeypatch.setenv(envs.RANK_PREDICTED, f"{16 * GiB}:{15 * GiB},{32 * GiB}:{30 * GiB}")
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d: (int(1.5 * GiB), 140 * GiB))
    r = object.__new__(w.DualGpuWorker)
    r.rank, r.device = 1, "cuda:1"
    r.cache_config = SimpleNamespace(num_gpu_blocks=9261, block_size=16)
    r.model_config = SimpleNamespace(max_model_len=32768)
    r.model_runner = SimpleNamespace(model_memory_usage=int(10.52 * GiB))
    r._dualgpu_kv_bytes = 9261 * 29 * 65536
    r._pp_position = lambda: (1, 2)
    yield r
    rank_summary.clear()


def test_summary_line_has_every_field(fake_rank, caplog):
    caplog.set_level(logging.INFO, logger="vllm.dualgpu")
    logging.getLogger("vllm.dualgpu").propagate = True
    rank_summary.note("GPU", "NVIDIA H200 (cuda:1)")
    fake_rank._log_summary()
    lines = [r.getMessage() for r in caplog.records if "vllm-dualgpu rank" in r.getMessage()]
    assert len(lines) == 1
    line = lines[0]
    assert line.startswith("vllm-dualgpu rank 1/2: GPU: NVIDIA H200 (cuda:1)")
    assert "layers: 29 of 11/29" in line
    assert "weights: 10.52 GiB" in line
    assert "9261 blocks x 16 tokens" in line
    # 9,261 x 16 = 148,176 tokens of pool, capped at --max-model-len for one request.
    assert "max context: 32,768 tokens (pool 148,176)" in line
    # Used = 32 GiB free at planning - 1.5 GiB free now = 30.5 GiB, predicted 30 GiB.
    assert "used: 30.50 GiB of the card's free memory, predicted 30.00 GiB (+1.7%)" in line
    assert line.endswith("free after: 1.50 GiB")


def test_rank_budget_respects_reserve_and_cap():
    assert w.rank_budget(free=14 * GiB, total=16 * GiB, reserve=GiB, cap=None) == 13 * GiB
    assert w.rank_budget(free=14 * GiB, total=16 * GiB, reserve=GiB, cap=8 * GiB) == 8 * GiB
