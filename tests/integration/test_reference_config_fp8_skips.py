"""The bundled reference config is one vLLM can boot: its FP8 ``modules_to_not_convert`` keeps
the vision tower and the Gated DeltaNet ``in_proj_a``/``in_proj_b`` unquantized as vLLM matches
them (vLLM's Fp8Config, exact names after the model's hf_to_vllm_mapper), not only as the
planner does. ``model.visual`` alone matched nothing in vLLM, which then quantized the vision
MLP (4304 columns, not a multiple of the 128 block) and failed its profile run."""

from __future__ import annotations

import pytest

from vllm_dualgpu.planner import ModelSpec, reference_config

fp8 = pytest.importorskip("vllm.model_executor.layers.quantization.fp8")


@pytest.fixture
def vllm_fp8(qwen3_5):
    """vLLM's Fp8Config of the bundled config, as vLLM's loader prepares it for
    Qwen3_5ForConditionalGeneration: names through its hf_to_vllm_mapper, its fused layers."""
    cfg = reference_config()
    qc = fp8.Fp8Config.from_config(cfg["quantization_config"])
    cls = qwen3_5.Qwen3_5ForConditionalGeneration
    qc.apply_vllm_mapper(cls.hf_to_vllm_mapper.get_rename_mapper())
    qc.packed_modules_mapping = dict(cls.packed_modules_mapping)
    return cfg, qc


def _skipped(qc, prefix: str) -> bool:
    from vllm.model_executor.layers.quantization.utils.quant_utils import is_layer_skipped

    return is_layer_skipped(prefix, qc.ignored_layers, qc.packed_modules_mapping,
                            match_mode=qc.ignored_layers_match_mode)


def test_vllm_skips_every_vision_linear(vllm_fp8):
    cfg, qc = vllm_fp8
    depth = cfg["vision_config"]["depth"]
    # vLLM's names (qwen3_vl.py Qwen3_VisionTransformer under prefix "visual")
    names = [f"visual.blocks.{i}.{s}" for i in range(depth)
             for s in ("attn.qkv", "attn.proj", "mlp.linear_fc1", "mlp.linear_fc2")]
    names += ["visual.merger.linear_fc1", "visual.merger.linear_fc2"]
    assert [n for n in names if not _skipped(qc, n)] == []


def test_vllm_skips_the_deltanet_ba_projection_and_quantizes_the_rest(vllm_fp8):
    cfg, qc = vllm_fp8
    types = cfg["text_config"]["layer_types"]
    for i, t in enumerate(types):
        pfx = f"language_model.model.layers.{i}"
        if t == "linear_attention":
            assert _skipped(qc, f"{pfx}.linear_attn.in_proj_ba"), i
            assert not _skipped(qc, f"{pfx}.linear_attn.in_proj_qkvz"), i
        else:
            assert not _skipped(qc, f"{pfx}.self_attn.qkv_proj"), i
        assert not _skipped(qc, f"{pfx}.mlp.gate_up_proj"), i


def test_the_planner_reads_the_same_config_as_16_bit_vision():
    spec = ModelSpec.from_hf_config(reference_config())
    assert spec.has_vision and spec.vision_bytes > 0
    # 16-bit vision: the tower's weights at 2 bytes per parameter (1152 hidden, 4304 MLP, 27 blocks)
    h, i, depth = 1152, 4304, 27
    block_params = 3 * h * h + h * h + 2 * h * i
    assert spec.vision_bytes > depth * block_params * 2
