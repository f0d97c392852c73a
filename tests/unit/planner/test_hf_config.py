"""One config.json reader for the planner and the FP8 tuner (planner/hf_config.py).

The tuner had a reader of its own that disagreed with the planner's on MoE layer placement
(decoder_sparse_step), on Mixtral's expert key and on layer types; both now read
DecoderConfig, so these cases are checked through both users.
"""

from __future__ import annotations

import pytest

from vllm_dualgpu.kernels.fp8_tuner import model_weight_shapes
from vllm_dualgpu.planner import ModelSpec, UnsupportedModel
from vllm_dualgpu.planner.hf_config import FULL, LINEAR, DecoderConfig

BLOCK_FP8 = {"quant_method": "fp8", "weight_block_size": [128, 128]}
BASE = {"hidden_size": 1024, "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2,
        "head_dim": 128, "vocab_size": 4096, "torch_dtype": "bfloat16", "quantization_config": BLOCK_FP8}


def shapes(cfg) -> set[tuple[int, int]]:
    return {(s.N, s.K) for s in model_weight_shapes(cfg).shapes}


def test_sparse_step_moe_has_dense_layers_for_both():
    # Qwen2-MoE rule: layer i has experts when (i + 1) % decoder_sparse_step == 0: layers 0 and 2
    # are dense here (gate_up 2 x 640 by 1024), layers 1 and 3 have 8 experts of 256.
    cfg = dict(BASE, model_type="qwen2_moe", architectures=["Qwen2MoeForCausalLM"], intermediate_size=640,
               num_experts=8, moe_intermediate_size=256, num_experts_per_tok=2, decoder_sparse_step=2)
    dc = DecoderConfig.from_dict(cfg)
    assert [dc.is_moe_layer(i) for i in range(4)] == [False, True, False, True]
    assert (1280, 1024) in shapes(cfg)  # the dense layers' gate_up_proj: the old reader missed it
    spec = ModelSpec.from_hf_config(cfg)
    dense, moe = spec.layers[0].weight_bytes, spec.layers[1].weight_bytes
    # Dense MLP 3 x 640 x 1024, experts 8 x 3 x 256 x 1024 + router 8 x 1024 (FP8: 1 byte each,
    # plus block scales): the expert layer is clearly the heavier one.
    assert moe > dense


def test_mixtral_expert_key_is_an_moe_for_both():
    cfg = dict(BASE, model_type="mixtral", architectures=["MixtralForCausalLM"], intermediate_size=640,
               num_local_experts=4, num_experts_per_tok=2, moe_intermediate_size=640)
    assert DecoderConfig.from_dict(cfg).num_experts == 4
    # Every layer is MoE: no dense gate_up_proj (2 x 640 by 1024) for the tuner to tune; the
    # attention's qkv (8 x 128 + 2 x 2 x 128 = 1536 by 1024) is still there.
    assert (1280, 1024) not in shapes(cfg) and (1536, 1024) in shapes(cfg)


def test_layer_types_and_output_gate_are_the_same_for_both():
    cfg = dict(BASE, model_type="qwen3_5_text", architectures=["Qwen3_5ForCausalLM"], intermediate_size=512,
               full_attention_interval=2, linear_num_key_heads=4, linear_num_value_heads=8,
               linear_key_head_dim=64, linear_value_head_dim=64, linear_conv_kernel_dim=4)
    dc = DecoderConfig.from_dict(cfg)
    assert dc.layer_types == (LINEAR, FULL, LINEAR, FULL) and dc.attn_output_gate
    # Gated attention: q is 2 x 8 x 128 wide, k and v 2 x 128 each: qkv N = 2048 + 512.
    assert (2560, 1024) in shapes(cfg)
    assert [l.kind for l in ModelSpec.from_hf_config(cfg).layers] == list(dc.layer_types)


def test_a_config_without_a_vocabulary_is_a_planner_refusal_only():
    cfg = {k: v for k, v in BASE.items() if k != "vocab_size"}
    cfg.update(model_type="qwen3", architectures=["Qwen3ForCausalLM"], intermediate_size=512)
    assert shapes(cfg)  # the tuner needs no vocabulary
    with pytest.raises(UnsupportedModel, match="no 'vocab_size'"):
        ModelSpec.from_hf_config(cfg)
