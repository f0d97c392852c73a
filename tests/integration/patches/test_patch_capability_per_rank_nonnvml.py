"""capability-per-rank-nonnvml: vLLM's ``NonNvmlCudaPlatform`` answers for the current device,
not device 0 (real platforms/cuda.py, NVML and CUDA faked: platform_fakes)."""

from __future__ import annotations

from conftest import registry_patch
from platform_fakes import cuda, platforms  # noqa: F401  (shared fixtures)
from vllm_dualgpu.patching.core import APPLIED, apply_patch, revert_patch


def test_capability_follows_the_current_device_and_stock_does_not(platforms, cuda):
    cls = platforms.NonNvmlCudaPlatform
    cuda.init(2)  # the H200
    assert cls.get_device_capability() == (9, 0)
    patch = registry_patch("capability-per-rank-nonnvml")
    assert revert_patch(patch)
    try:
        assert cls.get_device_capability() == (12, 0)  # stock: device 0, the RTX 5090
        assert cls.get_device_name() == "NVIDIA H200"  # the name patch is a separate entry
    finally:
        assert apply_patch(patch, "0.30.0").status == APPLIED
