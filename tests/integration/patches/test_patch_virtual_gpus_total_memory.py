"""Registry entry virtual-gpus-total-memory: vLLM's platform reports the card's total memory."""

from __future__ import annotations


from virtual_card import CARD, GiB, VIRTUAL, emulation  # noqa: F401  (fixtures)
from platform_fakes import GPUS, cuda, platforms  # noqa: F401  (shared fixtures)


def test_total_memory_is_the_cards(emulation, platforms, cuda):
    cuda.init(0)
    assert platforms.NvmlCudaPlatform.get_device_total_memory() == 16 * GiB
