"""Virtual GPUs, the pure part: the spec, the names NVML would give, the capability a rank may
answer, the cards in place of the visible GPUs, and the hand-off round trip."""

from __future__ import annotations

import pytest

from vllm_dualgpu.engine import handoff
from vllm_dualgpu.nvml import VisibleGpu
from vllm_dualgpu.planner.errors import BadRequest
from vllm_dualgpu.virtual_gpus import (ENV, VirtualCard, nvml_name, parse, ptx_compile_warning, runnable_capability,
                                      substitute)

GiB = 1024**3
H200 = VisibleGpu(3, "NVIDIA H200", 143771 * 2**20, 139 * GiB, (9, 0), 4800.0, "GPU-h200")


def test_names_as_nvml_gives_them():
    assert nvml_name("RTX 4070 Ti SUPER") == "NVIDIA GeForce RTX 4070 Ti SUPER"
    assert nvml_name("RTX 5090") == "NVIDIA GeForce RTX 5090"
    assert nvml_name("H200") == "NVIDIA H200"
    assert nvml_name("NVIDIA  H200") == "NVIDIA H200"
    assert nvml_name("RTX PRO 6000 Blackwell") == "NVIDIA RTX PRO 6000 Blackwell"


def test_capability_only_where_the_gpu_runs_its_kernels():
    assert runnable_capability((8, 9), (9, 0)) == (8, 9)
    assert runnable_capability((12, 0), (9, 0)) == (9, 0)
    assert runnable_capability(None, (9, 0)) == (9, 0)
    assert runnable_capability((9, 0), (9, 0)) == (9, 0)


def test_cards_on_the_first_visible_gpu():
    gpus, cards = substitute([H200], "RTX 4070 Ti SUPER:16GiB,RTX 5090:32GiB:30GiB")
    assert [g.name for g in gpus] == ["NVIDIA GeForce RTX 4070 Ti SUPER", "NVIDIA GeForce RTX 5090"]
    assert [g.physical_id for g in gpus] == [3, 3]
    assert [g.total_bytes for g in gpus] == [16 * GiB, 32 * GiB]
    assert [g.free_bytes for g in gpus] == [16 * GiB, 30 * GiB]
    assert [g.capability for g in gpus] == [(8, 9), (12, 0)]  # the planner sees the real cards
    assert len({g.uuid for g in gpus}) == 2 and not any(g.nvlink for g in gpus)
    assert [c.reported_capability for c in cards] == [(8, 9), (9, 0)]  # a 5090's kernels cannot run
    assert all(c.physical_id == 3 and c.physical_total_bytes == H200.total_bytes for c in cards)


def test_unset_leaves_the_gpus_alone():
    assert substitute([H200], None) == ([H200], None)
    assert substitute([H200], "  ") == ([H200], None)


@pytest.mark.parametrize("spec,words", [
    ("RTX 4070 Ti SUPER:16GiB", "names one card"),
    ("H200:100GiB,H200:100GiB", "need 200.0 GiB free together"),
    ("RTX 4070 Ti SUPER:16GiB,:8GiB", "no name"),
    ("Mystery Card,RTX 5090", "unknown GPU"),
])
def test_bad_specs_say_what_to_write(spec, words):
    with pytest.raises(BadRequest) as e:
        parse(spec, 0, "NVIDIA H200", H200.total_bytes, H200.free_bytes, (9, 0))
    assert ENV in str(e.value) and words in str(e.value)


def test_no_gpu_to_put_them_on():
    with pytest.raises(BadRequest, match="no GPU"):
        substitute([], "RTX 4070 Ti SUPER:16GiB,H200:32GiB")


def test_the_card_travels_in_the_hand_off():
    _, cards = substitute([H200], "RTX 4070 Ti SUPER:16GiB,H200:32GiB")
    ranks = tuple(handoff.RankRecord(rank=i, physical_gpu_id=3, gpu_name=c.name, reserve_bytes=GiB,
                                     cap_bytes=None, num_layers=20, predicted_non_kv_bytes=GiB,
                                     virtual_card=c) for i, c in enumerate(cards))
    record = handoff.Handoff(ranks, (20, 20), "plan")
    back = handoff.Handoff.from_dict(record.to_dict())
    assert back == record
    assert isinstance(back.rank(0).virtual_card, VirtualCard)
    assert back.rank(1).virtual_card.reported_capability == (9, 0)
    plain = handoff.RankRecord(rank=0, physical_gpu_id=0, gpu_name="x", reserve_bytes=0, cap_bytes=None,
                               num_layers=1, predicted_non_kv_bytes=None)
    assert handoff.RankRecord.from_dict(handoff.Handoff((plain,), None, "even").to_dict()["ranks"][0]) == plain


def test_a_rank_presenting_an_older_major_says_its_attention_kernels_compile_on_first_use():
    """vLLM 0.33's FlashAttention 2 ships sm_80 code only: on the H200 (9.0) a rank presenting 8.9
    has every FA2 kernel compiled from PTX on first launch (2026-12-02: each first request waited)."""
    _, cards = substitute([H200], "RTX 4070 Ti SUPER:16GiB,H200:32GiB")
    assert [c.physical_capability for c in cards] == [(9, 0), (9, 0)]
    line = ptx_compile_warning(cards, "auto", None)
    assert line.startswith(f"{ENV}: rank 0 (8.9) present SM 8.x on GPU 3 (NVIDIA H200, 9.0)")
    assert "FlashAttention 2 for its attention (a 16-bit KV cache)" in line
    assert "--attention-backend TRITON_ATTN avoids it" in line and "mm-encoder" not in line
    assert ptx_compile_warning(cards, "bfloat16", None) is not None
    assert ptx_compile_warning(cards, "fp8", None) is None  # FlashInfer there, not FA2
    assert ptx_compile_warning(cards, "fp8_e4m3", None) is None
    assert ptx_compile_warning(cards, "auto", "TRITON_ATTN") is None  # the user chose
    assert ptx_compile_warning(cards, "auto", None, model_dtype="torch.float32") is None  # Triton then
    assert ptx_compile_warning(cards, "auto", None, use_mla=True) is None
    # a vision encoder runs FA2 on 8.x whatever the decoder's backend, unless its own is chosen
    vit = ptx_compile_warning(cards, "fp8", None, multimodal=True)
    assert "FlashAttention 2 for its vision encoder" in vit and "--mm-encoder-attn-backend TORCH_SDPA" in vit
    assert ptx_compile_warning(cards, "fp8", None, multimodal=True, mm_backend="TORCH_SDPA") is None
    both = ptx_compile_warning(cards, "auto", None, multimodal=True)
    assert "its attention (a 16-bit KV cache) and its vision encoder" in both
    _, same = substitute([H200], "H200:16GiB,H200:32GiB")
    assert ptx_compile_warning(same, "auto", None) is None
    _, turing = substitute([H200], "RTX 4070 Ti SUPER:16GiB:cc=7.5,H200:32GiB")  # below FA2's 8.0
    assert ptx_compile_warning(turing, "auto", None) is None
    back = VirtualCard.from_dict(cards[0].to_dict())
    assert back == cards[0] and back.physical_capability == (9, 0)
