"""``--distributed-executor-backend dualgpu-ray`` selects DualGpuRayExecutor (vLLM's Ray executor)."""

from __future__ import annotations

import pickle

import pytest

pytest.importorskip("ray", reason="the dualgpu-ray backend needs ray (pip install ray)")


@pytest.fixture(scope="module")
def engine_args_cls():
    import vllm.platforms
    from vllm.platforms.cpu import CpuPlatform

    vllm.platforms._current_platform = CpuPlatform()
    import vllm_dualgpu

    vllm_dualgpu.register()
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs


def make_config(engine_args_cls, model_dir, backend, pp=2):
    return engine_args_cls(model=str(model_dir), load_format="dummy", skip_tokenizer_init=True,
                           pipeline_parallel_size=pp, distributed_executor_backend=backend).create_engine_config()


def test_dualgpu_ray_name_selects_the_ray_executor(engine_args_cls, tiny_model_dir):
    from vllm.v1.executor.abstract import Executor
    from vllm.v1.executor.ray_executor_v2 import RayExecutorV2

    from vllm_dualgpu.engine.ray_executor import DualGpuRayExecutor

    cfg = make_config(engine_args_cls, tiny_model_dir, "dualgpu-ray")
    assert cfg.parallel_config.distributed_executor_backend is DualGpuRayExecutor
    assert Executor.get_class(cfg) is DualGpuRayExecutor
    assert issubclass(DualGpuRayExecutor, RayExecutorV2) and cfg.parallel_config.use_ray
    again = pickle.loads(pickle.dumps(cfg))
    assert again.parallel_config.distributed_executor_backend is DualGpuRayExecutor


def test_front_end_does_not_count_the_local_gpus_for_ray(engine_args_cls, tiny_model_dir, monkeypatch):
    """The ranks run on the cluster's nodes: one local card does not refuse -pp 4 on Ray."""
    from vllm_dualgpu.engine import preflight

    monkeypatch.setattr(preflight, "nvml_gpu_count", lambda: 1)
    cfg = make_config(engine_args_cls, tiny_model_dir, "dualgpu-ray", pp=4)
    assert cfg.parallel_config.pipeline_parallel_size == 4
    with pytest.raises(ValueError, match="needs 4 GPUs, but 1 is visible"):
        make_config(engine_args_cls, tiny_model_dir, "dualgpu", pp=4)


def test_misspelled_ray_name_is_a_clear_error(engine_args_cls, tiny_model_dir):
    with pytest.raises(ValueError, match=r"Unknown --distributed-executor-backend 'dualgpu-rya'.*Did you mean 'dualgpu-ray'"):
        make_config(engine_args_cls, tiny_model_dir, "dualgpu-rya")
