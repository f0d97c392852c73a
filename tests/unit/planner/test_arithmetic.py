"""The planner's arithmetic against cases computed by hand (the arithmetic is in each test)."""

from __future__ import annotations

import copy

import pytest

from vllm_dualgpu.planner import (
    BadRequest,
    DrafterSpec,
    KVLayout,
    ModelSpec,
    UnsupportedModel,
    parse_gpus,
    parse_size,
    reference_config,
    weight_format,
)
from vllm_dualgpu.planner.formats import FormatResolver
from vllm_dualgpu.planner.gpus import lookup

MIB = 1 << 20
GIB = 1 << 30

TINY = {  # tests/fixtures/tiny_qwen3.json
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 256, "intermediate_size": 512,
    "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 1024,
    "max_position_embeddings": 4096, "torch_dtype": "bfloat16", "tie_word_embeddings": False,
}


# ---- weight formats ----------------------------------------------------------------------------


def test_weight_format_bytes_by_hand():
    # fp8, 128x128 blocks: 5120 x 5120 bytes + one fp32 scale per block (40 x 40 blocks)
    assert weight_format("fp8").linear_bytes(5120, 5120) == 5120 * 5120 + 4 * 40 * 40
    # NVFP4: half a byte per weight, one fp8 scale per 16 inputs, 8 bytes of global scales
    assert weight_format("nvfp4").linear_bytes(17408, 5120) == 17408 * 5120 // 2 + 17408 * 320 + 8
    # W4A16, groups of 128 with bf16 scales: 17408 x 40 groups x 2 bytes
    assert weight_format("w4a16").linear_bytes(17408, 5120) == 17408 * 5120 // 2 + 2 * 17408 * 40
    # W8A16 per-channel bf16 scales
    assert weight_format("int8").linear_bytes(1000, 300) == 300_000 + 2 * 1000
    assert weight_format("bf16").linear_bytes(7, 3) == 42
    with pytest.raises(BadRequest, match="unknown weight format"):
        weight_format("fp7")


def test_dense_layer_bytes_by_hand():
    m = ModelSpec.from_hf_config(TINY)
    # q 256x256, k 128x256, v 128x256, o 256x256, gate/up 512x256, down 256x512 (bf16: 2 B)
    linear = (65536 + 32768 + 32768 + 65536 + 3 * 131072) * 2
    norms = 2 * 64 * 2 + 2 * 256 * 2  # q_norm/k_norm (head_dim) + two RMSNorms (hidden)
    assert m.layer_weight_bytes == [linear + norms] * 4 == [1_180_928] * 4
    assert m.embed_bytes == m.lm_head_bytes == 1024 * 256 * 2
    assert not m.is_hybrid and m.max_position_embeddings == 4096


def test_qwen3_14b_fp8_layer_by_hand():
    m = ModelSpec.from_hf_config(reference_config("qwen3-14b"))
    params = 5120 * 5120 * 2 + 5120 * 1024 * 2 + 3 * 5120 * 17408  # q,o + k,v + gate,up,down
    scales = 4 * (40 * 40 + 8 * 40 * 2 + 40 * 40 + 136 * 40 * 2 + 40 * 136)  # fp32 per 128x128 block
    norms = 2 * 128 * 2 + 2 * 5120 * 2
    assert m.layers[0].weight_bytes == params + scales + norms == 330_403_072
    assert m.embed_bytes == 151936 * 5120 * 2  # 16-bit, as in FP8 checkpoints
    assert m.num_layers == 40 and m.weight_format == "fp8"


