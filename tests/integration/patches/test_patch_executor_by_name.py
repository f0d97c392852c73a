"""``--distributed-executor-backend dualgpu`` selects DualGpuExecutor, ``dualgpu-ray``
DualGpuRayExecutor (those tests need ray); other values are stock."""

from __future__ import annotations

import importlib.util
import pickle

import pytest

needs_ray = pytest.mark.skipif(importlib.util.find_spec("ray") is None,
                               reason="the dualgpu-ray backend needs ray (pip install ray)")


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
    return engine_args_cls(
        model=str(model_dir),
        load_format="dummy",
        skip_tokenizer_init=True,
        pipeline_parallel_size=pp,
        distributed_executor_backend=backend,
    ).create_engine_config()


def test_dualgpu_name_selects_the_executor_class(engine_args_cls, tiny_model_dir):
    from vllm.config import replace
    from vllm.v1.executor.abstract import Executor

    from vllm_dualgpu.engine.executor import DualGpuExecutor

    cfg = make_config(engine_args_cls, tiny_model_dir, "dualgpu")
    assert cfg.parallel_config.distributed_executor_backend is DualGpuExecutor
    assert Executor.get_class(cfg) is DualGpuExecutor
    # Workers rebuild configs with replace() (drafter loading) and unpickle them.
    assert replace(cfg.parallel_config).distributed_executor_backend is DualGpuExecutor
    again = pickle.loads(pickle.dumps(cfg))
    assert again.parallel_config.distributed_executor_backend is DualGpuExecutor


def test_mp_is_unchanged(engine_args_cls, tiny_model_dir):
    cfg = make_config(engine_args_cls, tiny_model_dir, "mp")
    assert cfg.parallel_config.distributed_executor_backend == "mp"


def test_misspelled_name_is_a_clear_error(engine_args_cls, tiny_model_dir):
    with pytest.raises(ValueError, match=r"Unknown --distributed-executor-backend 'dualgpus'.*Did you mean 'dualgpu'"):
        make_config(engine_args_cls, tiny_model_dir, "dualgpus")


def test_without_plugin_stock_vllm_refuses_the_name(engine_args_cls, tiny_model_dir):
    """The patch is what makes the name work: reverting it brings back vLLM's refusal."""
    from vllm_dualgpu.patching.core import apply_patch, revert_patch
    from vllm_dualgpu.patching.registry import PATCHES

    patch = next(p for p in PATCHES if p.name == "executor-by-name")
    assert revert_patch(patch)
    try:
        with pytest.raises(Exception, match="Pipeline Parallelism"):
            make_config(engine_args_cls, tiny_model_dir, "dualgpu")
    finally:
        import vllm

        assert apply_patch(patch, vllm.__version__).status == "applied"


def test_class_path_backend_still_resolves(engine_args_cls, tiny_model_dir):
    from vllm.v1.executor.abstract import Executor
    from vllm.v1.executor.multiproc_executor import MultiprocExecutor

    cfg = make_config(
        engine_args_cls, tiny_model_dir, "vllm.v1.executor.multiproc_executor.MultiprocExecutor", pp=1
    )
    assert Executor.get_class(cfg) is MultiprocExecutor


@needs_ray
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


@needs_ray
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


def test_dualgpu_ray_without_ray_says_what_to_install(engine_args_cls, tiny_model_dir, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "ray" else real(name, *a))
    with pytest.raises(ValueError, match=r"dualgpu-ray runs on Ray, which is not installed: pip install 'vllm-dualgpu\[ray\]'"):
        make_config(engine_args_cls, tiny_model_dir, "dualgpu-ray")
