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
from platform_fakes import FILE_NAME_PATCH, VLLM_DIR, cuda, file_name_patch, platforms  # noqa: F401  (shared fixtures and helpers)


def test_copies_are_every_cuda_module_importing_the_file_name_function():
    holders = set()
    for f in VLLM_DIR.rglob("*.py"):
        text = f.read_text(errors="replace")
        if "import get_device_name_as_file_name" in text and f.name != "platform_utils.py":
            holders.add(".".join(("vllm", *f.relative_to(VLLM_DIR).with_suffix("").parts)))
    rocm_only = {"vllm.model_executor.layers.fused_moe.fused_flydsl_moe"}
    assert holders - rocm_only == set(FILE_NAME_PATCH.copies)


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
