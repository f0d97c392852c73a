"""Registry entry virtual-gpus-capability: the card's capability in vLLM's own DeviceCapability type, where the
physical GPU runs that capability's kernels (VirtualCard.reported_capability)."""

from __future__ import annotations

import dataclasses

from vllm_dualgpu.patches import virtual_gpus as vg
from virtual_card import CARD, GiB, VIRTUAL, emulation  # noqa: F401  (fixtures)
from platform_fakes import GPUS, cuda, platforms  # noqa: F401  (shared fixtures)


def test_answers_the_cards_capability(emulation, platforms, cuda):
    cls = platforms.NvmlCudaPlatform
    cuda.init(0)  # the physical GPU is a 12.0 card in the fakes
    cap = cls.get_device_capability()
    assert (cap.major, cap.minor) == (8, 9) and type(cap).__name__ == "DeviceCapability"
    assert cls.has_device_capability(89) and not cls.has_device_capability(90)
    vg.activate(dataclasses.replace(CARD, reported_capability=(9, 0)), 0)
    assert tuple(cls.get_device_capability()) == (9, 0)
    vg.deactivate()
    assert tuple(cls.get_device_capability()) == GPUS[0][1]
