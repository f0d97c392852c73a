"""The planner's embedding bytes against vLLM's own layer: ``VocabParallelEmbedding`` built on the
meta device (shapes only) with vLLM's ``CompressedTensorsConfig`` from a checkpoint's
quantization config, as the Qwen3.5 model builds its ``embed_tokens`` under the plugin's
vocab-embedding patch (the layer gets the checkpoint's quant config). vLLM decides whether the
table is quantized (``CompressedTensorsEmbeddingWNA16Int``) or dense; its parameters' bytes are
what the planner must charge each rank that builds the embedding."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest

from vllm_dualgpu import planner as P

INT8 = {"num_bits": 8, "type": "int", "symmetric": True, "dynamic": False}
GROUPS = {
    "regex, group 128": {"targets": ["re:.*embed_tokens$"], "weights": {**INT8, "strategy": "group", "group_size": 128}},
    "class, channel": {"targets": ["Embedding"], "weights": {**INT8, "strategy": "channel", "group_size": None}},
    "int4 group 32": {"targets": ["re:.*embed_tokens$"], "weights": {**INT8, "num_bits": 4, "strategy": "group",
                                                                      "group_size": 32}},
}


def quant_config(embedding_group: dict | None, ignore=("lm_head",)) -> dict:
    groups = {"group_0": {"targets": ["Linear"], "weights": {**INT8, "strategy": "group", "group_size": 128}}}
    if embedding_group:
        groups["embeddings"] = embedding_group
    return {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
            "config_groups": groups, "ignore": list(ignore)}


def vllm_embedding_bytes(qc: dict, vocab: int, hidden: int, monkeypatch) -> tuple[int, str]:
    import torch
    from vllm.distributed import parallel_state
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import CompressedTensorsConfig
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    monkeypatch.setattr(parallel_state, "_TP", SimpleNamespace(world_size=1, rank_in_group=0))
    config = CompressedTensorsConfig.from_config(copy.deepcopy(qc))
    with torch.device("meta"):
        layer = VocabParallelEmbedding(vocab, hidden, params_dtype=torch.bfloat16, quant_config=config,
                                       prefix="language_model.model.embed_tokens")
    return (sum(p.numel() * p.element_size() for p in layer.parameters()),
            type(layer.quant_method).__name__)


def planner_embedding_bytes(qc: dict) -> int:
    cfg = copy.deepcopy(P.reference_config())
    cfg["quantization_config"] = qc
    return P.ModelSpec.from_hf_config(cfg).embed_bytes


@pytest.mark.parametrize("name", list(GROUPS))
def test_a_quantized_embedding_is_priced_as_vllm_builds_it(name, monkeypatch):
    cfg = P.reference_config()
    vocab, hidden = cfg["text_config"]["vocab_size"], cfg["text_config"]["hidden_size"]
    qc = quant_config(GROUPS[name])
    got, method = vllm_embedding_bytes(qc, vocab, hidden, monkeypatch)
    assert method == "CompressedTensorsEmbeddingWNA16Int"
    assert planner_embedding_bytes(qc) == got
    assert got < 0.51 * vocab * hidden * 2  # packed: about half the bf16 table or less


@pytest.mark.parametrize("embedding_group,ignore", [
    (None, ("lm_head",)),                                    # only Linear targets
    (GROUPS["regex, group 128"], ("lm_head", "re:.*embed_tokens$")),  # the embedding ignored
])
def test_a_dense_embedding_is_priced_as_vllm_builds_it(embedding_group, ignore, monkeypatch):
    cfg = P.reference_config()
    vocab, hidden = cfg["text_config"]["vocab_size"], cfg["text_config"]["hidden_size"]
    qc = quant_config(embedding_group, ignore)
    got, method = vllm_embedding_bytes(qc, vocab, hidden, monkeypatch)
    assert method == "UnquantizedEmbeddingMethod"
    assert planner_embedding_bytes(qc) == got == vocab * hidden * 2
