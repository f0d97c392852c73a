"""Shared by the virtual-gpus-* entries' tests (imported by name): a rank's process after
``engine.virtual_card.activate`` on vLLM's real platform code (platform_fakes: NVML and
torch.cuda faked), with NVML's per-process memory faked, reverted afterwards."""

from __future__ import annotations

import dataclasses
import os
import sys
import types

import pytest
import torch

from vllm_dualgpu import plugin
from vllm_dualgpu.engine import virtual_card as vg
from vllm_dualgpu.patching import registry
from vllm_dualgpu.patching.core import APPLIED, revert_patch
from vllm_dualgpu.process import DEVICE, ENGINE, FRONTEND, WORKER
from vllm_dualgpu.virtual_gpus import VirtualCard
from platform_fakes import GPUS, cuda, platforms  # noqa: F401  (shared fixtures)

GiB = 1024**3
VIRTUAL = [p for p in registry.PATCHES if p.when == registry.VIRTUAL_GPUS]
CARD = VirtualCard(name="NVIDIA GeForce RTX 4070 Ti SUPER", total_bytes=16 * GiB, free_bytes=15 * GiB,
                   capability=(8, 9), reported_capability=(8, 9), physical_id=2,
                   physical_name="NVIDIA H200", physical_total_bytes=140 * GiB)


class PerProcessNvml:
    """pynvml's per-process memory query over a list of (pid, bytes)."""

    def __init__(self, procs):
        self.procs, self.handles = procs, []

    def nvmlInit(self):
        pass

    def nvmlDeviceGetHandleByIndex(self, i):
        self.handles.append(i)
        return f"handle-{i}"

    def nvmlDeviceGetComputeRunningProcesses(self, handle):
        return [types.SimpleNamespace(pid=p, usedGpuMemory=b) for p, b in self.procs]


@pytest.fixture
def emulation(platforms, monkeypatch):
    """The rank's process after activate(): patches applied, reverted afterwards."""
    nvml = PerProcessNvml([(os.getpid() + 1, 40 * GiB), (os.getpid(), 3 * GiB)])
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    for var in ("NCCL_HOSTID", "NCCL_SOCKET_IFNAME", "VLLM_ALLREDUCE_USE_FLASHINFER"):
        monkeypatch.delenv(var, raising=False)
    vg._state.update(nvml=None)
    outcomes = vg.activate(CARD, 0)
    yield nvml, outcomes
    vg.deactivate()
    vg._state.update(nvml=None)
    for p in VIRTUAL:
        revert_patch(p)


