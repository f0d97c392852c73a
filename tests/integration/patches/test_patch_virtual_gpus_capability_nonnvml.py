"""Registry entry virtual-gpus-capability-nonnvml: without NVML the card's capability too."""

from __future__ import annotations


from virtual_card import CARD, GiB, VIRTUAL, emulation  # noqa: F401  (fixtures)
from platform_fakes import GPUS, cuda, platforms  # noqa: F401  (shared fixtures)


def test_answers_the_cards_capability_without_nvml(emulation, platforms, cuda):
    cuda.init(0)
    assert tuple(platforms.NonNvmlCudaPlatform.get_device_capability()) == (8, 9)
