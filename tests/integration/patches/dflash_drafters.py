"""Issue #6 item 5: a DFlash drafter with packed W4A16 attention weights precomputes context K/V.

Real vLLM objects: ``DFlashQwen3Attention`` layers (QKVParallelLinear, RMSNorm, rotary, Attention)
built on the CPU platform, quantized through a real compressed-tensors W4A16 config (the layer
holds ``weight_packed``/``weight_scale`` and no ``weight``), and vLLM's own
``DFlashQwen3Model`` methods run on a module holding those layers. Faked: only what needs a
compiled kernel (vLLM's ``_C`` ops rms_norm/rotary_embedding, the W4A16 GEMM, the KV-cache write),
each by a plain PyTorch reference.
"""


from __future__ import annotations
import types
import pytest
import torch
from torch import nn
from conftest import registry_patch
from vllm_dualgpu.patching.core import ALREADY, APPLIED, apply_patch, revert_patch, version_in_range


HIDDEN, HEADS, KV_HEADS, HEAD_DIM, GROUP, LAYERS = 64, 4, 2, 32, 32, 2


NAMES = ("dflash-quantized-context-kv-build", "dflash-quantized-context-kv-project")


W4A16 = {
    "quant_method": "compressed-tensors",
    "format": "pack-quantized",
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                        "group_size": GROUP, "dynamic": False, "actorder": None},
            "input_activations": None,
            "output_activations": None,
            "format": "pack-quantized",
        }
    },
    "ignore": ["lm_head"],
}


def rms_norm_ref(out, x, weight, eps):
    """vLLM's rms_norm op; a [L, D] weight applies per outermost index (the grouped K-norm)."""
    if weight.dim() == 2:
        weight = weight.view(weight.shape[0], *([1] * (x.dim() - 2)), weight.shape[1])
    xf = x.float()
    out.copy_(xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float())


def rotary_ref(positions, query, key, head_size, cos_sin_cache, is_neox):
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    q, _ = RotaryEmbedding.forward_static(
        positions, query, None, head_size, head_size, cos_sin_cache, is_neox
    )
    query.copy_(q)


def dequantize(layer) -> torch.Tensor:
    """The [out, in] weight of a compressed-tensors W4A16 layer (checkpoint layout, uint4b8)."""
    from vllm.model_executor.layers.quantization.utils.quant_utils import (
        unpack_quantized_values_into_int32,
    )
    from vllm.scalar_type import scalar_types

    q = unpack_quantized_values_into_int32(layer.weight_packed.data, scalar_types.uint4b8, 1)
    scale = layer.weight_scale.data
    return (q - 8).to(scale.dtype) * scale.repeat_interleave(GROUP, 1)


def w4a16_gemm_ref(self, layer, x, bias=None):
    out = x @ dequantize(layer).t()
    return out if bias is None else out + bias


@pytest.fixture
def kernels(monkeypatch, vllm_version):
    """One TP rank, and PyTorch references for the ops that need vLLM's compiled kernels."""
    from vllm import _custom_ops
    from vllm.distributed import parallel_state
    from vllm.model_executor.kernels.linear.mixed_precision.cpu import CPUWNA16LinearKernel

    monkeypatch.setattr(parallel_state, "_TP", types.SimpleNamespace(world_size=1, rank_in_group=0))
    monkeypatch.setattr(_custom_ops, "rms_norm", rms_norm_ref)
    monkeypatch.setattr(_custom_ops, "rotary_embedding", rotary_ref)
    monkeypatch.setattr(CPUWNA16LinearKernel, "apply_weights", w4a16_gemm_ref)


@pytest.fixture
def patched(vllm_version):
    from vllm.model_executor.models.qwen3_dflash import DFlashQwen3Model

    patches = [registry_patch(n) for n in NAMES]
    if not all(version_in_range(vllm_version, p.vllm_versions) for p in patches):
        pytest.skip("fixed upstream in vLLM 0.31.0 (qwen3_dflash.py _build_context_kv_buffers); "
                    "these tests drive the patch's code path")
    for p in patches:
        assert apply_patch(p, vllm_version).status in (APPLIED, ALREADY)
    yield DFlashQwen3Model
    for p in patches:
        revert_patch(p)


def drafter(attns, hidden_norm):
    """A DFlashQwen3Model holding only what its context-K/V methods read (layers[i].self_attn,
    hidden_norm); the rest of its __init__ needs a speculative config."""
    from vllm.model_executor.models.qwen3_dflash import DFlashQwen3Model

    model = DFlashQwen3Model.__new__(DFlashQwen3Model)
    nn.Module.__init__(model)
    model.layers = nn.ModuleList()
    for attn in attns:
        layer = nn.Module()
        layer.self_attn = attn
        model.layers.append(layer)
    model.hidden_norm = hidden_norm
    return model


_built = iter(range(10**6))  # Attention refuses a layer name twice per config


def build_drafters(bias: bool):
    """A W4A16 drafter and an unquantized one holding its dequantized weights."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.layernorm import RMSNorm
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import (
        CompressedTensorsConfig,
    )
    from vllm.model_executor.layers.quantization.utils.quant_utils import (
        pack_quantized_values_into_int32,
    )
    from vllm.model_executor.models.qwen3_dflash import DFlashQwen3Attention
    from vllm.scalar_type import scalar_types

    torch.manual_seed(0)
    quant = CompressedTensorsConfig.from_config(W4A16)
    hidden_norm = torch.rand(HIDDEN) + 0.5
    drafters = []
    with set_current_vllm_config(VllmConfig()):
        for quant_config in (quant, None):
            attns = [
                DFlashQwen3Attention(
                    hidden_size=HIDDEN, num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                    attention_bias=bias, quant_config=quant_config,
                    prefix=f"t{next(_built)}.layers.{i}.self_attn",
                )
                for i in range(LAYERS)
            ]
            norm = RMSNorm(HIDDEN, eps=1e-6)
            norm.weight.data.copy_(hidden_norm)
            drafters.append(drafter(attns, norm))
    quantized, reference = drafters
    for qa, ra in zip(quantized.layers, reference.layers):
        qproj, rproj = qa.self_attn.qkv_proj, ra.self_attn.qkv_proj
        assert not hasattr(qproj, "weight") and qproj.weight_packed.dtype == torch.int32
        out = qproj.weight_packed.shape[0]
        q = torch.randint(0, 16, (out, HIDDEN), dtype=torch.int32)
        qproj.weight_packed.data.copy_(pack_quantized_values_into_int32(q, scalar_types.uint4b8, 1))
        qproj.weight_scale.data.copy_(torch.rand(out, HIDDEN // GROUP) / 8 + 0.01)
        rproj.weight.data.copy_(dequantize(qproj))
        if bias:
            b = torch.randn(out)
            qproj.bias.data.copy_(b)
            rproj.bias.data.copy_(b)
        k_norm = torch.rand(HEAD_DIM) + 0.5
        qa.self_attn.k_norm.weight.data.copy_(k_norm)
        ra.self_attn.k_norm.weight.data.copy_(k_norm)
    return quantized, reference


def context_kv(drafter, states, positions):
    """Run vLLM's build + precompute; return the K/V each layer writes into its cache."""
    written = []
    for layer in drafter.layers:
        attn = layer.self_attn.attn
        attn.impl = types.SimpleNamespace(
            do_kv_cache_update=lambda a, k, v, cache, slots: written.append((k.clone(), v.clone()))
        )
    drafter._build_fused_kv_buffers()
    drafter.precompute_and_store_context_kv(states, positions, torch.arange(states.shape[0]))
    return written
