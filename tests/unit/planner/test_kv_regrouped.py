"""``KVLayout.regrouped``: the planner's arithmetic on a grouping vLLM formed (engine/kv_pricing.py
passes vLLM's groups as plain data). Expected numbers are derived by hand from the shapes."""

from __future__ import annotations

import pytest

from vllm_dualgpu.planner import KVLayout, ModelSpec, PricedGroup, reference_config

# Qwen3-14B: 40 layers, 8 KV heads x 128, bf16 cache: a 16-token page is 16 x 8 x 2 x 128 x 2 bytes.
PAGE = 16 * 8 * 2 * 128 * 2


@pytest.fixture(scope="module")
def layout() -> KVLayout:
    return KVLayout.build(ModelSpec.from_hf_config(reference_config("qwen3-14b")))


def attention(names, page=PAGE, block=16):
    return PricedGroup("attention", tuple(names), {n: page for n in names}, block, 0)


def test_the_mirror_groups_a_dense_model_in_one(layout):
    assert len(layout.groups) == 1
    assert layout.bytes_per_block(0, 40, True) == 40 * PAGE
    assert layout.blocks_per_request(1000) == 63  # cdiv(1000, 16)


def test_two_groups_halve_the_block_and_double_the_blocks_per_request(layout):
    names = [s.name for s in layout.slots]
    two = layout.regrouped([attention(names[0::2]), attention(names[1::2])])
    assert two.grouping == "vllm" and len(two.groups) == 2
    # A block holds one page per layer of the larger group on the rank: 20 of 40, 10 of 20.
    assert two.bytes_per_block(0, 40, True) == 20 * PAGE
    assert two.bytes_per_block(0, 20, False) == 10 * PAGE
    assert two.blocks_per_request(1000) == 2 * 63
    assert not two.same_grouping(layout)
    # The source layout is left as it was.
    assert len(layout.groups) == 1 and layout.bytes_per_block(0, 40, True) == 40 * PAGE


def test_the_same_grouping_is_recognised(layout):
    again = layout.regrouped([attention([s.name for s in layout.slots])])
    assert again.same_grouping(layout)
    bigger = layout.regrouped([attention([s.name for s in layout.slots], page=2 * PAGE, block=32)])
    assert not bigger.same_grouping(layout)
    assert bigger.bytes_per_block(0, 40, True) == 80 * PAGE
    assert bigger.blocks_per_request(1000) == 32  # cdiv(1000, 32)


def test_a_grouping_must_cover_every_layer_once(layout):
    names = [s.name for s in layout.slots]
    with pytest.raises(ValueError, match="layers in no group"):
        layout.regrouped([attention(names[:-1])])
    with pytest.raises(ValueError, match="in two groups"):
        layout.regrouped([attention(names), attention(names[:1])])
    with pytest.raises(ValueError, match="unknown to the planner"):
        layout.regrouped([attention([*names, "model.layers.99.self_attn.attn"])])