def test_reference_27b_layers_by_hand():
    m = ModelSpec.from_hf_config(reference_config("qwen3.8-27b"))
    assert m.layer_types.count("linear_attention") == 48 and m.layer_types[3] == "full_attention"
    mlp = 3 * (17408 * 5120 + 4 * 136 * 40)  # gate, up, down in fp8 with block scales
    # Gated DeltaNet: in_proj_qkv (2*2048+6144 = 10240 out), in_proj_z (6144), out_proj (6144 in) in fp8;
    # in_proj_b/a (48 out each) stay bf16 (modules_to_not_convert); conv1d 10240x4 bf16; A_log fp32 +
    # dt_bias bf16 per value head; gated norm 128 fp32.
    gdn = (10240 * 5120 + 4 * 80 * 40) + (6144 * 5120 + 4 * 48 * 40) + 2 * (48 * 5120 * 2)
    gdn += (5120 * 6144 + 4 * 40 * 48) + 10240 * 4 * 2 + 48 * 6 + 128 * 4
    assert m.layers[0].weight_bytes == gdn + mlp + 2 * 5120 * 2 == 383_909_920
    # Full attention with the output gate: q is 2 x 24 x 256 wide.
    attn = (12288 * 5120 + 4 * 96 * 40) + 2 * (1024 * 5120 + 4 * 8 * 40) + (5120 * 6144 + 4 * 40 * 48) + 2 * 256 * 2
    assert m.layers[3].weight_bytes == attn + mlp + 2 * 5120 * 2 == 372_356_864
    assert m.embed_bytes == m.lm_head_bytes == 248320 * 5120 * 2
    assert m.vision_bytes > 0 and m.mtp_num_layers == 1


