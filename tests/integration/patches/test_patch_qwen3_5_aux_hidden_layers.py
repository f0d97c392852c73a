"""Issue #6, item 4: the Qwen3-Next/Qwen3.5 decoder relays auxiliary hidden states across PP
stages, so vLLM accepts EAGLE3/DFlash drafters under PP for these models.

vLLM's real classes, functions and patched forward are used throughout. The decoder layers are
not: Gated DeltaNet layers need Triton kernels (no CPU path), so each decoder instance is built
without ``__init__`` and given tiny torch layers and a norm with the same call signature
(``layer(positions=, hidden_states=, residual=) -> (hidden_states, residual)``); everything the
relay touches (the forward, vLLM's ``EagleModelMixin``, the runner's eagle3 utilities and
``PPHandler.relay_aux_hidden_states``) is vLLM's or the patch's own code. The PP group is a
stand-in (``parallel_state._PP``), as in tests/integration/patches/test_patch_{pp_inflight_batches,drafter_shares_target_embed,kv_groups_without_padding,vision_tower_first_rank_only}.py.

``vllm.model_executor.models.qwen3_5`` imports a transformers module that needs torchvision;
the ``qwen3_5`` fixture (conftest.py) makes vLLM's Qwen3.5 classes load without it.
"""


from __future__ import annotations
import dataclasses
import sys
from types import SimpleNamespace
import pytest
import torch
from torch import nn
from conftest import registry_patch
from vllm_dualgpu.patching.core import (
    ALREADY,
    APPLIED,
    SENTINEL,
    SKIPPED,
    apply_patch,
    check_patch,
    revert_patch,
)
from vllm_dualgpu.patching.registry import PATCHES
from vllm_dualgpu.process import ACTIVE_ENV
from aux_relay import AUX_LAYERS, FLAG, LAYERS, NUM_LAYERS, RELAY, accept_under_pp, active, causal_lm, decoder, patched, stage  # noqa: F401  (shared fixtures and helpers)


@pytest.mark.parametrize("missing", [RELAY, FLAG, LAYERS])
def test_any_missing_piece_leaves_vllms_refusal(vllm_version, qwen3_5, active, stage, missing):
    """Each patch alone changes nothing vLLM checks: the declaration needs the forward, and the
    text-only Qwen3.5 class needs its layers set through the mixin."""
    for name in (RELAY, FLAG, LAYERS):
        if name == missing:
            revert_patch(registry_patch(name))
        else:
            assert apply_patch(registry_patch(name), vllm_version).status in (APPLIED, ALREADY)
    try:
        stage(1, 2)
        inner = decoder(qwen3_5.Qwen3_5Model, 2, NUM_LAYERS)
        with pytest.raises(ValueError, match="does not support eagle3"):
            accept_under_pp(causal_lm(qwen3_5.Qwen3_5ForCausalLM, inner))
    finally:
        for name in (RELAY, FLAG, LAYERS):
            revert_patch(registry_patch(name))


def test_other_executors_keep_vllms_refusal(patched, stage, monkeypatch, qwen3_5):
    monkeypatch.delenv(ACTIVE_ENV, raising=False)
    stage(1, 2)
    inner = decoder(qwen3_5.Qwen3_5Model, 2, NUM_LAYERS)
    with pytest.raises(ValueError, match="does not support eagle3"):
        accept_under_pp(causal_lm(qwen3_5.Qwen3_5ForCausalLM, inner))
    assert inner.aux_hidden_state_layers == AUX_LAYERS  # vLLM's own method ran (unsorted)
