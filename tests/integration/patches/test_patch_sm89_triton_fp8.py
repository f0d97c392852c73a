"""SM89 ranks put vLLM's Triton block-FP8 kernel ahead of Marlin; other ranks keep vLLM's order."""

from __future__ import annotations

import logging

import pytest
import torch

from vllm_dualgpu import rank_summary
from vllm_dualgpu.kernels import fp8_preference as pref

CAPS = {"RTX 4070 Ti SUPER": (8, 9), "RTX 5090": (12, 0), "RTX A5000": (8, 6), "H200": (9, 0)}


@pytest.fixture(autouse=True)
def clean_state():
    pref.reset_for_tests()
    rank_summary.clear()
    yield
    pref.reset_for_tests()
    rank_summary.clear()


@pytest.fixture
def gpus(monkeypatch):
    class Gpus:
        names = ["RTX 4070 Ti SUPER", "RTX 5090"]
        current = 0
        initialized = True

        def cap(self, i=None):
            return CAPS[self.names[self.current if i is None else i]]

        presented = None  # what vLLM's platform answers instead of the physical card (virtual pair)

        def platform_cap(self, i=None):
            return CAPS[self.presented] if self.presented else self.cap(i)

    g = Gpus()
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: g.initialized)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: g.current)
    monkeypatch.setattr(torch.cuda, "get_device_capability", g.cap)
    from vllm.platforms import current_platform
    from vllm.platforms.interface import DeviceCapability

    monkeypatch.setattr(type(current_platform), "get_device_capability",
                        classmethod(lambda cls, device_id=0: DeviceCapability(*g.platform_cap(device_id))))
    monkeypatch.delenv(pref.ENV, raising=False)
    return g


def names(kernels):
    return [k.__name__ for k in kernels]


def test_triton_moves_just_ahead_of_marlin_in_vllms_list():
    import vllm.model_executor.kernels.linear as L

    cuda = L._POSSIBLE_FP8_BLOCK_KERNELS[L.PlatformEnum.CUDA]
    before = names(cuda)
    assert before.index(pref.MARLIN) < before.index(pref.TRITON), "vLLM changed its order"
    after = names(pref.triton_first(cuda))
    assert after.index(pref.TRITON) == before.index(pref.MARLIN)
    assert after.index(pref.MARLIN) == after.index(pref.TRITON) + 1
    # Everything else keeps its relative order; nothing is lost or added.
    assert [n for n in after if n != pref.TRITON] == [n for n in before if n != pref.TRITON]
    assert sorted(after) == sorted(before)
    assert names(cuda) == before  # the module's list is not modified
    again = pref.triton_first(pref.triton_first(cuda))
    assert names(again) == after


def test_lists_without_both_kernels_are_returned_as_is():
    import vllm.model_executor.kernels.linear as L

    for key, kernels in L._POSSIBLE_FP8_BLOCK_KERNELS.items():
        if key != L.PlatformEnum.CUDA:
            assert pref.triton_first(kernels) is kernels
    non_block = L._POSSIBLE_FP8_KERNELS[L.PlatformEnum.CUDA]
    assert pref.triton_first(non_block) is non_block


def test_decision_follows_the_current_device(gpus):
    assert pref.prefer_triton_here()
    gpus.current = 1
    assert not pref.prefer_triton_here()
    gpus.names = ["H200", "RTX A5000"]
    assert not pref.prefer_triton_here()
    gpus.current = 0
    assert not pref.prefer_triton_here()
    gpus.initialized = False
    gpus.names = ["RTX 4070 Ti SUPER"]
    assert not pref.prefer_triton_here()  # before init_device: no decision, vLLM's order


def test_decision_follows_vllms_platform_not_torch(gpus):
    """vLLM's kernel checks ask ``current_platform.get_device_capability()``; so does the
    preference. Seen on the virtual pair (vLLM 0.33.0, 2026-12-03): rank 0 presented SM 8.9
    through vLLM's platform while torch answered the H200's 9.0, and Marlin was selected."""
    gpus.names = ["H200"]
    gpus.presented = "RTX 4070 Ti SUPER"
    assert pref.prefer_triton_here()
    gpus.names = ["RTX 4070 Ti SUPER"]
    gpus.presented = "H200"
    assert not pref.prefer_triton_here()


@pytest.mark.parametrize("value,expected", [("0", False), ("false", False), ("off", False), ("no", False),
                                            ("1", True), ("", True), ("yes", True)])
def test_env_switch(gpus, monkeypatch, value, expected):
    monkeypatch.setenv(pref.ENV, value)
    assert pref.prefer_triton_here() is expected


def test_explicit_capability_from_the_caller_wins(gpus):
    gpus.current = 1  # SM120 device current
    assert pref.prefer_triton_here(compute_capability=89)
    gpus.current = 0
    assert not pref.prefer_triton_here(compute_capability=120)


# ---- through vLLM's real selector ------------------------------------------------------------


