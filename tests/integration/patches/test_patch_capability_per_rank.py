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
from platform_fakes import GPUS, OURS, PLATFORM_PATCHES, VLLM_DIR, cuda, platforms  # noqa: F401  (shared fixtures and helpers)


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


def test_only_workers_of_the_dualgpu_executor_get_them():
    def names(kinds, active):
        return {p.name for p in plugin.select_patches(frozenset(kinds), active)}

    assert names({WORKER}, active=True) >= OURS
    assert not names({WORKER}, active=False) & OURS
    assert not names({FRONTEND}, active=True) & OURS
    assert not names({ENGINE}, active=True) & OURS


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
