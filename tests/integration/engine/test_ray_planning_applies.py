"""When the dualgpu-ray executor plans, and when it runs as vLLM's Ray executor (and why)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from vllm_dualgpu.engine import handoff
from vllm_dualgpu.engine.ray_planning import node_gpu_order, planning_applies


def pc(pp=2, tp=1, dp=1, nnodes=1):
    return SimpleNamespace(pipeline_parallel_size=pp, tensor_parallel_size=tp, data_parallel_size=dp, nnodes=nnodes)


@pytest.mark.parametrize("config, why", [
    (pc(), None),
    (pc(pp=1), "pipeline_parallel_size=1"),
    (pc(tp=2), "tensor_parallel_size=2"),
    (pc(dp=2), "data parallel"),
])
def test_planning_applies_on_ray(config, why):
    got = planning_applies(config)
    assert got is None if why is None else why in got


def test_node_gpu_order_is_none_off_ray():
    rank = handoff.RankRecord(0, 1, "RTX 5090", 0, None, 10, None)
    plan = handoff.Handoff((rank, rank), (10, 10), "plan")
    assert node_gpu_order(plan, 0) is None
    assert node_gpu_order(None, 0) is None


def test_node_gpu_order_keeps_rank_order_per_node():
    def r(rank, gpu, node):
        return handoff.RankRecord(rank, gpu, "card", 0, None, 9, None, node_id=node)

    plan = handoff.Handoff((r(0, 1, "a"), r(1, 0, "a"), r(2, 2, "b"), r(3, 0, "b")), (9, 9, 9, 9), "plan")
    assert node_gpu_order(plan, 1) == [1, 0]
    assert node_gpu_order(plan, 2) == [2, 0]
    again = handoff.Handoff.from_dict(plan.to_dict())
    assert again == plan
