"""One answer to "is this a dualgpu run?", read from vLLM's config in every process: true for
both executors (dualgpu and dualgpu-ray), and nothing left in os.environ by an engine."""

from __future__ import annotations

import importlib.util
import os
from types import SimpleNamespace

import pytest
from plan_exports import restore_environ  # noqa: F401  (autouse: the plan's exports undone)

from vllm_dualgpu import process
from vllm_dualgpu.engine import handoff

needs_ray = pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="Ray not installed")


def config_of(backend, pp=2, plan=False):
    cfg = SimpleNamespace(parallel_config=SimpleNamespace(distributed_executor_backend=backend,
                                                          pipeline_parallel_size=pp),
                          additional_config={})
    if plan:
        handoff.store(cfg, handoff.Handoff(
            ranks=(handoff.RankRecord(0, 0, "NVIDIA H200", 1 << 30, None, 2, None),
                   handoff.RankRecord(1, 1, "NVIDIA H200", 1 << 30, None, 2, None)),
            partition=(2, 2), partition_source="plan"))
    return cfg


def test_the_one_host_executor_is_a_dualgpu_run():
    from vllm_dualgpu.engine.executor import DualGpuExecutor
    from vllm_dualgpu.patches.spec_common import is_dualgpu_pp

    assert process.is_dualgpu_run(config_of(DualGpuExecutor))
    assert is_dualgpu_pp(config_of(DualGpuExecutor)) and not is_dualgpu_pp(config_of(DualGpuExecutor, pp=1))
    assert not process.is_dualgpu_run(config_of("mp")) and not process.is_dualgpu_run(config_of(None))


@needs_ray
def test_the_ray_executor_is_a_dualgpu_run_too():
    """The config-based patches (pp-inflight-batches, KV grouping, hybrid block size, vision
    tower) act under dualgpu-ray as under dualgpu."""
    from vllm.v1.executor.ray_executor_v2 import RayExecutorV2

    from vllm_dualgpu.engine.ray_executor import DualGpuRayExecutor
    from vllm_dualgpu.patches.spec_common import is_dualgpu_pp

    assert process.is_dualgpu_run(config_of(DualGpuRayExecutor))
    assert is_dualgpu_pp(config_of(DualGpuRayExecutor))
    assert not process.is_dualgpu_run(config_of(RayExecutorV2))


def test_an_engine_leaves_nothing_in_the_environment(monkeypatch):
    from vllm_dualgpu import plugin
    from vllm_dualgpu.engine import preflight
    from vllm_dualgpu.engine.planned_executor import PlannedExecutor

    monkeypatch.setattr(plugin, "ensure", lambda kinds: [])
    monkeypatch.setattr(plugin, "ensure_for_dualgpu", lambda kinds: [])
    monkeypatch.setattr(preflight, "check_platform", lambda pc: None)
    import vllm_dualgpu.kernels.flashinfer as fi

    monkeypatch.setattr(fi, "apply_flashinfer_autotune_policy", lambda *a: None)
    before = dict(os.environ)
    ex = PlannedExecutor()
    ex.parallel_config, ex.vllm_config = None, SimpleNamespace(kernel_config=None)
    ex.start_planned(lambda pc: None, lambda cfg: SimpleNamespace(gpus=[]), "stock")
    assert {k: v for k, v in os.environ.items() if k.startswith("VLLM_DUALGPU")} == \
        {k: v for k, v in before.items() if k.startswith("VLLM_DUALGPU")}


def test_a_worker_is_in_a_dualgpu_run_when_its_config_carries_the_plan(monkeypatch):
    """Code without a config (model code in a worker) asks the process: DualGpuWorker noted
    the config it was built with."""
    from vllm_dualgpu.engine.executor import DualGpuExecutor

    monkeypatch.setattr(process, "_worker_run", dict(process._worker_run))
    assert not process.is_dualgpu_run()
    process.note_worker_config(config_of(DualGpuExecutor, plan=True))
    assert process.is_dualgpu_run()
    process.note_worker_config(config_of(DualGpuExecutor, plan=False))  # PP=1: stock worker
    assert not process.is_dualgpu_run()
