"""qwen3-next-aux-hidden-flag: one of the patches that relay auxiliary hidden states across PP stages for
Qwen3-Next/Qwen3.5 (issue #6, item 4). How the tests are built, and what is vLLM's own: the
docstring of tests/integration/patches/aux_relay.py, which holds the shared fixtures."""


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
