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
from platform_fakes import GPUS, cuda, platforms  # noqa: F401  (shared fixtures and helpers)


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
