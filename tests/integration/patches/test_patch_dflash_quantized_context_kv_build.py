"""Issue #6 item 5: a DFlash drafter with packed W4A16 attention weights precomputes context K/V.

Real vLLM objects: ``DFlashQwen3Attention`` layers (QKVParallelLinear, RMSNorm, rotary, Attention)
built on the CPU platform, quantized through a real compressed-tensors W4A16 config (the layer
holds ``weight_packed``/``weight_scale`` and no ``weight``), and vLLM's own
``DFlashQwen3Model`` methods run on a module holding those layers. Faked: only what needs a
compiled kernel (vLLM's ``_C`` ops rms_norm/rotary_embedding, the W4A16 GEMM, the KV-cache write),
each by a plain PyTorch reference.
"""


from __future__ import annotations

import os
import types
import pytest
import torch
from torch import nn
from conftest import registry_patch
from vllm_dualgpu.patching.core import ALREADY, APPLIED, apply_patch, revert_patch
from vllm_dualgpu import process
from dflash_drafters import HEAD_DIM, HIDDEN, KV_HEADS, LAYERS, build_drafters, context_kv, kernels, patched  # noqa: F401  (shared fixtures and helpers)


@pytest.mark.parametrize("bias", [False, True])
def test_w4a16_drafter_context_kv(kernels, patched, monkeypatch, bias):
    model_cls = patched
    quantized, reference = build_drafters(bias)
    states = torch.randn(5, HIDDEN)
    positions = torch.tensor([0, 1, 2, 7, 8])
    monkeypatch.setattr(process, "_worker_run", {"pid": os.getpid(), "run": True})
    expected = context_kv(reference, states, positions)  # unquantized: vLLM's path
    assert reference._fused_kv_weight.shape == (LAYERS * 2 * KV_HEADS * HEAD_DIM, HIDDEN)

    got = context_kv(quantized, states, positions)
    assert len(got) == len(expected) == LAYERS
    for (k, v), (ek, ev) in zip(got, expected):
        assert k.shape == ek.shape == (5, KV_HEADS, HEAD_DIM)
        torch.testing.assert_close(k, ek, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(v, ev, rtol=1e-5, atol=1e-5)

    # vLLM 0.30's own build reads the raw weight the packed layer does not have.
    build = model_cls._build_context_kv_buffers.__wrapped__
    layers_attn = [layer.self_attn for layer in quantized.layers]
    with pytest.raises(AttributeError, match="weight"):
        build(quantized, layers_attn, bias)
