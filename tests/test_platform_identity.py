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

# Physical GPUs in NVML (PCI bus) order, as a mixed pair plus a third card.
GPUS = [
    ("NVIDIA GeForce RTX 5090", (12, 0)),
    ("NVIDIA GeForce RTX 4070 Ti SUPER", (8, 9)),
    ("NVIDIA H200", (9, 0)),
]


def test_our_patches_are_all_declared():
    assert {p.name for p in PATCHES} >= OURS
    assert len(PLATFORM_PATCHES) == 4


def _source_params(path: Path, qualname: str) -> tuple[str, ...]:
    """Parameter names of a def in vLLM's installed source, found by qualified name."""
    tree = ast.parse(path.read_text())
    node: ast.AST = tree
    for part in qualname.split("."):
        node = next(
            n for n in ast.iter_child_nodes(node)
            if isinstance(n, (ast.ClassDef, ast.FunctionDef)) and n.name == part
        )
    a = node.args  # type: ignore[attr-defined]
    return tuple(x.arg for x in a.posonlyargs + a.args + a.kwonlyargs)


@pytest.mark.parametrize("name", sorted(OURS))
def test_targets_and_parameters_are_vllms_real_ones(name):
    p = next(p for p in PATCHES if p.name == name)
    path = VLLM_DIR / (p.module.removeprefix("vllm.").replace(".", "/") + ".py")
    assert _source_params(path, p.qualname) == p.params
    assert p.processes == (WORKER,) and p.issue == "#4"


def test_copies_are_every_cuda_module_importing_the_file_name_function():
    holders = set()
    for f in VLLM_DIR.rglob("*.py"):
        text = f.read_text(errors="replace")
        if "import get_device_name_as_file_name" in text and f.name != "platform_utils.py":
            holders.add(".".join(("vllm", *f.relative_to(VLLM_DIR).with_suffix("").parts)))
    rocm_only = {"vllm.model_executor.layers.fused_moe.fused_flydsl_moe"}
    assert holders - rocm_only == set(FILE_NAME_PATCH.copies)


def test_only_workers_of_the_dualgpu_executor_get_them():
    def names(kinds, active):
        return {p.name for p in plugin.select_patches(frozenset(kinds), active)}

    assert names({WORKER}, active=True) >= OURS
    assert not names({WORKER}, active=False) & OURS
    assert not names({FRONTEND}, active=True) & OURS
    assert not names({ENGINE}, active=True) & OURS


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


def test_before_cuda_init_everything_is_stock(platforms, cuda):
    nvml_cls, plain_cls = platforms.NvmlCudaPlatform, platforms.NonNvmlCudaPlatform
    assert nvml_cls.get_device_capability() == (12, 0)  # device 0, as vLLM answers
    assert plain_cls.get_device_capability() == (12, 0)
    assert nvml_cls.get_device_name() == GPUS[0][0]
    assert plain_cls.get_device_name() == GPUS[0][0]
    assert nvml_cls.has_device_capability(120)  # current_device() was never called


def test_after_init_each_rank_answers_for_its_own_card(platforms, cuda):
    cls = platforms.NvmlCudaPlatform
    cuda.init(1)  # rank 1 on the RTX 4070 Ti SUPER
    assert cls.get_device_capability() == (8, 9)
    assert cls.get_device_capability().to_int() == 89
    assert not cls.has_device_capability(90)
    assert cls.has_device_capability((8, 9))
    assert cls.is_device_capability(89) and not cls.is_device_capability(120)
    assert cls.is_device_capability_family(80)
    assert cls.get_device_name() == "NVIDIA GeForce RTX 4070 Ti SUPER"
    # an explicit other device is still that device
    assert cls.get_device_capability(2) == (9, 0)
    assert cls.get_device_name(2) == "NVIDIA H200"
    plain = platforms.NonNvmlCudaPlatform
    assert plain.get_device_capability() == (8, 9)
    assert plain.get_device_name() == "NVIDIA GeForce RTX 4070 Ti SUPER"
    assert not plain.has_device_capability(90)


def test_stock_answers_device_zero_on_every_rank(platforms, cuda):
    # What the patches fix, on the same fakes: revert and ask again on rank 1.
    cuda.init(1)
    try:
        for p in PLATFORM_PATCHES:
            assert revert_patch(p)
        assert platforms.NvmlCudaPlatform.get_device_capability() == (12, 0)
        assert platforms.NvmlCudaPlatform.get_device_name() == GPUS[0][0]
    finally:
        for p in PLATFORM_PATCHES:
            apply_patch(p, "0.30.0")


