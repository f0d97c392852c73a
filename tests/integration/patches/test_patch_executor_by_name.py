"""``--distributed-executor-backend dualgpu`` selects DualGpuExecutor, ``dualgpu-ray``
DualGpuRayExecutor (those tests need ray); other values are stock."""

from __future__ import annotations

import importlib.util
import pickle
from types import SimpleNamespace

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


def test_misspelled_name_gets_vllms_answer_and_a_hint(engine_args_cls, tiny_model_dir, caplog):
    """A name close to ours is vLLM's to refuse (its own error, unchanged); the plugin adds one
    line naming the backend it may have meant."""
    import logging

    caplog.set_level(logging.ERROR, logger="vllm.dualgpu")
    logging.getLogger("vllm.dualgpu").propagate = True
    with pytest.raises(NotImplementedError, match="Pipeline Parallelism"):
        make_config(engine_args_cls, tiny_model_dir, "dualgpus")
    assert "--distributed-executor-backend 'dualgpus': did you mean 'dualgpu'?" in caplog.text


def test_a_name_vllm_adds_later_reaches_vllm_unchanged():
    """Only 'dualgpu' and 'dualgpu-ray' are the plugin's: any other bare name is passed to
    vLLM's own create_engine_config and its answer returned (here a release that knows the
    name 'hpu_pool', which no supported vLLM has)."""
    from vllm_dualgpu.patches.arg_utils import wrap_create_engine_config

    seen = []

    def vllm_of_later(self, usage_context=None, headless=False):
        seen.append(self.distributed_executor_backend)
        return "vLLM's config"

    args = SimpleNamespace(distributed_executor_backend="hpu_pool")
    assert wrap_create_engine_config(vllm_of_later)(args) == "vLLM's config"
    assert seen == ["hpu_pool"]


@pytest.mark.parametrize("name", ["future_backend", "dualgpus"])
def test_other_names_fail_as_in_stock_vllm(engine_args_cls, tiny_model_dir, name):
    """vLLM's own refusal of an unknown name, the same with the plugin as without it."""
    from vllm.engine.arg_utils import EngineArgs

    stock = getattr(EngineArgs.create_engine_config, "__wrapped__")
    args = dict(model=str(tiny_model_dir), load_format="dummy", skip_tokenizer_init=True,
                pipeline_parallel_size=2, distributed_executor_backend=name)
    with pytest.raises(Exception) as without:
        stock(engine_args_cls(**args))
    with pytest.raises(Exception) as with_plugin:
        engine_args_cls(**args).create_engine_config()
    assert type(with_plugin.value) is type(without.value)
    assert str(with_plugin.value) == str(without.value)


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


def test_misspelled_ray_name_gets_a_hint(engine_args_cls, tiny_model_dir, caplog):
    import logging

    caplog.set_level(logging.ERROR, logger="vllm.dualgpu")
    logging.getLogger("vllm.dualgpu").propagate = True
    with pytest.raises(NotImplementedError):
        make_config(engine_args_cls, tiny_model_dir, "dualgpu-rya")
    assert "'dualgpu-rya': did you mean 'dualgpu-ray'?" in caplog.text


def test_dualgpu_ray_without_ray_says_what_to_install(engine_args_cls, tiny_model_dir, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "ray" else real(name, *a))
    with pytest.raises(ValueError, match=r"dualgpu-ray runs on Ray, which is not installed: pip install 'vllm-dualgpu\[ray\]'"):
        make_config(engine_args_cls, tiny_model_dir, "dualgpu-ray")


@pytest.mark.parametrize("path", ["vllm_dualgpu.executor.DualGpuExecutor",
                                  "vllm_dualgpu.engine.executor.DualGpuExecutor"])
def test_the_public_class_path_selects_the_executor(engine_args_cls, tiny_model_dir, path):
    """``--distributed-executor-backend vllm_dualgpu.executor.DualGpuExecutor`` (vLLM's
    module.Class form) is the same executor as the bare name, with PP > 1 too."""
    from vllm.v1.executor.abstract import Executor

    import vllm_dualgpu.executor
    from vllm_dualgpu.engine.executor import DualGpuExecutor

    assert vllm_dualgpu.executor.DualGpuExecutor is DualGpuExecutor
    cfg = make_config(engine_args_cls, tiny_model_dir, path)
    assert cfg.parallel_config.distributed_executor_backend is DualGpuExecutor
    assert Executor.get_class(cfg) is DualGpuExecutor
