"""Registry entry virtual-gpus-device-name: a rank on a virtual card names the card (vLLM's NVML platform); the
emulation is applied only where a hand-off carries a card, with its own NCCL host id per rank,
and a virtual patch that does not apply refuses the run."""

from __future__ import annotations

import dataclasses
import os

import pytest

from vllm_dualgpu import plugin
from vllm_dualgpu.engine import virtual_card as vg
from vllm_dualgpu.patching import registry
from vllm_dualgpu.patching.core import APPLIED, revert_patch
from vllm_dualgpu.process import DEVICE, ENGINE, FRONTEND, WORKER
from virtual_card_fakes import CARD, GiB, VIRTUAL, emulation  # noqa: F401  (fixtures)
from platform_fakes import GPUS, cuda, platforms  # noqa: F401  (shared fixtures)


def test_no_process_applies_them_unless_asked():
    assert VIRTUAL and all(p.processes == (WORKER,) and p.name.startswith("virtual-gpus-") for p in VIRTUAL)
    for kinds in ({FRONTEND}, {ENGINE}, {WORKER}, {DEVICE}, {FRONTEND, ENGINE}):
        chosen = plugin.select_patches(frozenset(kinds), True)
        assert not [p.name for p in chosen if p.when], kinds


def test_a_rank_names_its_card(emulation, platforms, cuda):
    _, outcomes = emulation
    assert sorted(o.patch.name for o in outcomes if o.status == APPLIED) == sorted(p.name for p in VIRTUAL)
    cls = platforms.NvmlCudaPlatform
    cuda.init(0)  # the physical GPU answers as GPUS[0] in the fakes
    assert cls.get_device_name() == CARD.name and cls.get_device_name(1) == CARD.name
    vg.deactivate()  # a process without a card: vLLM's answer again
    assert cls.get_device_name(0) == GPUS[0][0]


def test_each_rank_has_a_nccl_host_id_of_its_own(emulation):
    first = os.environ["NCCL_HOSTID"]
    assert first.endswith("-dualgpu-virtual-0") and os.environ["NCCL_SOCKET_IFNAME"] == "lo"
    vg.activate(dataclasses.replace(CARD, name="NVIDIA H200", total_bytes=32 * GiB), 1)
    assert os.environ["NCCL_HOSTID"] != first and os.environ["NCCL_HOSTID"].endswith("-virtual-1")


def test_tp_ranks_on_one_gpu_reduce_through_nccl(emulation, monkeypatch):
    """vLLM's FlashInfer all-reduce (on by default for TP groups) is for distinct GPUs of one
    host: on the one physical GPU it was seen JIT-building trtllm_comm for minutes. Off in an
    emulated rank, unless the user set it; custom all-reduce is off through the plan."""
    from vllm import envs

    assert os.environ["VLLM_ALLREDUCE_USE_FLASHINFER"] == "0" and envs.VLLM_ALLREDUCE_USE_FLASHINFER is False
    monkeypatch.setenv("VLLM_ALLREDUCE_USE_FLASHINFER", "1")
    vg.activate(CARD, 0)
    assert envs.VLLM_ALLREDUCE_USE_FLASHINFER is True


def test_a_virtual_patch_that_does_not_apply_refuses_the_run(platforms, monkeypatch):
    broken = [dataclasses.replace(p, params=("nope",)) if p.name == "virtual-gpus-device-name" else p
              for p in registry.PATCHES]
    monkeypatch.setattr(registry, "PATCHES", tuple(broken))
    try:
        with pytest.raises(plugin.StartupRefused, match="virtual-GPU patch virtual-gpus-device-name"):
            plugin.ensure_virtual_gpus()
    finally:
        for p in VIRTUAL:
            revert_patch(p)
