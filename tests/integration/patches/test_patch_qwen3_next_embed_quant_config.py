"""Issue #6 item 4: the Qwen3-Next/Qwen3.5 family's token embeddings get the model's quantization
config (``qwen3-next-embed-quant-config``).

vLLM's real ``Qwen3_5Model`` and ``Qwen3_5MultiTokenPredictor`` are built on the CPU from the
real ``VllmConfig`` of the GPU runs' small Qwen3.5 hybrid, with a real compressed-tensors config
whose INT8 group scheme targets the embeddings (the format vLLM loads with
``CompressedTensorsEmbeddingWNA16Int``). The stage built is a later PP stage holding no decoder
layer (Qwen3.5 builds ``embed_tokens`` on every stage), so no Gated DeltaNet kernel is needed.
"""

from __future__ import annotations

import os

from types import SimpleNamespace

import pytest
import torch

from vllm_dualgpu.patching.core import ALREADY, APPLIED, apply_patch, revert_patch
from vllm_dualgpu.patching.registry import for_version
from vllm_dualgpu import process

NAME = "qwen3-next-embed-quant-config"
VOCAB, HIDDEN, GROUP = 8192, 1024, 128


def embedding_quant_config():
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import (
        CompressedTensorsConfig,
    )

    int8_group = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "group", "group_size": GROUP}
    return CompressedTensorsConfig.from_config({
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "config_groups": {"embeddings": {"targets": ["re:.*embed_tokens$"], "weights": int8_group}},
        "ignore": ["lm_head"],
    })


@pytest.fixture
def patched(vllm_version):
    patch = for_version(NAME, vllm_version)  # 0.32 added reduce_results: one entry each
    assert apply_patch(patch, vllm_version).status in (APPLIED, ALREADY)
    yield patch
    revert_patch(patch)


@pytest.fixture
def later_stage(pp_stage, monkeypatch):
    """This process is the last of two PP stages and holds no decoder layer."""
    from vllm.distributed import utils

    pp_stage(1, 2)
    monkeypatch.setattr(utils, "get_pp_indices", lambda n, rank, size: (n, n))


@pytest.fixture
def build(qwen3_5_hybrid_config, later_stage):
    """build(cls, prefix, backend="dualgpu", quantized=True) -> an instance of vLLM's class."""
    from vllm.config.vllm import set_current_vllm_config

    def _build(cls, prefix: str, backend: str = "dualgpu", quantized: bool = True):
        cfg = qwen3_5_hybrid_config(backend)
        cfg.quant_config = embedding_quant_config() if quantized else None
        default = torch.get_default_dtype()
        torch.set_default_dtype(cfg.model_config.dtype)
        try:
            with set_current_vllm_config(cfg):
                return cls(vllm_config=cfg, prefix=prefix)
        finally:
            torch.set_default_dtype(default)

    return _build


@pytest.fixture
def mtp_module(qwen3_5, monkeypatch):
    """vLLM's qwen3_5_mtp; its decoder layer (built after the embedding) needs vLLM's compiled
    ops, so it is a plain module here."""
    from vllm.model_executor.models import qwen3_5_mtp

    monkeypatch.setattr(qwen3_5_mtp, "Qwen3_5DecoderLayer", lambda *a, **k: torch.nn.Identity())
    return qwen3_5_mtp


def params(module) -> set[str]:
    return {name for name, _ in module.embed_tokens.named_parameters()}