@pytest.fixture
def sm_aware_vllm(monkeypatch, gpus):
    """vLLM's linear-kernel module on a pretend CUDA platform whose kernels are supported as on
    real cards: DeepGEMM/CUTLASS need SM90+, B12x SM120, Triton FP8 SM89+, Marlin SM75+."""
    import vllm
    import vllm.model_executor.kernels.linear as L

    from vllm_dualgpu.patching.core import APPLIED, apply_patch, revert_patch
    from vllm_dualgpu.patching.registry import PATCHES

    hopper_blackwell = {(9, 0), (10, 0)}
    need = {"FlashInferFp8DeepGEMMDynamicBlockScaledKernel": hopper_blackwell.__contains__,
            "DeepGemmFp8BlockScaledMMKernel": hopper_blackwell.__contains__,
            "CutlassFp8BlockScaledMMKernel": hopper_blackwell.__contains__,
            "B12xFp8BlockScaledMMKernel": lambda c: c[0] == 12,
            "MarlinFP8ScaledMMLinearKernel": lambda c: c >= (7, 5),
            "TritonFp8BlockScaledMMKernel": lambda c: c >= (8, 9),
            "BlockWiseTorchFP8ScaledMMLinearKernel": lambda c: c >= (8, 9)}
    seen = []

    def supported(kernel, config, compute_capability):
        seen.append(kernel.__name__)
        ok = need.get(kernel.__name__, lambda c: False)(gpus.platform_cap())  # as vLLM's checks ask
        return ok, "" if ok else f"{kernel.__name__} is not supported here"

    monkeypatch.setattr(type(L.current_platform), "_enum", L.PlatformEnum.CUDA)
    monkeypatch.setattr(L, "is_supported_and_can_implement_kernel", supported)
    p = next(p for p in PATCHES if p.name == "sm89-triton-fp8")
    out = apply_patch(p, vllm.__version__)
    assert out.status == APPLIED, out.reason
    yield L, seen
    assert revert_patch(p)


def choose(L, kernels):
    return L.choose_scaled_mm_linear_kernel(object(), kernels, quantization="fp8_block_w8a8").__name__


def test_sm89_rank_gets_triton_other_ranks_keep_vllms_choice(sm_aware_vllm, gpus, caplog):
    L, _ = sm_aware_vllm
    block = L._POSSIBLE_FP8_BLOCK_KERNELS
    order = names(block[L.PlatformEnum.CUDA])
    with caplog.at_level(logging.INFO, logger="vllm.dualgpu"):
        assert choose(L, block) == pref.TRITON  # rank 0: RTX 4070 Ti SUPER
        assert choose(L, block) == pref.TRITON
    gpus.current = 1
    assert choose(L, block) == "B12xFp8BlockScaledMMKernel"  # rank 1: RTX 5090, vLLM's pick
    gpus.names = ["H200", "RTX A5000"]
    gpus.current = 0
    assert choose(L, block) == "FlashInferFp8DeepGEMMDynamicBlockScaledKernel"
    gpus.current = 1
    assert choose(L, block) == pref.MARLIN  # SM86: Triton FP8 unsupported, Marlin as in vLLM
    assert names(block[L.PlatformEnum.CUDA]) == order  # vLLM's dict was never modified
    logs = [r.getMessage() for r in caplog.records if "SM89" in r.getMessage()]
    assert len(logs) == 1 and pref.ENV in logs[0]
    assert "Triton ahead of Marlin" in rank_summary.facts()[pref.SUMMARY_KEY]


def test_env_zero_keeps_marlin_on_sm89(sm_aware_vllm, monkeypatch):
    L, _ = sm_aware_vllm
    monkeypatch.setenv(pref.ENV, "0")
    assert choose(L, L._POSSIBLE_FP8_BLOCK_KERNELS) == pref.MARLIN
    assert pref.SUMMARY_KEY not in rank_summary.facts()


def test_other_kernel_lists_pass_through(sm_aware_vllm):
    L, seen = sm_aware_vllm
    # A copy of the block list is not vLLM's list: untouched (Marlin, as vLLM would pick).
    copy = {k: list(v) for k, v in L._POSSIBLE_FP8_BLOCK_KERNELS.items()}
    assert choose(L, copy) == pref.MARLIN
    seen.clear()
    L.choose_scaled_mm_linear_kernel(object(), L._POSSIBLE_FP8_KERNELS, quantization="fp8_w8a8")
    assert seen == names(L._POSSIBLE_FP8_KERNELS[L.PlatformEnum.CUDA])[: len(seen)]


def test_disabled_kernels_still_apply(sm_aware_vllm, monkeypatch):
    """VLLM_DISABLED_KERNELS is checked inside vLLM's loop, after the reordering."""
    L, _ = sm_aware_vllm
    real = L.is_supported_and_can_implement_kernel

    def with_disabled(kernel, config, cc):
        if kernel.__name__ == pref.TRITON:
            return False, "disabled"
        return real(kernel, config, cc)

    monkeypatch.setattr(L, "is_supported_and_can_implement_kernel", with_disabled)
    assert choose(L, L._POSSIBLE_FP8_BLOCK_KERNELS) == pref.MARLIN


