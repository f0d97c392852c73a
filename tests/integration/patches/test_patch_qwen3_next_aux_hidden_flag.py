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
from aux_relay import FLAG, LAYERS, NUM_LAYERS, RELAY, accept_under_pp, active, causal_lm, decoder, patched, stage  # noqa: F401  (shared fixtures and helpers)


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5_text", "qwen3_5_vl"])
def test_vllm_accepts_eagle3_under_pp_with_the_patches(patched, active, stage, qwen3_5, family):
    from vllm.model_executor.models.qwen3_next import Qwen3NextForCausalLM, Qwen3NextModel

    stage(1, 2)
    if family == "qwen3_next":
        inner = decoder(Qwen3NextModel, 2, NUM_LAYERS)
        model = causal_lm(Qwen3NextForCausalLM, inner)
    else:
        inner = decoder(qwen3_5.Qwen3_5Model, 2, NUM_LAYERS)
        model = causal_lm(qwen3_5.Qwen3_5ForCausalLM, inner)
        if family == "qwen3_5_vl":  # the multimodal class reaches the decoder through the mixin
            vl = qwen3_5.Qwen3_5ForConditionalGeneration.__new__(qwen3_5.Qwen3_5ForConditionalGeneration)
            nn.Module.__init__(vl)
            vl.language_model = model
            vl.get_language_model = lambda lm=model: lm  # as _mark_language_model records it
            vl.make_empty_intermediate_tensors = inner.make_empty_intermediate_tensors
            model = vl
    keys = accept_under_pp(model)
    assert inner.supports_aux_hidden_states_over_pp is True
    assert inner.aux_hidden_state_layers == (1, 2, 3)
    # The last stage receives the two states captured upstream (layers 1 and 2).
    assert sorted(keys) == ["aux_hidden_states_0", "aux_hidden_states_1", "hidden_states", "residual"]
    assert not type(inner).supports_aux_hidden_states_over_pp  # declared per instance only


def test_vllm_refuses_the_stock_classes(vllm_version, qwen3_5, active, stage):
    from vllm.model_executor.models.qwen3_next import Qwen3NextForCausalLM, Qwen3NextModel

    for name in (RELAY, FLAG, LAYERS):
        revert_patch(registry_patch(name))
    stage(1, 2)
    for inner, cls in (
        (decoder(Qwen3NextModel, 2, NUM_LAYERS), Qwen3NextForCausalLM),
        (decoder(qwen3_5.Qwen3_5Model, 2, NUM_LAYERS), qwen3_5.Qwen3_5ForCausalLM),
    ):
        with pytest.raises(ValueError, match="does not support eagle3 with pipeline parallelism"):
            accept_under_pp(causal_lm(cls, inner))
