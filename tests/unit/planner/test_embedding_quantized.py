"""A checkpoint whose compressed-tensors config quantizes the input embedding (an INT8-packed
``embed_tokens``, as the reference setup's W8A16 checkpoint ships it: its patch 08 "passes
quant_config to the embedding so the INT8 embed_tokens.weight_packed loads") is priced packed.

vLLM 0.33 gives such an embedding ``CompressedTensorsEmbeddingWNA16Int``
(layers/quantization/compressed_tensors/compressed_tensors.py:197-211, when a config group's
targets match the layer by name or its class name contains the target, and the layer is not
ignored); ``create_weights`` (compressed_tensors_embedding.py:105-151) makes ``weight_packed``
int32 [vocab, hidden / (32 / bits)], ``weight_scale`` in the model's dtype [vocab, hidden / group]
(group) or [vocab, 1] (channel), and ``weight_shape`` int64 [2]. The bytes below are worked out
from that layout by hand; tests/integration/planner/test_embedding_bytes_vllm.py holds the
planner to vLLM's own layer."""

from __future__ import annotations

import copy

from vllm_dualgpu import planner as P

V, H = 248_320, 5_120  # the bundled reference's vocabulary and hidden size
BF16_TABLE = V * H * 2


def int_weights(strategy="group", group=128):
    return {"num_bits": 8, "type": "int", "symmetric": True, "strategy": strategy,
            "group_size": group if strategy == "group" else None, "dynamic": False}


def config(embedding_targets=None, strategy="group", ignore=("lm_head", "re:.*visual.*")):
    groups = {"group_0": {"targets": ["Linear"], "weights": int_weights()}}
    if embedding_targets:
        groups["embeddings"] = {"targets": list(embedding_targets), "weights": int_weights(strategy)}
    cfg = copy.deepcopy(P.reference_config())
    cfg["quantization_config"] = {"quant_method": "compressed-tensors", "format": "pack-quantized",
                                  "config_groups": groups, "ignore": list(ignore)}
    return cfg


def embed_bytes(cfg, **kw) -> int:
    return P.ModelSpec.from_hf_config(cfg, **kw).embed_bytes


def test_a_regex_target_packs_the_embedding_with_its_group_scales():
    packed = V * (H // 4) * 4 + V * (H // 128) * 2 + 2 * 8  # int32 words, bf16 scales, the shape
    assert embed_bytes(config(["re:.*embed_tokens$"])) == packed
    assert packed < BF16_TABLE * 0.51


def test_channel_scales():
    assert embed_bytes(config(["re:.*embed_tokens$"], strategy="channel")) == V * H + V * 2 + 16


def test_a_class_target_matches_as_vllm_matches_it():
    """vLLM matches a target against the layer's class name by containment:
    "Embedding" in "VocabParallelEmbedding"."""
    assert embed_bytes(config(["Embedding"])) < BF16_TABLE * 0.51


def test_linear_targets_leave_the_embedding_dense():
    assert embed_bytes(config()) == BF16_TABLE


def test_an_ignored_embedding_stays_dense():
    cfg = config(["re:.*embed_tokens$"], ignore=("lm_head", "re:.*embed_tokens$"))
    assert embed_bytes(cfg) == BF16_TABLE


def test_a_category_override_keeps_the_checkpoints_embedding():
    """--weight-format mlp=... changes the named categories only: the checkpoint's packed
    embedding stays packed."""
    cfg = config(["re:.*embed_tokens$"])
    assert embed_bytes(cfg, weight_format="mlp=nvfp4") == embed_bytes(cfg)


def test_both_ranks_hold_the_packed_table():
    """vLLM builds the Qwen3.5 embedding on every pipeline rank: the packed table is what each
    rank's fixed costs hold."""
    gpus = P.parse_gpus("RTX 4070 Ti SUPER,RTX 5090")
    request = P.PlanRequest(max_model_len=65_536, kv_cache_dtype="fp8", max_num_seqs=2,
                            max_num_batched_tokens=1024, layer_partition=[19, 45], gpu_order=[0, 1])
    dense = P.fit(P.ModelSpec.from_hf_config(config()), gpus, request).plan
    packed = P.fit(P.ModelSpec.from_hf_config(config(["re:.*embed_tokens$"])), gpus, request).plan
    saved = BF16_TABLE - embed_bytes(config(["re:.*embed_tokens$"]))
    for d, p in zip(dense.ranks, packed.ranks):
        assert d.fixed_bytes - p.fixed_bytes == saved