def test_init_fp8_linear_kernel_copies_see_the_preference(sm_aware_vllm, monkeypatch, gpus):
    """Quantization modules hold `from ... import init_fp8_linear_kernel` copies; they call
    vLLM's selector as a module global, so no rebinding is needed."""
    L, _ = sm_aware_vllm
    from vllm.model_executor.layers.quantization import fp8 as fp8_method
    from vllm.model_executor.layers.quantization.utils.quant_utils import (
        kFp8Dynamic128Sym,
        kFp8Static128BlockSym,
    )

    assert fp8_method.init_fp8_linear_kernel is L.init_fp8_linear_kernel
    for cls in (L.TritonFp8BlockScaledMMKernel, L.MarlinFP8ScaledMMLinearKernel,
                L.B12xFp8BlockScaledMMKernel):
        monkeypatch.setattr(cls, "__init__", lambda self, *a, **k: None)

    def build():
        return type(fp8_method.init_fp8_linear_kernel(
            activation_quant_key=kFp8Dynamic128Sym, weight_quant_key=kFp8Static128BlockSym,
            input_dtype=torch.bfloat16, out_dtype=torch.bfloat16, weight_shape=(256, 512),
        )).__name__

    assert build() == pref.TRITON
    gpus.current = 1
    assert build() == "B12xFp8BlockScaledMMKernel"


def test_non_sm89_rank_where_marlin_and_triton_both_run_keeps_marlin(sm_aware_vllm, monkeypatch, gpus):
    """SM120 with B12x off: both Marlin and Triton are supported; vLLM's order (Marlin) stays."""
    L, _ = sm_aware_vllm
    gpus.current = 1  # RTX 5090
    real = L.is_supported_and_can_implement_kernel

    def without_b12x(kernel, config, cc):
        if kernel.__name__ == "B12xFp8BlockScaledMMKernel":
            return False, "disabled"
        return real(kernel, config, cc)

    monkeypatch.setattr(L, "is_supported_and_can_implement_kernel", without_b12x)
    assert choose(L, L._POSSIBLE_FP8_BLOCK_KERNELS) == pref.MARLIN
    gpus.current = 0  # the SM89 rank in the same process state
    assert choose(L, L._POSSIBLE_FP8_BLOCK_KERNELS) == pref.TRITON


def test_a_rank_presenting_sm89_on_another_gpu_gets_triton(sm_aware_vllm, gpus):
    """The virtual pair: the physical GPU is an H200 (torch: 9.0), vLLM's platform presents the
    rank's RTX 4070 Ti SUPER (8.9); vLLM's checks refuse the SM90 kernels, the preference moves
    Triton ahead of Marlin."""
    L, _ = sm_aware_vllm
    gpus.names = ["H200"]
    gpus.presented = "RTX 4070 Ti SUPER"
    assert choose(L, L._POSSIBLE_FP8_BLOCK_KERNELS) == pref.TRITON
    gpus.presented = None  # the H200 as itself: vLLM's pick
    assert choose(L, L._POSSIBLE_FP8_BLOCK_KERNELS) == "FlashInferFp8DeepGEMMDynamicBlockScaledKernel"


def test_each_rank_names_the_block_fp8_kernel_it_selected(sm_aware_vllm, gpus):
    """vLLM logs its "Selected ..." line once for the whole run (info_once, scope global): on the
    virtual pair (vLLM 0.33.0, 2026-12-04) only Worker_PP0 said which block-FP8 kernel it took,
    and rank 1's choice was nowhere. Each rank's summary line names its own."""
    from vllm_dualgpu.patches import linear_kernels

    L, _ = sm_aware_vllm
    gpus.names = ["RTX 4070 Ti SUPER", "H200"]
    choose(L, L._POSSIBLE_FP8_BLOCK_KERNELS)
    choose(L, L._POSSIBLE_FP8_BLOCK_KERNELS)
    assert rank_summary.facts()[linear_kernels.BLOCK_KERNEL_KEY] == pref.TRITON
    rank_summary.clear()  # the other rank: another process
    gpus.current = 1
    choose(L, L._POSSIBLE_FP8_BLOCK_KERNELS)
    assert rank_summary.facts()[linear_kernels.BLOCK_KERNEL_KEY] == "FlashInferFp8DeepGEMMDynamicBlockScaledKernel"
    choose(L, L._POSSIBLE_FP8_KERNELS)  # a per-tensor FP8 layer: not a block-FP8 choice
    assert rank_summary.facts()[linear_kernels.BLOCK_KERNEL_KEY] == "FlashInferFp8DeepGEMMDynamicBlockScaledKernel"
