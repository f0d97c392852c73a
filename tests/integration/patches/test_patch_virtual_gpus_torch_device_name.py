"""Registry entry virtual-gpus-torch-device-name: torch.cuda.get_device_name answers the card's name on a virtual
card, the GPU's elsewhere."""

from __future__ import annotations

import torch

from vllm_dualgpu.patches import virtual_gpus as vg
from virtual_card import CARD, GiB, VIRTUAL, emulation  # noqa: F401  (fixtures)
from platform_fakes import GPUS, cuda, platforms  # noqa: F401  (shared fixtures)


def test_torch_names_the_card(emulation, cuda):
    cuda.init(0)
    assert torch.cuda.get_device_name(0) == CARD.name and torch.cuda.get_device_name() == CARD.name
    vg.deactivate()
    assert torch.cuda.get_device_name(0) == GPUS[0][0]
