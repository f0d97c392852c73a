"""qwen3-5-aux-hidden-layers: one of the patches that relay auxiliary hidden states across PP stages for
Qwen3-Next/Qwen3.5 (issue #6, item 4). How the tests are built, and what is vLLM's own: the
docstring of tests/integration/patches/aux_relay.py, which holds the shared fixtures."""


from __future__ import annotations

import os
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
from vllm_dualgpu import process
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
    monkeypatch.setattr(process, "_worker_run", {"pid": None, "run": False})
    stage(1, 2)
    inner = decoder(qwen3_5.Qwen3_5Model, 2, NUM_LAYERS)
    with pytest.raises(ValueError, match="does not support eagle3"):
        accept_under_pp(causal_lm(qwen3_5.Qwen3_5ForCausalLM, inner))
    assert inner.aux_hidden_state_layers == AUX_LAYERS  # vLLM's own method ran (unsorted)
