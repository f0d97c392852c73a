"""Patches of ``vllm.model_executor.models.qwen3_dflash``: context K/V of a DFlash drafter whose
attention projections are quantized.

Before each draft step the DFlash drafter projects the target's context hidden states to K/V for
all its layers at once. vLLM 0.30 prepares that at load time in
``DFlashQwen3Model._build_context_kv_buffers`` by slicing and concatenating the raw
``qkv_proj.weight`` of every layer, and ``_project_context_kv`` runs one ``F.linear`` over the
result. A quantized projection has no such tensor: a packed W4A16 (compressed-tensors) layer
holds ``weight_packed``/``weight_scale`` and loading raises ``AttributeError: ...
'weight'``; an FP8 layer has a ``weight`` that F.linear cannot multiply (and that the kernel
re-lays out after loading).

Under the dualgpu executor, when any layer's ``qkv_proj`` is quantized (its quant method is not
vLLM's ``UnquantizedLinearMethod``), the patched build keeps references to the projections
instead of their weights, and the patched projection runs each layer's own quant method (the
kernel vLLM chose, after its post-load repacking) on the normed context and keeps the K/V
columns, in the layout the fused GEMM produces. The per-layer GEMMs also compute the Q columns,
which the context path discards; that runs eagerly, outside CUDA graphs, as vLLM's fused GEMM
does. Unquantized drafters and other executors take vLLM's code unchanged. DFlash2 and the Qwen3
DSpark drafter inherit both methods; Laguna DFlash and Gemma4 DSpark define their own and are
not affected.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from vllm_dualgpu.patches.spec_common import is_dualgpu_run

CONTEXT_KV_LAYERS = "_vllm_dualgpu_context_kv_layers"
"""Attribute holding ``((qkv_proj, q_size), ...)`` when the quantized path is taken."""


def quantized_projection(proj) -> bool:
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod

    return not isinstance(getattr(proj, "quant_method", None), UnquantizedLinearMethod)


def wrap_build_context_kv_buffers(original: Callable) -> Callable:
    @functools.wraps(original)
    def _build_context_kv_buffers(self, layers_attn, has_bias) -> None:
        if not is_dualgpu_run() or not any(quantized_projection(a.qkv_proj) for a in layers_attn):
            self.__dict__.pop(CONTEXT_KV_LAYERS, None)
            return original(self, layers_attn, has_bias)
        # vLLM's buffers, except the fused KV weight and bias the quantized layers do not have.
        self._hidden_norm_weight = self.hidden_norm.weight.data
        self._fused_kv_weight = None
        self._fused_kv_bias = None
        self._k_norm_weights = torch.stack(
            [a.k_norm.weight.data for a in layers_attn], dim=0
        ).contiguous()
        # A tuple is not registered as submodules (no duplicate parameters in state dicts).
        setattr(self, CONTEXT_KV_LAYERS, tuple((a.qkv_proj, a.q_size) for a in layers_attn))
        return None

    return _build_context_kv_buffers


def wrap_project_context_kv(original: Callable) -> Callable:
    @functools.wraps(original)
    def _project_context_kv(self, context_states, num_ctx, num_layers, num_kv_heads, head_dim):
        layers = self.__dict__.get(CONTEXT_KV_LAYERS)
        if layers is None:
            return original(self, context_states, num_ctx, num_layers, num_kv_heads, head_dim)
        from vllm import _custom_ops as ops

        normed = torch.empty_like(context_states)
        ops.rms_norm(normed, context_states, self._hidden_norm_weight, self._rms_norm_eps)
        # Each layer's K and V columns, as the fused GEMM lays them out: [num_ctx, L, 2 * kv].
        kv = torch.stack(
            [proj.quant_method.apply(proj, normed, proj.bias)[:, q:] for proj, q in layers], dim=1
        )
        all_kv = kv.view(num_ctx, num_layers, 2, num_kv_heads, head_dim).permute(2, 1, 0, 3, 4)
        all_kv = all_kv.contiguous()
        return all_kv[0], all_kv[1]

    return _project_context_kv
