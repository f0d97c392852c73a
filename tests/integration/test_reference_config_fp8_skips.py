"""The bundled reference config is one vLLM can boot: its FP8 ``modules_to_not_convert`` keeps
the vision tower and the Gated DeltaNet ``in_proj_a``/``in_proj_b`` unquantized as vLLM matches
them (vLLM's Fp8Config, exact names after the model's hf_to_vllm_mapper), not only as the
planner does. ``model.visual`` alone matched nothing in vLLM, which then quantized the vision
MLP (4304 columns, not a multiple of the 128 block) and failed its profile run."""

from __future__ import annotations

import pytest

from vllm_dualgpu.planner import ModelSpec, reference_config

fp8 = pytest.importorskip("vllm.model_executor.layers.quantization.fp8")

# Qwen3_5ForConditionalGeneration's mapper and fused layers, as vLLM declares them (the model
# module itself needs torchvision, absent on CPU test machines): 0.30 qwen3_vl.py:1821-1827 and
# 0.33 qwen3_vl.py:1969-1975 (Qwen3VLForConditionalGeneration.hf_to_vllm_mapper) | qwen3_5.py
# {"mtp.": None}; packed_modules_mapping: qwen3_5.py "in_proj_ba": ["in_proj_b", "in_proj_a"].
PREFIXES = {
    "model.visual.": "visual.",
    "lm_head.": "language_model.lm_head.",
    "model.language_model.": "language_model.model.",
    "mtp.": None,
}
PACKED = {
    "qkv_proj": ["q_proj", "k_proj", "v_proj"],
    "gate_up_proj": ["gate_proj", "up_proj"],
    "in_proj_qkvz": ["in_proj_qkv", "in_proj_z"],
    "in_proj_ba": ["in_proj_b", "in_proj_a"],
}


def _vllm_fp8_config():
    from vllm.model_executor.models.utils import WeightsMapper

    cfg = reference_config()
    qc = fp8.Fp8Config.from_config(cfg["quantization_config"])
    qc.apply_vllm_mapper(WeightsMapper(orig_to_new_prefix=PREFIXES))
    qc.packed_modules_mapping = dict(PACKED)
    return cfg, qc


def _skipped(qc, prefix: str) -> bool:
    from vllm.model_executor.layers.quantization.utils.quant_utils import is_layer_skipped

    return is_layer_skipped(prefix, qc.ignored_layers, qc.packed_modules_mapping,
                            match_mode=qc.ignored_layers_match_mode)


def test_vllm_skips_every_vision_linear():
    cfg, qc = _vllm_fp8_config()
    depth = cfg["vision_config"]["depth"]
    # vLLM's names (qwen3_vl.py Qwen3_VisionTransformer under prefix "visual")
    names = [f"visual.blocks.{i}.{s}" for i in range(depth)
             for s in ("attn.qkv", "attn.proj", "mlp.linear_fc1", "mlp.linear_fc2")]
    names += ["visual.merger.linear_fc1", "visual.merger.linear_fc2"]
    assert [n for n in names if not _skipped(qc, n)] == []


def test_vllm_skips_the_deltanet_ba_projection_and_quantizes_the_rest():
    cfg, qc = _vllm_fp8_config()
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