def test_quantization_configs_pick_per_module_formats():
    base = copy.deepcopy(TINY)
    bf16_layer = 1_180_928
    attn_params, mlp_params = 65536 + 32768 + 32768 + 65536, 3 * 131072
    norms = 2 * 64 * 2 + 2 * 256 * 2

    # compressed-tensors: MLP in NVFP4, attention in FP8 (per channel), layer 0's attention ignored.
    ct = dict(base, quantization_config={
        "quant_method": "compressed-tensors",
        "config_groups": {
            "g0": {"targets": ["re:.*mlp.*"], "weights": {"num_bits": 4, "type": "float", "group_size": 16}},
            "g1": {"targets": ["re:.*self_attn.*"], "weights": {"num_bits": 8, "type": "float", "strategy": "channel"}},
        },
        "ignore": ["lm_head", "re:model.layers.0.self_attn.*"],
    })
    m = ModelSpec.from_hf_config(ct)
    nvfp4_mlp = 2 * (512 * 256 // 2 + 512 * 16 + 8) + (256 * 512 // 2 + 256 * 32 + 8)
    fp8_attn = (65536 + 4 * 256) + 2 * (32768 + 4 * 128) + (65536 + 4 * 256)
    assert m.layers[0].weight_bytes == attn_params * 2 + nvfp4_mlp + norms
    assert m.layers[1].weight_bytes == fp8_attn + nvfp4_mlp + norms
    assert m.lm_head_bytes == 1024 * 256 * 2

    # ModelOpt FP8 with a glob exclusion: per-tensor scale (4 B) per matrix.
    mo = dict(base, quantization_config={"quant_method": "modelopt", "quant_algo": "FP8", "exclude_modules": ["*.mlp.*"]})
    m = ModelSpec.from_hf_config(mo)
    assert m.layers[2].weight_bytes == (attn_params + 4 * 4) + mlp_params * 2 + norms

    # GPTQ 4-bit, group 128, symmetric.
    gq = dict(base, quantization_config={"quant_method": "gptq", "bits": 4, "group_size": 128, "sym": True})
    m = ModelSpec.from_hf_config(gq)
    q = lambda o, i: o * i // 2 + 2 * o * -(-i // 128)  # noqa: E731
    want = q(256, 256) + 2 * q(128, 256) + q(256, 256) + 2 * q(512, 256) + q(256, 512)
    assert m.layers[0].weight_bytes == want + norms

    # The user's format wins over the checkpoint's, per category.
    m = ModelSpec.from_hf_config(gq, weight_format="mlp=bf16,attention=bf16")
    assert m.layers[0].weight_bytes == bf16_layer
    m = ModelSpec.from_hf_config(base, weight_format="int8")
    assert m.layers[0].weight_bytes == (attn_params + 2 * (256 + 128 + 128 + 256)) + (mlp_params + 2 * (512 + 512 + 256)) + norms
    # --quantization fp8 on a 16-bit checkpoint: vLLM quantizes per tensor when loading.
    m = ModelSpec.from_hf_config(base, quantization="fp8")
    assert m.layers[0].weight_bytes == attn_params + 4 * 4 + mlp_params + 3 * 4 + norms

    with pytest.raises(UnsupportedModel, match="not sized"):
        ModelSpec.from_hf_config(dict(base, quantization_config={"quant_method": "hqq"}))
    with pytest.raises(BadRequest, match="unknown weight category"):
        FormatResolver.from_config(None, weight_format="mixer=fp8")


def test_unsupported_configs_say_why():
    with pytest.raises(UnsupportedModel, match="MLA"):
        ModelSpec.from_hf_config(dict(TINY, kv_lora_rank=512))
    with pytest.raises(UnsupportedModel, match="sliding"):
        ModelSpec.from_hf_config(dict(TINY, use_sliding_window=True, sliding_window=4096))
    with pytest.raises(UnsupportedModel, match="layer types"):
        ModelSpec.from_hf_config(dict(TINY, layer_types=["sliding_attention"] * 4))
    with pytest.raises(UnsupportedModel, match="hidden_size"):
        ModelSpec.from_hf_config({"architectures": ["X"]})


# ---- KV cache ---------------------------------------------------------------------------------------


def test_dense_kv_by_hand():
    m = ModelSpec.from_hf_config(reference_config("qwen3-14b"))
    kv = KVLayout.build(m)  # bf16: 16 tokens x 8 heads x (128 K + 128 V) x 2 B = 65,536 B per layer
    assert kv.block_size == 16
    assert kv.bytes_per_block(0, 20, False) == 20 * 65536 == 1_310_720
    assert kv.bytes_per_block(20, 40, True) == 1_310_720
    # 2,172 blocks: one is the null block, 2,171 x 16 tokens fit one request
    assert kv.max_len_for_blocks(2172) == 2171 * 16
    assert kv.blocks_per_request(40960) == 2560
    assert kv.pool_tokens(2172, 40960) == 34752  # what vLLM logs as "GPU KV cache size"
    fp8 = KVLayout.build(m, kv_cache_dtype="fp8")
    assert fp8.bytes_per_block(0, 1, False) == 32768
    with pytest.raises(UnsupportedModel, match="kv-cache-dtype"):
        KVLayout.build(m, kv_cache_dtype="int4_per_token_head")


def test_hybrid_kv_by_hand():
    m = ModelSpec.from_hf_config(reference_config("qwen3.8-27b"))
    kv = KVLayout.build(m, kv_cache_dtype="fp8")
    # Gated DeltaNet state: conv 10240 x (4 - 1) x 2 B (bf16) + SSM 48 x 128 x 128 x 4 B (fp32: the
    # config's mamba_ssm_dtype) = 61,440 + 3,145,728 = 3,207,168 B. Attention: 4 x 512 x 1 B = 2,048
    # B per token, so the block is 16 x cdiv(3,207,168, 16 x 2,048) = 16 x 98 = 1,568 tokens.
    assert kv.mamba_page_bytes == 3_207_168
    assert kv.block_size == 1568
    page = 1568 * 2048
    assert kv.mamba_page_padded == page == 3_211_264
    # 64 layers -> buckets of 16 attention and 48 GDN layers -> 4 groups of 16: layers i % 4 == k.
    assert [len(g.members) for g in kv.groups] == [16, 16, 16, 16]
    # A rank pays the largest group among its layers: 12 layers (0-11) = 3 per group; 13 layers
    # (0-12) = 4 in the group of layers 0, 4, 8, 12 -> one more page for one more layer.
    assert kv.bytes_per_block(0, 12, False) == 3 * page
    assert kv.bytes_per_block(0, 13, False) == 4 * page
    assert kv.bytes_per_block(13, 64, True) == 13 * page
    # A request: cdiv(L, 1568) attention blocks + 3 GDN groups x 2 blocks (prefix caching "align").
    assert kv.blocks_per_request(262144) == 168 + 6
    assert kv.max_len_for_blocks(185) == (185 - 1 - 6) * 1568 == 279_104
    none = KVLayout.build(m, kv_cache_dtype="fp8", mamba_cache_mode="none")
    assert none.blocks_per_request(262144) == 168 + 3


def test_hybrid_with_mtp_by_hand():
    m = ModelSpec.from_hf_config(reference_config("qwen3.8-27b"))
    d = DrafterSpec.from_speculative({"method": "mtp", "num_speculative_tokens": 3}, m)
    kv = KVLayout.build(m, kv_cache_dtype="fp8", drafter=d)
    # conv state grows to 4 - 1 + 3 = 6 columns: 10240 x 6 x 2 + 3,145,728 = 3,268,608 B
    # -> 16 x cdiv(3,268,608, 32,768) = 16 x 100 = 1,600 tokens per block.
    assert kv.mamba_page_bytes == 3_268_608 and kv.block_size == 1600
    # 17 attention layers (16 + MTP), 48 GDN: group size 17, GDN split into 3 groups of 16.
    assert sorted(len(g.members) for g in kv.groups) == [16, 16, 16, 17]
    page = 1600 * 2048
    # The last rank with layers 12-63 holds 13 attention layers + the MTP layer = 14 pages.
    assert kv.bytes_per_block(12, 64, True) == 14 * page
    # Per request: attention cdiv(L, 1600) + 3 GDN groups x (2 + 3 speculative) blocks.
    assert kv.blocks_per_request(16000) == 10 + 15
    # A drafter with its own checkpoint: its config (as the executor passes it) sizes it.
    e3 = DrafterSpec.from_speculative(
        {"method": "eagle3", "num_speculative_tokens": 4, "draft_hf_config": dict(TINY, num_hidden_layers=1)}, m
    )
    assert (e3.kv_layers, e3.kv_heads, e3.head_dim, e3.passes) == (1, 2, 64, 4)
    # one tiny decoder layer + eagle3's fc (3 x 256 -> 256, bf16) + final norm
    assert e3.weight_bytes == 1_180_928 + 3 * 256 * 256 * 2 + 256 * 2
    with pytest.raises(BadRequest, match="needs the drafter's config"):
        DrafterSpec.from_speculative({"method": "eagle3", "num_speculative_tokens": 4}, m)
    with pytest.raises(BadRequest, match="no MTP"):
        DrafterSpec.from_speculative({"method": "mtp", "num_speculative_tokens": 1}, ModelSpec.from_hf_config(TINY))


# ---- GPUs -------------------------------------------------------------------------------------------


def test_gpu_parsing_and_lookup():
    a, b = parse_gpus("RTX 4070 Ti SUPER:16GiB, RTX 5090:32GiB:30.5GiB:reserve=1GiB")
    assert (a.index, a.total_bytes, a.free_bytes, a.bandwidth_gbps, a.capability) == (0, 16 * GIB, 16 * GIB, 672, (8, 9))
    assert (b.index, b.free_bytes, b.reserve_bytes, b.budget_bytes) == (1, int(30.5 * GIB), GIB, int(29.5 * GIB))
    assert b.bandwidth_gbps == 1792 and b.capability == (12, 0)
    (h,) = parse_gpus("NVIDIA H200:141GiB:free=16GiB:bw=4000:cc=9.0")
    assert (h.free_bytes, h.bandwidth_gbps, h.capability) == (16 * GIB, 4000.0, (9, 0))
    (k,) = parse_gpus("RTX 4090")  # known card: its NVML total
    assert k.total_bytes == 24564 * MIB == k.free_bytes
    assert lookup("NVIDIA GeForce RTX 4070 Ti SUPER").name == "RTX 4070 Ti SUPER"  # not "RTX 4070 Ti"
    assert lookup("NVIDIA A100-SXM4-80GB").name == "A100 80GB"
    assert parse_size("512MiB") == 512 * MIB and parse_size("16GB") == 16 * 10**9 and parse_size("2") == 2 * GIB
    with pytest.raises(BadRequest, match="unknown GPU"):
        parse_gpus("Mystery Card")
    with pytest.raises(BadRequest, match="free memory is larger"):
        parse_gpus("RTX 4090:24GiB:25GiB")
    with pytest.raises(BadRequest, match="unknown --gpus key"):
        parse_gpus("RTX 4090:speed=9")
