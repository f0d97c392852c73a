"""The pure mirror of the package's KV grouping (planner/kv_grouping.per_rank_grouping) and of a DFlash
drafter's sliding-window layers, on the Qwen3.8-27B-class reference (16 attention + 48 Gated
DeltaNet layers) with the DFlash2 stand-in drafter (5 sliding-window layers, window 4,096),
fp8 KV, prefix caching, 7 draft tokens. Expected values are worked out by hand from vLLM's
formulas (cited per test); the integration test tests/integration/engine/test_kv_pricing_dflash.py
checks the same layouts against vLLM's own functions."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vllm_dualgpu.planner import DrafterSpec, KVLayout, ModelSpec, UnsupportedModel, reference_config
from vllm_dualgpu.planner.kv_grouping import per_rank_grouping

DRAFTER = json.loads((Path(__file__).resolve().parents[2] / "fixtures" / "dflash2_drafter_standin.json").read_text())
GIB = 1 << 30


def layout(draft: dict = DRAFTER, in_flight: int = 2 * 1024) -> KVLayout:
    model = ModelSpec.from_hf_config(reference_config("qwen3.8-27b"))
    drafter = DrafterSpec.from_speculative(
        {"method": "dflash", "num_speculative_tokens": 7, "draft_config": draft}, model)
    return KVLayout.build(model, kv_cache_dtype="fp8", drafter=drafter, max_in_flight_tokens=in_flight)


def test_the_stand_in_drafter_is_sliding_window():
    lay = layout()
    [sw] = [g for g in lay.groups if g.window_tokens]
    assert len(sw.members) == 5
    # block 16 x cdiv(3,350,528, 16 x 2,048) = 1,648 tokens (the GDN state with 7 draft tokens);
    # SlidingWindowSpec.max_admission_blocks_per_request: cdiv(min(4,096 - 1 + 2 x 1,024, L), 1,648) + 1
    assert lay.block_size == 1648
    assert sw.blocks_per_request(262144) == 4 + 1
    assert sw.blocks_per_request(1000) == 1 + 1  # never more than the request itself
    # a full-attention group grows with the request: cdiv(262,144, 1,648) = 160 blocks
    full = [g for g in lay.groups if g.tokens_per_block and not g.window_tokens]
    assert all(g.blocks_per_request(262144) == 160 for g in full)


def test_without_its_window_the_drafter_attends_everything():
    draft = {k: v for k, v in DRAFTER.items() if k != "layer_types"}
    draft["dflash_config"] = {k: v for k, v in DRAFTER["dflash_config"].items() if k != "swa_window_size"}
    lay = layout(draft)
    assert not any(g.window_tokens for g in lay.groups)


def test_a_sliding_drafter_without_a_window_is_refused():
    draft = dict(DRAFTER, dflash_config={k: v for k, v in DRAFTER["dflash_config"].items() if k != "swa_window_size"})
    with pytest.raises(Exception, match="window size"):
        layout(draft)
    mixed = dict(DRAFTER, layer_types=["sliding_attention"] * 4 + ["full_attention"])
    with pytest.raises(UnsupportedModel, match="both sliding-window and full-attention"):
        layout(mixed)


def test_stock_grouping_cuts_every_bucket_to_the_drafters_five():
    # _get_kv_cache_groups_uniform_page_size: buckets 48 / 16 / 5, group size 5 (48 >= 1.5 x 5):
    # cdiv(48, 5) + cdiv(16, 5) + 1 = 10 + 4 + 1 groups
    assert len(layout().groups) == 15


def test_the_package_groups_by_layers_per_rank():
    """16/48 with 3 GiB of KV on rank 0 and 8 GiB on rank 1. Rank 0 holds 4 attention and 12
    GDN layers, rank 1 12 + 36 and the 5 drafter layers. Capping a group at 6 layers per rank
    gives 2 attention groups (12 / 6), 6 GDN groups (36 / 6) and 1 drafter group: 9 groups.
    A 262,144-token request then takes 2 x 160 + 6 x (2 + 7) + 5 = 379 blocks; a block costs
    rank 1 the pages of 6 layers (6 x 1,648 x 2,048 bytes), rank 0 those of 2."""
    stock = layout()
    lay = per_rank_grouping(stock, [16, 48], [3 * GIB, 8 * GIB], 262144)
    assert len(lay.groups) == 9
    assert sorted(len(g.members) for g in lay.groups) == [5] + [8] * 8
    assert lay.blocks_per_request(262144) == 2 * 160 + 6 * 9 + 5
    page = 1648 * 2048
    assert lay.bytes_per_block(16, 64, True) == 6 * page
    assert lay.bytes_per_block(0, 16, False) == 2 * page
    # what vLLM's stock grouping makes the same request cost: 4 x 160 + 10 x 9 + 5 = 735 blocks
    assert stock.blocks_per_request(262144) == 4 * 160 + 10 * 9 + 5
    # grouping again from the package's grouping starts from vLLM's, not from itself
    assert per_rank_grouping(lay, [16, 48], [3 * GIB, 8 * GIB], 262144).same_grouping(lay)


def test_mtp_keeps_vllms_grouping():
    model = ModelSpec.from_hf_config(reference_config("qwen3.8-27b"))
    drafter = DrafterSpec.from_speculative({"method": "mtp", "num_speculative_tokens": 3}, model)
    lay = KVLayout.build(model, kv_cache_dtype="fp8", drafter=drafter)
    # 17 attention layers (16 + MTP) and 48 GDN: groups of 17 -> 1 + 3 groups, nothing to gain
    assert len(lay.groups) == 4
    assert per_rank_grouping(lay, [16, 48], [3 * GIB, 8 * GIB], 262144) is lay


def test_a_sliding_drafter_reads_its_window_at_decode():
    """The decode estimate: a sliding-window drafter layer reads its window's K+V, not the whole
    context: at 262,144 tokens the 5 layers read 5 x 2,048 x (262,144 - 4,096) bytes less."""
    import dataclasses

    from vllm_dualgpu.planner import PlanRequest, parse_gpus, plan

    model = ModelSpec.from_hf_config(reference_config("qwen3.8-27b"))
    full = {k: v for k, v in DRAFTER.items() if k != "layer_types"}
    full["dflash_config"] = {k: v for k, v in DRAFTER["dflash_config"].items() if k != "swa_window_size"}
    req = PlanRequest(max_model_len=262144, kv_cache_dtype="fp8", max_num_seqs=2, max_num_batched_tokens=1024,
                      layer_partition=[16, 48], drafter_shares_embedding=True)
    gpus = parse_gpus("H200:64GiB,H200:64GiB")  # room for any grouping
    reads = {}
    for name, draft in (("window", DRAFTER), ("full", full)):
        spec = {"method": "dflash", "num_speculative_tokens": 7, "draft_config": draft}
        reads[name] = plan(model, gpus, dataclasses.replace(req, speculative=spec)).ranks[-1].decode_read_bytes
    assert reads["full"] - reads["window"] == 5 * 2048 * (262144 - 4096)
