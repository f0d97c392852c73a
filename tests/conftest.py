"""Shared fixtures. CPU tests use real vLLM objects on vLLM's CPU platform."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

FIXTURES = Path(__file__).parent / "fixtures"

# vLLM picks its CPU platform only when told; without it config creation cannot infer a device.
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")


def _has_gpu() -> bool:
    try:
        import pynvml

        pynvml.nvmlInit()
        return pynvml.nvmlDeviceGetCount() > 0
    except Exception:
        return False


def pytest_collection_modifyitems(config, items):
    if _has_gpu():
        return
    skip = pytest.mark.skip(reason="needs NVIDIA GPUs (none visible); run scripts/gpu/run_gpu_suite.sh on a GPU machine")
    for item in items:
        if "gpu" in item.keywords:
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
def qwen3_5_hybrid_config(qwen3_5, tmp_path_factory):
    """make(backend="dualgpu", **engine_args) -> vLLM's real VllmConfig of the GPU runs' small
    Qwen3.5 hybrid (6 Gated DeltaNet + 2 attention layers, one MTP layer) with PP=2."""
    import vllm.model_executor.models.registry as registry
    from vllm.engine.arg_utils import EngineArgs

    from vllm_dualgpu.patches.arg_utils import wrap_create_engine_config

    d = tmp_path_factory.mktemp("qwen3_5-hybrid")
    (d / "config.json").write_text(json.dumps(load_gpu_script("spec_decode_pp").MODEL_CONFIG))
    create = getattr(EngineArgs.create_engine_config, "__wrapped__", None)
    create = wrap_create_engine_config(create or EngineArgs.create_engine_config)

    def make(backend: str = "dualgpu", **kw):
        kw = {"pipeline_parallel_size": 2, "enable_prefix_caching": True, "max_model_len": 4096, **kw}
        return create(EngineArgs(model=str(d), load_format="dummy", skip_tokenizer_init=True,
                                 distributed_executor_backend=backend, **kw))

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


GPU_SCRIPTS = Path(__file__).resolve().parents[1] / "scripts" / "gpu"


def load_gpu_script(name: str):
    """scripts/gpu/NAME.py as a module (it imports its sibling scripts by name)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, GPU_SCRIPTS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def gpu_script_dry_run(name: str, out: Path, timeout: float) -> Path:
    """Run scripts/gpu/NAME.py OUT --dry-run on the CPU in a subprocess (vLLM state stays there)."""
    import subprocess
    import sys

    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu"}
    proc = subprocess.run([sys.executable, str(GPU_SCRIPTS / f"{name}.py"), str(out), "--dry-run"], env=env,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out


# --- stand-in children for the GPU scripts' parents (no vLLM) ---------------------------------

STAND_IN_CHILD = r"""
import json, os, subprocess, sys, time
from pathlib import Path
out, arm = Path(sys.argv[1]), (sys.argv[3] if len(sys.argv) > 3 else "mtp")
payload = json.loads(Path(os.environ["FAKE_PAYLOAD"]).read_text())[arm]
if payload.get("hang"):
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    (out / "grandchild.pid").write_text(str(child.pid))
    time.sleep(600)
for line in payload["log"]:
    print(line, flush=True)
(out / payload.get("file", f"{arm}-child.json")).write_text(json.dumps(payload["result"]))
"""


def use_stand_in_children(monkeypatch, script: Path, payload_file: Path, expected_env: dict | None = None) -> None:
    """``gpurun.start`` runs STAND_IN_CHILD, with the argv of ``script``'s real child, instead of
    vLLM. Per arm, PAYLOAD_FILE holds the lines it prints ("log"), what it writes ("result", to
    "file", default ARM-child.json), or "hang": it sleeps with a grandchild (grandchild.pid)."""
    import sys

    monkeypatch.syspath_prepend(str(script.parent))
    import gpurun

    real_start = gpurun.start

    def start(cmd, log, env=None):
        assert cmd[1] == str(script) and cmd[3] == "--child"
        assert expected_env is None or env == expected_env
        return real_start([sys.executable, "-c", STAND_IN_CHILD, *cmd[2:]], log,
                          env={**(env or {}), "FAKE_PAYLOAD": str(payload_file)})

    monkeypatch.setattr(gpurun, "start", start)


def process_gone(pid: int) -> bool:
    """The process is gone, or a zombie nobody has reaped yet."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return True
    return state == "Z"
