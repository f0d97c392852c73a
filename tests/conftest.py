"""Shared fixtures. CPU tests use real vLLM objects on vLLM's CPU platform."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest

FIXTURES = Path(__file__).parent / "fixtures"
REPO_ROOT = Path(__file__).resolve().parents[1]
# tests/gpu holds the small model presets and the run settings of the GPU tests; CPU tests build
# those runs' vLLM configs from them (import gpu_models, gpu_tokens), and the harness modules'
# own CPU tests (tests/unit/gpu_support) import them from there.
sys.path.insert(1, str(Path(__file__).parent / "gpu"))

# vLLM picks its CPU platform only when told; without it config creation cannot infer a device.
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")


def _triton_for_cpu_configs() -> None:
    """vLLM 0.34's CPU platform refuses a config on x86 unless Triton counts as usable
    (``vllm.triton_utils.HAS_TRITON``: "vLLM on x86 CPUs requires Triton (triton-cpu)"), and the
    CUDA wheel's Triton has no active driver on a machine without GPUs. vLLM keeps Triton when
    CUDA_VISIBLE_DEVICES is set and empty (a distributed worker before its devices are set). On
    such a machine, and only there (torch sees no CUDA device), the CPU tests and the vLLM
    processes they start run with it empty: they build configs and run no Triton kernel."""
    if os.environ.get("VLLM_TARGET_DEVICE") != "cpu" or "CUDA_VISIBLE_DEVICES" in os.environ:
        return
    try:
        import importlib.metadata

        from packaging.version import Version

        if Version(importlib.metadata.version("vllm")) < Version("0.34"):
            return
    except Exception:  # vLLM not installed (the unit layer needs none)
        return
    import torch

    if torch.cuda.device_count() == 0:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""


_triton_for_cpu_configs()


@pytest.fixture(autouse=True, scope="session")
def vllm_logging_configured_once():
    """Configure vLLM's logging before any test captures logs: vLLM 0.33 configures it only when
    a CLI or engine starts, and the plugin then does it itself (log.ensure_vllm_logging) in the
    middle of a test, which would move the handlers under that test's log capture."""
    try:
        import vllm  # noqa: F401
    except ImportError:
        return
    from vllm_dualgpu.log import ensure_vllm_logging

    ensure_vllm_logging()


@pytest.fixture(autouse=True, scope="session")
def no_machine_profile():
    """No test reads a machine profile from the user's cache (``vllm-dualgpu calibrate``'s file
    changes plan's bandwidths): tests that want one set VLLM_DUALGPU_MACHINE_PROFILE themselves."""
    from vllm_dualgpu.envs import MACHINE_PROFILE

    saved = os.environ.get(MACHINE_PROFILE)
    os.environ[MACHINE_PROFILE] = "none"
    yield
    if saved is None:
        os.environ.pop(MACHINE_PROFILE, None)
    else:
        os.environ[MACHINE_PROFILE] = saved


@pytest.fixture(autouse=True, scope="session")
def gpu_run_properties(record_testsuite_property):
    """On a GPU machine, the JUnit file names the vLLM release and the pair the PP=2 tests ran
    on (two GPUs, or the virtual pair on one)."""
    from gpu_harness import gpu_count, pair_env

    if not gpu_count():
        return
    try:
        import importlib.metadata as md

        record_testsuite_property("vllm", md.version("vllm"))
    except Exception:
        pass
    record_testsuite_property("gpus seen", gpu_count())
    record_testsuite_property("pp2 pair", pair_env().get("VLLM_DUALGPU_VIRTUAL_GPUS", "two GPUs (ballast)"))


def pytest_collection_modifyitems(config, items):
    """A ``gpu`` test is skipped, with the reason, where NVML sees no GPU (tests/gpu marks its own
    tests with the number of GPUs each needs: gpu_harness.needs_gpus)."""
    from gpu_harness import gpu_count

    if gpu_count():
        return
    skip = pytest.mark.skip(reason="needs NVIDIA GPUs; NVML sees none (on the GPU machine: bash scripts/gpu/run.sh)")
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(skip)


@pytest.fixture
def tiny_model_dir(tmp_path) -> Path:
    """A directory holding only a small Qwen3 config.json (enough for load_format='dummy')."""
    d = tmp_path / "tiny-qwen3"
    d.mkdir()
    shutil.copy(FIXTURES / "tiny_qwen3.json", d / "config.json")
    return d


@pytest.fixture
def write_config(tmp_path):
    """Write a config.json dict into a fresh model directory and return the directory."""

    def _write(cfg: dict, name: str = "model") -> Path:
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text(json.dumps(cfg))
        return d

    return _write


@pytest.fixture(scope="module")
def vllm_version():
    """vLLM on its CPU platform (no GPU here); the installed version, for applying patches."""
    import vllm
    import vllm.platforms
    from vllm.platforms.cpu import CpuPlatform

    vllm.platforms._current_platform = CpuPlatform()
    return vllm.__version__


# The weight shapes of a Qwen3.5 27B-class block-FP8 checkpoint (the shipped FP8 configs' seed set).
SEED_SHAPES = [(14336, 5120), (5120, 6144), (16384, 5120), (34816, 5120), (5120, 17408)]