def packed_checkpoint(prefix: str, seed: int = 0) -> dict[str, torch.Tensor]:
    """An INT8 group-quantized embedding as a compressed-tensors checkpoint stores it (random
    packed words: loading does not look inside them)."""
    g = torch.Generator().manual_seed(seed)
    packed = torch.randint(-2**31, 2**31 - 1, (VOCAB, HIDDEN // 4), generator=g, dtype=torch.int32)
    scale = (torch.rand(VOCAB, HIDDEN // GROUP, generator=g) / 64 + 1e-3).to(torch.bfloat16)
    return {f"{prefix}.weight_packed": packed, f"{prefix}.weight_scale": scale,
            f"{prefix}.weight_shape": torch.tensor([VOCAB, HIDDEN])}


@pytest.fixture
def active(monkeypatch):
    monkeypatch.setattr(process, "_worker_run", {"pid": os.getpid(), "run": True})


def test_stock_builds_a_dense_table_for_a_quantized_embedding(vllm_version, build, qwen3_5, active):
    """The problem, with vLLM's own classes: the checkpoint's packed weights have nowhere to go."""
    assert for_version(NAME, vllm_version).target  # declared
    model = build(qwen3_5.Qwen3_5Model, "model")
    assert type(model.embed_tokens.quant_method).__name__ == "UnquantizedEmbeddingMethod"
    assert params(model) == {"weight"}


def test_patched_model_embedding_is_quantized(patched, build, qwen3_5, active):
    model = build(qwen3_5.Qwen3_5Model, "model")
    assert type(model.embed_tokens.quant_method).__name__ == "CompressedTensorsEmbeddingWNA16Int"
    assert {"weight_packed", "weight_scale"} <= params(model)
    assert "weight" not in params(model)
    assert model.embed_tokens.weight_packed.numel() * 4 == VOCAB * HIDDEN  # int8, four to a word: half a bf16 table's bytes


def test_rank_summary_names_each_completed_embedding(patched, build, qwen3_5, mtp_module, active):
    from vllm_dualgpu import rank_summary
    from vllm_dualgpu.patches.vocab_embedding import SUMMARY_KEY

    rank_summary.clear()
    try:
        build(qwen3_5.Qwen3_5Model, "model")
        build(mtp_module.Qwen3_5MultiTokenPredictor, "mtp")
        assert rank_summary.facts()[SUMMARY_KEY] == (
            "model.embed_tokens CompressedTensorsEmbeddingWNA16Int, mtp.embed_tokens CompressedTensorsEmbeddingWNA16Int")
        rank_summary.clear()
        build(qwen3_5.Qwen3_5Model, "model", quantized=False)  # nothing completed, nothing said
        assert SUMMARY_KEY not in rank_summary.facts()
    finally:
        rank_summary.clear()


def test_patched_mtp_embedding_is_quantized(patched, build, mtp_module, active):
    mtp = build(mtp_module.Qwen3_5MultiTokenPredictor, "mtp")
    assert type(mtp.embed_tokens.quant_method).__name__ == "CompressedTensorsEmbeddingWNA16Int"
    assert "weight_packed" in params(mtp)


def test_quantized_embedding_loads(patched, build, qwen3_5, active):
    """Through the model's own load_weights, the checkpoint's tensors land unchanged (the lookup
    itself is a Triton kernel: GPU only)."""
    model = build(qwen3_5.Qwen3_5Model, "model")
    weights = packed_checkpoint("embed_tokens")
    loaded = model.load_weights(weights.items())
    assert {"embed_tokens.weight_packed", "embed_tokens.weight_scale"} <= loaded
    assert torch.equal(model.embed_tokens.weight_packed.data, weights["embed_tokens.weight_packed"])
    assert torch.equal(model.embed_tokens.weight_scale.data, weights["embed_tokens.weight_scale"])


def test_stock_cannot_load_the_quantized_checkpoint(build, qwen3_5, active, vllm_version):
    model = build(qwen3_5.Qwen3_5Model, "model")
    with pytest.raises((KeyError, ValueError), match="weight_packed"):
        model.load_weights(packed_checkpoint("embed_tokens").items())


def test_other_executors_keep_vllms_dense_table(patched, build, qwen3_5, monkeypatch):
    monkeypatch.setattr(process, "_worker_run", {"pid": None, "run": False})
    model = build(qwen3_5.Qwen3_5Model, "model", backend="mp")
    assert params(model) == {"weight"}


def test_without_quantization_nothing_changes(patched, build, qwen3_5, active):
    model = build(qwen3_5.Qwen3_5Model, "model", quantized=False)
    assert type(model.embed_tokens.quant_method).__name__ == "UnquantizedEmbeddingMethod"
    assert params(model) == {"weight"}


def test_other_callers_and_explicit_configs_are_left_alone(patched, active, later_stage):
    """Only the four vLLM methods that omit quant_config are completed; a caller that passes
    one (as Qwen2 and Llama do, and these will once vLLM passes it) is unchanged."""
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    # The same local names as vLLM's methods: the patch goes by the caller's code, not its names.
    vllm_config = SimpleNamespace(quant_config=embedding_quant_config())
    prefix = "model"
    assert vllm_config.quant_config is not None and prefix
    plain = VocabParallelEmbedding(VOCAB, HIDDEN)
    explicit = VocabParallelEmbedding(VOCAB, HIDDEN, quant_config=None, prefix="model.embed_tokens")
    assert {n for n, _ in plain.named_parameters()} == {"weight"}
    assert {n for n, _ in explicit.named_parameters()} == {"weight"}


def test_apply_is_idempotent_and_revert_restores(vllm_version):
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    original = VocabParallelEmbedding.__init__
    patch = for_version(NAME, vllm_version)
    assert apply_patch(patch, vllm_version).status == APPLIED
    try:
        assert apply_patch(patch, vllm_version).status == ALREADY
    finally:
        assert revert_patch(patch)
    assert VocabParallelEmbedding.__init__ is original
