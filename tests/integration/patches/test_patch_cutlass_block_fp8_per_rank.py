"""Each rank asks whether CUTLASS block FP8 runs on its own card, not on the card that was
device 0 when vLLM's worker imported its kernel modules.

vLLM computes ``w8a8_utils.CUTLASS_BLOCK_FP8_SUPPORTED`` once, at import, and
``CutlassFp8BlockScaledMMKernel.is_supported`` reads that copy. A worker imports the module with
its worker class, before it sets its device, so on a mixed pair every rank gets device 0's
answer: an RTX 4070 Ti SUPER rank behind an RTX 5090 selected CUTLASS block FP8, which its SM 8.9
cannot run (seen on the virtual pair: "Selected CutlassFp8BlockScaledMMKernel for Fp8LinearMethod"
on the rank presenting 8.9), and an RTX 5090 behind an RTX 4070 Ti SUPER lost it.
"""

from __future__ import annotations

import pytest

CAPS = {"NVIDIA GeForce RTX 4070 Ti SUPER": (8, 9), "NVIDIA GeForce RTX 5090": (12, 0), "NVIDIA H200": (9, 0),
        "NVIDIA RTX A5000": (8, 6)}
FAMILY = "cutlass-block-fp8-per-rank"


@pytest.fixture
def cards(monkeypatch):
    """vLLM's CUTLASS kernel module on a pretend CUDA platform that answers the current card's
    capability (what capability-per-rank gives once CUDA is up), with vLLM's compiled support
    check as vLLM issue #58241 bisected it on a GPU: 80, 86, 89 False; 90, 100 True."""
    from vllm.model_executor.kernels.linear.scaled_mm import cutlass
    from vllm.model_executor.layers.quantization.utils import w8a8_utils
    from vllm.platforms import PlatformEnum
    from vllm.platforms.interface import DeviceCapability

    class Cards:
        names = ["NVIDIA GeForce RTX 5090", "NVIDIA GeForce RTX 4070 Ti SUPER"]
        current = 0

        def import_worker_modules(self):
            """vLLM's import-time constant, as a worker computes it before it sets its device."""
            self.current = 0
            monkeypatch.setattr(cutlass, "CUTLASS_BLOCK_FP8_SUPPORTED", w8a8_utils.cutlass_block_fp8_supported())

    c = Cards()
    platform = type(w8a8_utils.current_platform)
    monkeypatch.setattr(platform, "_enum", PlatformEnum.CUDA)
    monkeypatch.setattr(platform, "get_device_capability",
                        classmethod(lambda cls, device_id=0: DeviceCapability(*CAPS[c.names[c.current]])))
    monkeypatch.setattr(w8a8_utils.ops, "cutlass_scaled_mm_supports_block_fp8", lambda cc: cc >= 90)
    return c


@pytest.fixture(autouse=True)
def clean_summary():
    from vllm_dualgpu import rank_summary

    rank_summary.clear()
    yield
    rank_summary.clear()


def summary() -> str | None:
    from vllm_dualgpu import rank_summary

    return rank_summary.facts().get("cutlass-block-fp8")


@pytest.fixture
def patched():
    import vllm

    from vllm_dualgpu.patching.core import ALREADY, APPLIED, apply_patch, revert_patch
    from vllm_dualgpu.patching.registry import for_version

    p = for_version(FAMILY, vllm.__version__)  # the entry pinned to this release's source
    assert p is not None, f"no {FAMILY} entry for vLLM {vllm.__version__}"
    out = apply_patch(p, vllm.__version__)
    assert out.status == APPLIED, out.reason
    again = apply_patch(p, vllm.__version__)
    assert again.status == ALREADY, again.reason  # idempotent
    yield p
    assert revert_patch(p)


def kernel():
    from vllm.model_executor.kernels.linear.scaled_mm.cutlass import CutlassFp8BlockScaledMMKernel

    return CutlassFp8BlockScaledMMKernel


def test_sm89_rank_behind_a_blackwell_device_0_does_not_take_cutlass(cards, patched):
    cards.import_worker_modules()  # device 0: the RTX 5090, whose answer vLLM keeps
    cards.current = 1  # this rank's card: the RTX 4070 Ti SUPER
    ok, why = kernel().is_supported()
    assert ok is False
    assert "8.9" in why or "89" in why, why
    # the rank's summary line says its answer differs from the one vLLM computed at import
    assert summary() == "off on this rank (SM 8.9); vLLM's import-time answer (device 0's) was on"


def test_blackwell_rank_behind_an_sm89_device_0_keeps_cutlass(cards, patched):
    cards.names = ["NVIDIA GeForce RTX 4070 Ti SUPER", "NVIDIA GeForce RTX 5090"]
    cards.import_worker_modules()  # device 0: the RTX 4070 Ti SUPER (vLLM's constant: False)
    cards.current = 1
    assert kernel().is_supported() == (True, None)
    assert summary() == "on for this rank (SM 12.0); vLLM's import-time answer (device 0's) was off"


def test_same_cards_answer_as_vllm_does(cards, patched):
    """Where every card agrees with device 0 the patched answer is vLLM's own."""
    for names in (["NVIDIA H200", "NVIDIA H200"], ["NVIDIA RTX A5000", "NVIDIA GeForce RTX 4070 Ti SUPER"]):
        cards.names = names
        cards.import_worker_modules()
        from vllm.model_executor.kernels.linear.scaled_mm import cutlass

        for cards.current in (0, 1):
            assert kernel().is_supported()[0] is cutlass.CUTLASS_BLOCK_FP8_SUPPORTED, names
    assert summary() is None  # nothing to say where the answers agree


def test_unpatched_vllm_answers_for_device_0(cards):
    """What the patch is for: stock vLLM's answer on the second rank is device 0's."""
    cards.import_worker_modules()
    cards.current = 1
    assert kernel().is_supported() == (True, None)