def qwen35_27b(ignore: list[str] | None = None, **text) -> dict:
    """A Qwen3.5 27B-class block-FP8 config.json (the shapes of the shipped configs)."""
    layers = 64
    q = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
         "weight_block_size": [128, 128]}
    if ignore is not None:
        q["modules_to_not_convert"] = ignore
    return {
        "architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
        "quantization_config": q,
        "text_config": {
            "model_type": "qwen3_5_text", "hidden_size": 5120, "intermediate_size": 17408,
            "num_hidden_layers": layers, "num_attention_heads": 24, "num_key_value_heads": 4,
            "head_dim": 256, "attn_output_gate": True, "full_attention_interval": 4,
            "layer_types": ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)],
            "linear_num_key_heads": 16, "linear_num_value_heads": 48, "linear_key_head_dim": 128,
            "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "mtp_num_hidden_layers": 1,
            **text,
        },
    }


def registry_patch(name: str):
    """The registry's entry called ``name``."""
    from vllm_dualgpu.patching.registry import PATCHES

    return next(p for p in PATCHES if p.name == name)


@pytest.fixture
def pp_stage(monkeypatch):
    """pp_stage(rank, world_size): the pipeline group this process sees (tensor parallel 1)."""
    from types import SimpleNamespace

    from vllm.distributed import parallel_state

    monkeypatch.setattr(parallel_state, "_TP", SimpleNamespace(world_size=1, rank_in_group=0))

    def _set(rank: int, world: int):
        group = SimpleNamespace(
            world_size=world, rank_in_group=rank, is_first_rank=rank == 0, is_last_rank=rank == world - 1
        )
        monkeypatch.setattr(parallel_state, "_PP", group)
        return group

    return _set


def apply_registry_patch(name: str, vllm_version: str):
    """Apply the registry's patch ``name`` (or find it applied); the caller reverts it."""
    from vllm_dualgpu.patching.core import ALREADY, APPLIED, apply_patch

    patch = registry_patch(name)
    outcome = apply_patch(patch, vllm_version)
    assert outcome.status in (APPLIED, ALREADY), outcome.reason
    return patch



def v2_runner_or_skip(monkeypatch) -> None:
    """Build vLLM configs for its V2 model runner, the one the GPU runs take: only V2 runs a DFlash2
    drafter (V1 refuses it: "DFlash candidate-head drafts"), and the CPU platform would pick V1.
    vLLM 0.30's config refuses V2 without a working Triton ("Model Runner V2 requires Triton.",
    VllmConfig._validate_v2_model_runner), which the CPU build of torch lacks: skipped there;
    0.33's does not ask."""
    import inspect

    from vllm.config import VllmConfig
    from vllm.triton_utils import HAS_TRITON

    if not HAS_TRITON and "requires Triton" in inspect.getsource(VllmConfig._validate_v2_model_runner):
        pytest.skip("this vLLM builds no V2-runner config without Triton (CPU build of torch), and only the V2 "
                    "runner runs a DFlash2 drafter")
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")


@pytest.fixture
def v2_runner(monkeypatch):
    v2_runner_or_skip(monkeypatch)


@pytest.fixture(scope="module")
def qwen3_5():
    """vLLM's ``qwen3_5`` model module, importable without torchvision.

    It imports a transformers module that needs torchvision, which CPU installs lack; that one
    module is then replaced by the PIL one's ``smart_resize`` (the only name vLLM takes from it).
    """
    import importlib.util
    import sys
    import types

    name = "transformers.models.qwen2_vl.image_processing_qwen2_vl"
    with pytest.MonkeyPatch.context() as mp:
        if importlib.util.find_spec("torchvision") is None and name not in sys.modules:
            from transformers.models.qwen2_vl import image_processing_pil_qwen2_vl as pil

            stub = types.ModuleType(name)
            stub.smart_resize = pil.smart_resize
            mp.setitem(sys.modules, name, stub)
        from vllm.model_executor.models import qwen3_5 as module

        yield module


@pytest.fixture(scope="module")
def engine_config(qwen3_5):
    """make(**engine_args) -> vLLM's real VllmConfig, built on the CPU platform as the plugin's
    front end builds it (``executor-by-name`` wrapping ``create_engine_config``)."""
    import vllm.model_executor.models.registry as registry
    from vllm.engine.arg_utils import EngineArgs

    from vllm_dualgpu.patches.arg_utils import wrap_create_engine_config

    create = getattr(EngineArgs.create_engine_config, "__wrapped__", None)
    create = wrap_create_engine_config(create or EngineArgs.create_engine_config)

    def make(**kw):
        return create(EngineArgs(**kw))

    # vLLM inspects model classes in a subprocess, where the qwen3_5 fixture's stand-in for the
    # torchvision-backed module does not exist: inspect here instead (no CUDA involved).
    # Its lookups are cached per process, failures included (an earlier test may have tried
    # without the stand-in): start and end with empty caches.
    caches = (registry._try_load_model_cls, registry._try_inspect_model_cls)
    for c in caches:
        c.cache_clear()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(registry, "_run_in_subprocess", lambda fn: fn())
        yield make
    for c in caches:
        c.cache_clear()


@pytest.fixture(scope="module")
def qwen3_5_hybrid_config(engine_config, tmp_path_factory):
    """make(backend="dualgpu", **engine_args) -> vLLM's real VllmConfig of the GPU tests' small
    Qwen3.5 hybrid (gpu_models.SPEC_HYBRID: 6 Gated DeltaNet + 2 attention layers, one MTP layer)
    with PP=2."""
    import gpu_models

    d = gpu_models.write_config_only(gpu_models.SPEC_HYBRID, tmp_path_factory.mktemp("qwen3_5-hybrid"))

    def make(backend: str = "dualgpu", **kw):
        kw = {"pipeline_parallel_size": 2, "enable_prefix_caching": True, "max_model_len": 4096, **kw}
        return engine_config(model=str(d), load_format="dummy", skip_tokenizer_init=True,
                             distributed_executor_backend=backend, **kw)

    return make
