"""Registry entry virtual-gpus-device-name-nonnvml: vLLM's platform without NVML names the card too."""

from __future__ import annotations


from virtual_card import CARD, GiB, VIRTUAL, emulation  # noqa: F401  (fixtures)
from platform_fakes import GPUS, cuda, platforms  # noqa: F401  (shared fixtures)


def test_names_the_card_without_nvml(emulation, platforms, cuda):
    cuda.init(0)
    assert platforms.NonNvmlCudaPlatform.get_device_name() == CARD.name
