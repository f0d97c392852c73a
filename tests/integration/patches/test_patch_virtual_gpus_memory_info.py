"""Registry entry virtual-gpus-memory-info: torch.accelerator.get_memory_info (vLLM's memory snapshot) counts
this process's own use of the GPU against the card, not the whole GPU."""

from __future__ import annotations

import os

import torch
from virtual_card import CARD, GiB, VIRTUAL, emulation  # noqa: F401  (fixtures)
from platform_fakes import GPUS, cuda, platforms  # noqa: F401  (shared fixtures)


def test_snapshot_counts_this_process_only(emulation):
    nvml, _ = emulation
    # 15 GiB free on the card before the run, 3 GiB held by this process; another process's
    # 40 GiB on the same GPU does not count
    assert torch.accelerator.get_memory_info(0) == (12 * GiB, 16 * GiB)
    assert torch.accelerator.get_memory_info() == (12 * GiB, 16 * GiB)
    assert nvml.handles == [2]  # the physical GPU's handle, asked once
    nvml.procs = [(os.getpid() + 1, 40 * GiB)]  # no CUDA context in this process yet
    assert torch.accelerator.get_memory_info() == (15 * GiB, 16 * GiB)
