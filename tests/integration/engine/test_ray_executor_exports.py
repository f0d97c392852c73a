"""What the dualgpu-ray executor exports for vLLM's Ray executor (VLLM_RAY_BUNDLE_INDICES) is
there while vLLM starts the workers and gone once the executor has started, or failed to: a
second dualgpu-ray engine in the same process is not refused by the first one's leftover."""

from __future__ import annotations

import os

import pytest
from plan_exports import restore_environ  # noqa: F401  (autouse: the plan's exports undone)

pytest.importorskip("ray", reason="Ray not installed")

from vllm_dualgpu.engine import ray_planning  # noqa: E402

BUNDLES = ray_planning.BUNDLE_ENV


@pytest.fixture
def executor(monkeypatch):
    from vllm.v1.executor.ray_executor_v2 import RayExecutorV2

    from vllm_dualgpu.engine.ray_executor import DualGpuRayExecutor

    seen = []

    def plan(self, planning_applies, apply, stock):  # what apply_cluster_plan exports
        os.environ[BUNDLES] = "2,0"

    def vllm_starts_workers(self):
        seen.append(os.environ.get(BUNDLES))
        if getattr(self, "fail", False):
            raise RuntimeError("a worker did not start")

    monkeypatch.setattr(DualGpuRayExecutor, "start_planned", plan)
    monkeypatch.setattr(RayExecutorV2, "_init_executor", vllm_starts_workers)
    monkeypatch.delenv(BUNDLES, raising=False)
    ex = object.__new__(DualGpuRayExecutor)
    ex.parallel_config = ex.vllm_config = None
    return ex, seen


def test_bundle_indices_are_taken_back_once_the_workers_started(executor):
    ex, seen = executor
    ex._init_executor()
    assert seen == ["2,0"]  # vLLM read the planned bundles
    assert BUNDLES not in os.environ


def test_bundle_indices_are_taken_back_when_the_start_fails(executor):
    ex, seen = executor
    ex.fail = True
    with pytest.raises(RuntimeError, match="did not start"):
        ex._init_executor()
    assert seen == ["2,0"] and BUNDLES not in os.environ
