"""device-name-per-rank-nonnvml: vLLM's ``NonNvmlCudaPlatform`` names the current device, not
device 0 (real platforms/cuda.py, NVML and CUDA faked: platform_fakes)."""

from __future__ import annotations

from conftest import registry_patch
from platform_fakes import cuda, platforms  # noqa: F401  (shared fixtures)
from vllm_dualgpu.patching.core import APPLIED, apply_patch, revert_patch


def test_name_follows_the_current_device_and_stock_does_not(platforms, cuda):
    cls = platforms.NonNvmlCudaPlatform
    cuda.init(1)
    assert cls.get_device_name() == "NVIDIA GeForce RTX 4070 Ti SUPER"
    patch = registry_patch("device-name-per-rank-nonnvml")
    assert revert_patch(patch)
    try:
        assert cls.get_device_name() == "NVIDIA GeForce RTX 5090"  # stock: device 0
        assert cls.get_device_capability() == (8, 9)  # the capability patch is a separate entry
    finally:
        assert apply_patch(patch, "0.30.0").status == APPLIED
