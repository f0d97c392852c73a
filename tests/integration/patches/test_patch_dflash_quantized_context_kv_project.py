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
from dflash_drafters import build_drafters, kernels, patched  # noqa: F401  (shared fixtures and helpers)


def test_stock_without_dualgpu(kernels, patched, monkeypatch):
    quantized, reference = build_drafters(False)
    monkeypatch.setattr(process, "_worker_run", {"pid": None, "run": False})
    with pytest.raises(AttributeError, match="weight"):
        quantized._build_fused_kv_buffers()
    # Unquantized drafters take vLLM's fused GEMM, also under dualgpu.
    monkeypatch.setattr(process, "_worker_run", {"pid": os.getpid(), "run": True})
    reference._build_fused_kv_buffers()
    assert reference._fused_kv_weight is not None
    assert "_vllm_dualgpu_context_kv_layers" not in vars(reference)
