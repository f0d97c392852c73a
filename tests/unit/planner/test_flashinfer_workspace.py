"""FlashInfer's workspace: what vLLM allocates, and the size a dualgpu run sets where the user did not.

Expected values are worked by hand from the sources, not by the code under test:
- vLLM 0.30-0.34 ``FlashInferMetadataBuilder._get_workspace_buffer``: max(the configured size,
  max_num_batched_tokens x query heads x head size x 16);
- FlashInfer 0.7 ``PrefillPlanImpl`` (include/flashinfer/attention/scheduler.cuh): a split-KV plan
  holds ``num_qo_heads x max_partial_rows x (head_dim + 1)`` floats, max_partial_rows =
  padded_batch_size x cta_tile_q / GQA group, padded_batch_size <= 2 x SMs / kv heads.
"""

from __future__ import annotations

from vllm_dualgpu import planner as P
from vllm_dualgpu.planner.memory import (
    MemoryModel,
    flashinfer_partials_bytes,
    plugin_flashinfer_workspace,
    runtime_reserve,
)

MIB = 1 << 20
REF = P.ModelSpec.from_hf_config(P.reference_config())  # 24 query heads, 4 KV heads, head size 256


def test_the_reference_shape_by_hand():
    # 192 SMs: 2 x 192 / 4 = 96 work items x 128 packed rows / GQA group 6 = 2,048 rows;
    # 24 heads x 2,048 rows x 257 floats x 4 bytes = 50,528,256 bytes
    assert flashinfer_partials_bytes(REF, max_num_seqs=2, capture_tokens=32) == 50_528_256
    # twice that, 101,056,512 bytes = 96.4 MiB, rounded up to a MiB
    assert plugin_flashinfer_workspace(REF, max_num_seqs=2, capture_tokens=32) == 97 * MIB


def test_a_card_with_fewer_sms_needs_less():
    # an RTX 5090 (170 SMs): 85 items x 128 / 6 = 1,814 rows (rounded up); 24 x 1,814 x 257 x 4
    # = 44,755,008 bytes
    assert flashinfer_partials_bytes(REF, max_num_seqs=2, capture_tokens=32, sms=170) == 44_755_008


def test_a_wide_gqa_group_is_bounded_by_the_decode_plan():
    """64 query heads on 2 KV heads (a GQA group of 32), head size 128, 192 SMs: the prefill split
    holds 192 items x 128 rows / 32 = 768 rows; the decode plan up to 16 x 192 / 2 = 1,536 items of
    one row a head: 64 x 1,536 x 129 floats x 4 bytes = 50,724,864 bytes."""
    cfg = P.reference_config()
    wide = P.ModelSpec.from_hf_config({**cfg, "text_config": {**cfg["text_config"], "num_attention_heads": 64,
                                                              "num_key_value_heads": 2, "head_dim": 128}})
    assert (wide.num_attention_heads, wide.num_kv_heads, wide.head_dim) == (64, 2, 128)
    assert flashinfer_partials_bytes(wide, max_num_seqs=2, capture_tokens=32) == 50_724_864


def _reserve(tokens: int, mm: MemoryModel) -> int:
    return runtime_reserve(REF, first=False, last=True, max_num_batched_tokens=tokens, max_num_seqs=2,
                           enforce_eager=False, vision=False, mm=mm, decode_query_len=4,
                           flashinfer=True)["flashinfer_workspace"]


def test_vllm_grows_the_buffer_to_its_estimate_for_the_batch():
    """8,192 batched tokens (vLLM's LLM() default on a 32 GiB card): vLLM allocates
    8,192 x 24 x 256 x 16 = 805,306,368 bytes (768 MiB) whatever the configured size."""
    for mm in (MemoryModel(), MemoryModel(flashinfer_workspace_bytes=128 * MIB),
               MemoryModel(flashinfer_workspace_sized=True)):
        assert _reserve(8192, mm) == 805_306_368


def test_below_the_estimate_the_configured_size_holds():
    # 1,024 tokens: vLLM's estimate is 96 MiB
    assert _reserve(1024, MemoryModel()) == 394 * MIB
    assert _reserve(1024, MemoryModel(flashinfer_workspace_bytes=128 * MIB)) == 128 * MIB
    assert _reserve(1024, MemoryModel(flashinfer_workspace_sized=True)) == 97 * MIB


def test_never_above_vllms_default():
    cfg = P.reference_config()
    wide = P.ModelSpec.from_hf_config({**cfg, "text_config": {**cfg["text_config"], "head_dim": 2048}})
    assert wide.head_dim == 2048
    assert plugin_flashinfer_workspace(wide, max_num_seqs=2, capture_tokens=32) == 394 * MIB
