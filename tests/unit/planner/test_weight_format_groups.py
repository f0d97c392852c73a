"""--weight-format names with a group size (``int8-g128``, ``w4a16-g32``: the checkpoints of the
Qwen3.8-27B family quantize in groups: W8A16 in groups of 128 with bf16 scales), and one format for
the decoder's linear layers followed by categories (``int8-g128,embedding=int8-g128``: the W8A16
checkpoint with its INT8-packed embedding)."""

from __future__ import annotations

import pytest

from vllm_dualgpu import planner as P
from vllm_dualgpu.planner.errors import BadRequest
from vllm_dualgpu.planner.formats import FormatResolver, weight_format


def test_a_group_size_in_the_name():
    f = weight_format("int8-g128")
    # int8 values, one bf16 scale per 128 inputs of each output row
    assert f.linear_bytes(17408, 5120) == 17408 * 5120 + 17408 * 40 * 2
    assert weight_format("w8a16-g128").linear_bytes(17408, 5120) == f.linear_bytes(17408, 5120)
    assert weight_format("w4a16-g32").linear_bytes(17408, 5120) == 17408 * 5120 // 2 + 17408 * 160 * 2
    assert weight_format("int4-g128").linear_bytes(64, 256) == weight_format("w4a16").linear_bytes(64, 256)
    for bad in ("int8-g0", "int8-g", "fp8-g128", "nvfp4-g16"):
        with pytest.raises(BadRequest, match="unknown weight format"):
            weight_format(bad)


def test_a_base_format_then_categories():
    r = FormatResolver.from_config(None, weight_format="int8-g128,embedding=int8-g128")
    assert r.fmt("model.layers.0.mlp.down_proj", "mlp").name == "int8-g128"
    assert r.fmt("model.layers.3.self_attn.q_proj", "attention").name == "int8-g128"
    assert r.fmt("model.embed_tokens", "embedding").name == "int8-g128"
    assert r.fmt("lm_head", "lm_head").kind == "dense" and r.fmt("model.visual.blocks.0", "vision").kind == "dense"
    with pytest.raises(BadRequest, match="one format without a category"):
        FormatResolver.from_config(None, weight_format="int8,fp8,embedding=int8-g128")


def test_the_packed_embedding_through_the_override():
    V, H = 248_320, 5_120
    m = P.ModelSpec.from_hf_config(P.reference_config(), weight_format="int8-g128,embedding=int8-g128")
    assert m.embed_bytes == V * H + V * (H // 128) * 2 + 16
    plain = P.ModelSpec.from_hf_config(P.reference_config(), weight_format="int8-g128")
    assert plain.embed_bytes == V * H * 2 and plain.layer_weight_bytes == m.layer_weight_bytes
