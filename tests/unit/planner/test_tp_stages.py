"""TP groups as pipeline stages (planner/tp_stages.py): grouping, refusals and the arithmetic of
one TP rank, with every expected number derived by hand from the tiny Qwen3 fixture:
hidden 256, 4 attention heads of 64, 2 KV heads, MLP 512, vocabulary 1024, bf16, 4 layers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vllm_dualgpu.planner import BadRequest, GpuFacts, PlanRequest, fit
from vllm_dualgpu.planner.tp_stages import group_stages, plan_stages

GiB, MiB = 1024**3, 1024**2
CFG = json.loads((Path(__file__).parents[2] / "fixtures" / "tiny_qwen3.json").read_text())

# One layer, bf16 (2 bytes an element), norms (input 256 + post-attention 256 + q/k norms 64 + 64
# = 640 elements = 1,280 bytes) whole on every rank:
#   TP 2: q 256x128, k 256x64, v 256x64, o 128x256, gate+up 2x256x256, down 256x256
#         = 294,912 elements = 589,824 bytes, + 1,280 = 591,104
#   TP 4: 1 attention head a rank, the 2 KV heads replicated (one a rank): q, k, v 256x64 each,
#         o 64x256, gate+up 2x256x128, down 128x256 = 163,840 elements = 327,680, + 1,280 = 328,960
LAYER_TP2, LAYER_TP4 = 591_104, 328_960
# KV of one layer in one 16-token block on a rank: 16 x (K and V) x 1 head x 64 x 2 bytes.
KV_BLOCK_LAYER = 16 * 2 * 1 * 64 * 2  # 4,096, at TP 2 (2 heads / 2) and at TP 4 (replicated)
# What a TP-2 rank keeps beyond its shard: the sampler's logits at the full vocabulary, 8
# sequences x (1024 - 512) x 6 bytes a logit, 256 MiB for the TP group's NCCL buffers, and the
# all-gathered copy of a received batch: 2 tensors x 2,048 tokens x hidden 256 x 2 bytes.
EXTRA_TP2 = 8 * (1024 - 512) * 6 + 256 * MiB + 2 * 2048 * 256 * 2


def card(i, name="RTX 5090", total=32, free=30, reserve=GiB):
    return GpuFacts(i, name, total * GiB, free * GiB, reserve_bytes=reserve).with_known_defaults()


def interleaved():
    """Two kinds in PCI order 5090, 4070 Ti SUPER, 5090, 4070 Ti SUPER."""
    return [card(0), card(1, "RTX 4070 Ti SUPER", 16, 15), card(2), card(3, "RTX 4070 Ti SUPER", 16, 15)]


REQ = PlanRequest(max_model_len=4096, max_num_seqs=8, max_num_batched_tokens=2048, pp_size=2)


def test_cards_of_one_kind_form_a_stage_in_card_order():
    stages = group_stages(interleaved(), 2, 2)
    assert [[g.index for g in s] for s in stages] == [[0, 2], [1, 3]]


def test_the_shard_each_rank_holds():
    s = plan_stages(CFG, interleaved(), 2, 2, REQ)
    assert s.model.layer_weight_bytes == [LAYER_TP2] * 4
    # vocabulary-parallel: 1024 rows (already a multiple of 64) / 2 x 256 x 2 bytes
    assert s.model.embed_bytes == s.model.lm_head_bytes == 512 * 256 * 2
    assert plan_stages(CFG, [card(i) for i in range(8)], 2, 4, REQ).model.layer_weight_bytes == [LAYER_TP4] * 4


def test_each_stage_is_planned_at_its_smallest_card_less_the_tp_extra():
    gpus = [card(0, free=30), card(1, free=28), card(2, free=30), card(3, free=30)]
    s = plan_stages(CFG, gpus, 2, 2, REQ)
    assert s.extra_reserve_bytes == EXTRA_TP2
    assert [c.budget_bytes for c in s.cards] == [28 * GiB - GiB - EXTRA_TP2, 29 * GiB - EXTRA_TP2]
    assert [c.index for c in s.cards] == [0, 2]  # a stage is named by its first card: [0, 1], [2, 3]
    assert s.notes == ("TP groups planned as equals at the smaller card's free memory",)


def test_the_split_and_kv_are_planned_for_the_stages():
    s = plan_stages(CFG, interleaved(), 2, 2, REQ)
    p = fit(s.model, list(s.cards), REQ).plan
    # The 4070 Ti SUPER stage (named by GPU 1) first: the 5090 stage holds the output head.
    assert p.order == [1, 0]
    for r in p.ranks:
        assert r.kv_bytes_per_block == KV_BLOCK_LAYER * r.num_layers
    # vLLM's ranks: stage x 2 + TP rank.
    assert [(st, t, g.index) for st, t, g in s.rank_cards(p.order)] == [(0, 0, 1), (0, 1, 3), (1, 0, 0), (1, 1, 2)]


def test_tp1_is_a_plain_pipeline():
    gpus = interleaved()
    s = plan_stages(CFG, gpus, 4, 1, REQ)
    assert list(s.cards) == gpus and s.extra_reserve_bytes == 0
    assert s.model.layer_weight_bytes == [2 * LAYER_TP2 - 1280] * 4  # the full layer


@pytest.mark.parametrize("gpus, pp, tp, first", [
    (interleaved()[:3], 2, 2, "--pipeline-parallel-size 2 x --tensor-parallel-size 2 needs 4 GPUs, but only 3 are visible"),
    ([card(0), card(1), card(2, "RTX 4070 Ti SUPER", 16, 15), card(3, "RTX 5080", 16, 15)], 2, 2,
     "mixed TP group: --tensor-parallel-size 2 x --pipeline-parallel-size 2 needs stages of 2 cards of one kind"),
    # same name, other memory: another kind
    ([card(0), card(1), card(2), card(3, "RTX 5090", 24, 20)], 2, 2, "mixed TP group"),
])
def test_refusals(gpus, pp, tp, first):
    with pytest.raises(BadRequest) as e:
        plan_stages(CFG, gpus, pp, tp, REQ)
    assert str(e.value).startswith(first)
    assert "\n" not in str(e.value)


def test_mixed_refusal_names_the_odd_cards_and_what_to_do():
    gpus = [card(0), card(1), card(2, "RTX 4070 Ti SUPER", 16, 15), card(3, "RTX 5080", 16, 15)]
    with pytest.raises(BadRequest) as e:
        group_stages(gpus, 2, 2)
    msg = str(e.value)
    assert "GPU 2 (RTX 4070 Ti SUPER, 16 GiB), GPU 3 (RTX 5080, 16 GiB) would share a stage" in msg
    assert "CUDA_VISIBLE_DEVICES" in msg and "-tp 1" in msg


def test_heads_or_kv_heads_tp_does_not_divide():
    with pytest.raises(BadRequest, match=r"does not divide the model's attention heads \(4\)"):
        plan_stages(CFG, [card(i) for i in range(6)], 2, 3, REQ)
    six = dict(CFG, num_attention_heads=6, num_key_value_heads=3)
    with pytest.raises(BadRequest, match=r"does not divide the model's KV heads \(3\)"):
        plan_stages(six, [card(i) for i in range(4)], 2, 2, REQ)


def test_the_fleet_report_serves_tp_stages_on_one_host_with_the_executor():
    from vllm_dualgpu.planner.topology import parse_fleet, plan_fleet

    fp = plan_fleet(CFG, parse_fleet("box=RTX 5090,RTX 4070 Ti SUPER,RTX 5090,RTX 4070 Ti SUPER"), REQ, tp_sizes=[2])
    r = fp.get("host-tp2").replicas[0]
    assert r.fits and r.pp == 2
    assert r.serve_today() == (True, "vllm serve MODEL --pipeline-parallel-size 2 --tensor-parallel-size 2 "
                                     "--distributed-executor-backend dualgpu --max-model-len 4096")


EAGLE3 = {
    "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": 256,
    "intermediate_size": 512, "num_hidden_layers": 1, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 1024, "draft_vocab_size": 512,
    "max_position_embeddings": 4096, "torch_dtype": "bfloat16",
}


def with_drafter(**extra):
    from dataclasses import replace

    return replace(REQ, speculative={"method": "eagle3", "num_speculative_tokens": 2, "draft_config": EAGLE3, **extra})


def test_a_drafter_is_sharded_at_the_targets_tp_unless_told_1():
    d = plan_stages(CFG, interleaved(), 2, 2, with_drafter()).request.speculative["draft_config"]
    assert (d["num_attention_heads"], d["num_key_value_heads"], d["intermediate_size"]) == (2, 1, 256)
    assert EAGLE3["num_attention_heads"] == 4  # the caller's config is left alone
    kept = plan_stages(CFG, interleaved(), 2, 2, with_drafter(draft_tensor_parallel_size=1)).request
    assert kept.speculative["draft_config"] is EAGLE3
    odd = dict(EAGLE3, num_attention_heads=3, num_key_value_heads=3, head_dim=64)
    with pytest.raises(BadRequest, match=r"^the drafter: tensor parallel size 2 does not divide the model's attention heads \(3\)"):
        plan_stages(CFG, interleaved(), 2, 2, with_drafter(draft_config=odd))
