"""Registry entry virtual-gpus-mem-get-info: torch.cuda.mem_get_info counts this process only; it is never
negative, and says so when NVML cannot give the per-process figure; the torch cap
(hold_to_card) is the card's free memory less what the process holds outside torch."""

from __future__ import annotations

import os

import pytest
import torch

from vllm_dualgpu.patches import virtual_gpus as vg
from virtual_card import CARD, GiB, VIRTUAL, emulation  # noqa: F401  (fixtures)
from platform_fakes import GPUS, cuda, platforms  # noqa: F401  (shared fixtures)


def test_mem_get_info_counts_this_process_only(emulation):
    nvml, _ = emulation
    assert torch.cuda.mem_get_info(0) == (12 * GiB, 16 * GiB)
    nvml.procs = [(os.getpid(), 20 * GiB)]
    assert torch.cuda.mem_get_info()[0] == 0  # never negative
    nvml.procs = [(os.getpid(), None)]
    with pytest.raises(RuntimeError, match="per-process GPU memory"):
        torch.cuda.mem_get_info()


def test_held_to_the_card(emulation, monkeypatch):
    asked = []
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 2 * GiB)
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction",
                        lambda fraction, device=None: asked.append((fraction, device)))
    # 3 GiB held, 2 GiB of it torch's: 1 GiB outside torch, so torch may take 14 GiB
    assert vg.hold_to_card(0) == 14 * GiB
    assert asked == [(14 / 140, 0)]
