"""Per-rank device identity: the registry patches on vLLM's real platform code, with fakes below.

``vllm.platforms.cuda`` cannot be imported without the CUDA driver (its first import is
``vllm._C_stable_libtorch``). The fake used here is vLLM's own installed source executed
without that one line, so the classes, decorators (``@cache``, ``@with_nvml_context``) and
device-id mapping are vLLM 0.30.0's; only NVML (``pynvml``) and ``torch.cuda`` are fakes.
"""


from __future__ import annotations
import ast
import sys
import types
from pathlib import Path
import pytest
import torch
import vllm
from vllm_dualgpu import plugin
from vllm_dualgpu.patching.core import APPLIED, Patch, apply_patch, revert_patch
from vllm_dualgpu.patching.registry import PATCHES
from vllm_dualgpu.process import ENGINE, FRONTEND, WORKER


VLLM_DIR = Path(vllm.__file__).parent


CUDA_SRC = VLLM_DIR / "platforms" / "cuda.py"


KERNEL_IMPORT = "import vllm._C_stable_libtorch  # noqa\n"


OURS = {
    "capability-per-rank",
    "capability-per-rank-nonnvml",
    "device-name-per-rank",
    "device-name-per-rank-nonnvml",
    "config-file-name-per-rank",
}


PLATFORM_PATCHES = [p for p in PATCHES if p.name in OURS and p.module == "vllm.platforms.cuda"]


FILE_NAME_PATCH = next(p for p in PATCHES if p.name == "config-file-name-per-rank")


GPUS = [
    ("NVIDIA GeForce RTX 5090", (12, 0)),
    ("NVIDIA GeForce RTX 4070 Ti SUPER", (8, 9)),
    ("NVIDIA H200", (9, 0)),
]


class FakeNvml:
    """The pynvml calls vLLM's NvmlCudaPlatform makes, over GPUS."""

    class NVMLError(Exception):
        pass

    def __init__(self):
        self.name_calls = 0
        self.capability_calls = 0

    def nvmlInit(self):
        pass

    def nvmlShutdown(self):
        pass

    def nvmlDeviceGetHandleByIndex(self, i):
        return i

    def nvmlDeviceGetCudaComputeCapability(self, h):
        self.capability_calls += 1
        return GPUS[h][1]

    def nvmlDeviceGetName(self, h):
        self.name_calls += 1
        return GPUS[h][0]


class FakeCuda:
    """torch.cuda as a worker sees it: not initialised until `init(device)`."""

    def __init__(self):
        self.initialized = False
        self.device = None

    def init(self, device):
        self.initialized, self.device = True, device

    def current_device(self):
        if not self.initialized:
            raise AssertionError("current_device() before CUDA init would initialise CUDA")
        return self.device

    # visible ordinals; CUDA_VISIBLE_DEVICES is not applied by these fakes' callers
    def get_device_capability(self, device):
        return GPUS[device][1]

    def get_device_name(self, device):
        return GPUS[device][0]


@pytest.fixture
def cuda(monkeypatch):
    fake = FakeCuda()
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: fake.initialized)
    monkeypatch.setattr(torch.cuda, "current_device", fake.current_device)
    monkeypatch.setattr(torch.cuda, "get_device_capability", fake.get_device_capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", fake.get_device_name)
    return fake


@pytest.fixture
def platforms(monkeypatch, cuda):
    """vLLM's real platforms/cuda.py, loaded without its kernel import, NVML faked."""
    import vllm.platforms.interface as interface

    src = CUDA_SRC.read_text()
    assert src.count(KERNEL_IMPORT) == 1, "vLLM's platforms/cuda.py changed: review these patches"
    module = types.ModuleType("vllm.platforms.cuda")
    module.__file__ = str(CUDA_SRC)
    monkeypatch.setitem(sys.modules, "vllm.platforms.cuda", module)
    exec(compile(src.replace(KERNEL_IMPORT, ""), str(CUDA_SRC), "exec"), module.__dict__)
    nvml = FakeNvml()
    monkeypatch.setattr(module, "pynvml", nvml)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(interface, "_assigned_physical_gpu_ids", None)
    module.nvml = nvml
    for p in PLATFORM_PATCHES:
        assert apply_patch(p, "0.30.0").status == APPLIED, p.name
    return module


@pytest.fixture
def file_name_patch(platforms, monkeypatch):
    import importlib

    import vllm.platforms as vp

    # The holders, imported as the worker imports them (some read the platform at import time,
    # which the fake CUDA platform cannot serve here), then the fake platform.
    for holder in FILE_NAME_PATCH.copies:
        importlib.import_module(holder)
    monkeypatch.setattr(vp, "_current_platform", platforms.NvmlCudaPlatform())
    out = apply_patch(FILE_NAME_PATCH, "0.30.0")
    assert out.status == APPLIED and sorted(out.rebound) == sorted(FILE_NAME_PATCH.copies)
    import vllm.utils.platform_utils as pu

    pu.get_device_name_as_file_name.__wrapped__.cache_clear()  # vLLM's own @cache
    yield pu
    assert revert_patch(FILE_NAME_PATCH)