def test_visible_devices_are_mapped_like_vllm_maps_them(platforms, cuda, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,1")
    cuda.init(0)  # visible 0 is physical GPU 2
    assert platforms.NvmlCudaPlatform.get_device_capability() == (9, 0)
    assert platforms.NvmlCudaPlatform.get_device_name() == "NVIDIA H200"


def test_names_follow_assigned_physical_gpu_ids(platforms, cuda, monkeypatch):
    import vllm.platforms.interface as interface

    # The dualgpu plan puts the big card last: rank 0 -> physical 1, rank 1 -> physical 0.
    monkeypatch.setattr(interface, "_assigned_physical_gpu_ids", [1, 0])
    cls = platforms.NvmlCudaPlatform
    cuda.init(0)  # rank 1's torch device is visible 0 = physical 0
    assert cls.get_device_name() == "NVIDIA GeForce RTX 5090"
    assert cls.get_device_name.__wrapped__(cls, 0) == "NVIDIA GeForce RTX 4070 Ti SUPER"  # stock
    assert cls.get_device_capability() == (12, 0)


def test_answers_are_cached_per_device(platforms, cuda):
    cls, nvml = platforms.NvmlCudaPlatform, platforms.nvml
    cuda.init(1)
    for _ in range(3):
        assert cls.get_device_name() == GPUS[1][0]
        assert cls.get_device_capability() == (8, 9)
    assert nvml.name_calls == 1 and nvml.capability_calls == 1
    cuda.init(2)  # another device, another entry
    assert cls.get_device_name() == GPUS[2][0] and cls.get_device_capability() == (9, 0)
    assert nvml.name_calls == 2 and nvml.capability_calls == 2


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


def test_config_file_names_follow_the_current_device(file_name_patch, cuda):
    pu = file_name_patch
    assert pu.get_device_name_as_file_name() == "NVIDIA_GeForce_RTX_5090"  # before init: stock
    cuda.init(1)
    assert pu.get_device_name_as_file_name() == "NVIDIA_GeForce_RTX_4070_Ti_SUPER"
    for holder in FILE_NAME_PATCH.copies:
        assert sys.modules[holder].get_device_name_as_file_name is pu.get_device_name_as_file_name
    from vllm.model_executor.layers.quantization.utils import fp8_utils

    assert fp8_utils.get_device_name_as_file_name() == "NVIDIA_GeForce_RTX_4070_Ti_SUPER"
    cuda.init(2)
    assert fp8_utils.get_device_name_as_file_name() == "NVIDIA_H200"


def test_reverting_restores_vllms_function_in_every_copy(file_name_patch):
    pu = file_name_patch
    assert revert_patch(FILE_NAME_PATCH)
    original = pu.get_device_name_as_file_name
    for holder in FILE_NAME_PATCH.copies:
        assert sys.modules[holder].get_device_name_as_file_name is original
    assert apply_patch(FILE_NAME_PATCH, "0.30.0").status == APPLIED


def test_copy_holders_imported_later_bind_the_replacement(monkeypatch):
    # apply_patch must not import copy holders: vLLM modules read the device capability at
    # import time (w8a8_utils.CUTLASS_BLOCK_FP8_SUPPORTED), which must happen after CUDA init.
    target = types.ModuleType("fake_pu")
    exec("def name(device_id=0):\n    return 'stock'\n", target.__dict__)
    factories = types.ModuleType("fake_pu_factories")
    factories.wrap = lambda original: (lambda device_id=0: "patched")
    monkeypatch.setitem(sys.modules, "fake_pu", target)
    monkeypatch.setitem(sys.modules, "fake_pu_factories", factories)
    monkeypatch.delitem(sys.modules, "fake_late_holder", raising=False)
    patch = Patch(
        name="t", target="fake_pu:name", processes=(WORKER,), vllm_versions=">=0.30.0,<0.31",
        why="w", upstream="u", remove_when="r", factory="fake_pu_factories:wrap",
        params=("device_id",), copies=("fake_late_holder",),
    )
    out = apply_patch(patch, "0.30.0")
    assert out.status == APPLIED and out.rebound == []
    assert "fake_late_holder" not in sys.modules
    late = types.ModuleType("fake_late_holder")
    exec("from fake_pu import name\n", late.__dict__)  # what the holder does when imported
    monkeypatch.setitem(sys.modules, "fake_late_holder", late)
    assert late.name() == "patched"
    assert revert_patch(patch) and late.name() == "stock" and target.name() == "stock"
