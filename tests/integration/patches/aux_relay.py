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


RELAY, FLAG, LAYERS = "qwen3-next-aux-hidden-relay", "qwen3-next-aux-hidden-flag", "qwen3-5-aux-hidden-layers"


HIDDEN, VOCAB, NUM_LAYERS = 8, 32, 4


AUX_LAYERS = (3, 1, 2)  # unsorted, as drafter configs may give them


@pytest.fixture
def patched(vllm_version, qwen3_5):
    """The three registry patches, applied for the test and reverted afterwards."""
    done = []
    for name in (RELAY, FLAG, LAYERS):
        outcome = apply_patch(registry_patch(name), vllm_version)
        assert outcome.status in (APPLIED, ALREADY), outcome.reason
        done.append(registry_patch(name))
    yield
    for patch in done:
        revert_patch(patch)


@pytest.fixture
def active(monkeypatch):
    monkeypatch.setattr(process, "_worker_run", {"pid": os.getpid(), "run": True})


@pytest.fixture
def stage(pp_stage):
    return pp_stage


class StubLayer(nn.Module):
    """Stands in for a Qwen3-Next decoder layer (GDN layers need Triton)."""

    use_attn_reduce_scatter_for_moe = False  # read by Qwen3NextModel.use_sequence_parallel

    def __init__(self, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        self.proj = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, positions, hidden_states, residual):
        residual = hidden_states if residual is None else hidden_states + residual
        return torch.tanh(self.proj(residual)), residual


class StubNorm(nn.Module):
    def forward(self, hidden_states, residual):
        x = hidden_states + residual
        return x / x.norm(dim=-1, keepdim=True), x


LAYER_STACK = nn.ModuleList(StubLayer(i) for i in range(NUM_LAYERS))


EMBED = nn.Embedding(VOCAB, HIDDEN)


def decoder(cls, start: int, end: int):
    """A ``cls`` (Qwen3NextModel or Qwen3_5Model) holding layers [start, end) of the stub stack."""
    from vllm.model_executor.models.utils import make_empty_intermediate_tensors_factory

    model = cls.__new__(cls)
    nn.Module.__init__(model)
    model.config = SimpleNamespace(hidden_size=HIDDEN)
    model.embed_tokens = EMBED
    model.layers = LAYER_STACK
    model.start_layer, model.end_layer = start, end
    model.norm = StubNorm()
    model.aux_hidden_state_layers = ()
    model.do_not_compile = True  # vLLM's compile wrapper then calls self.forward
    model.make_empty_intermediate_tensors = make_empty_intermediate_tensors_factory(
        ["hidden_states", "residual"], HIDDEN
    )
    return model


def causal_lm(cls, inner):
    """A ``cls`` (a Qwen3-Next/Qwen3.5 *ForCausalLM) around ``inner``, built without __init__."""
    model = cls.__new__(cls)
    nn.Module.__init__(model)
    model.model = inner
    model.make_empty_intermediate_tensors = inner.make_empty_intermediate_tensors
    return model


def spec_config(layers=AUX_LAYERS):
    hf = SimpleNamespace(eagle_aux_hidden_state_layer_ids=list(layers))
    return SimpleNamespace(draft_model_config=SimpleNamespace(hf_config=hf))


INPUT_IDS = torch.tensor([1, 5, 7, 30, 2])


POSITIONS = torch.arange(5)


def run(model, intermediate=None):
    ids = INPUT_IDS if intermediate is None else None
    return model(ids, POSITIONS, intermediate_tensors=intermediate)


def accept_under_pp(model) -> dict:
    """What the V2 runner does at load time on the last of two stages (model_runner.py:409-418)."""
    from vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils import (
        set_eagle3_aux_hidden_state_layers,
        verify_supports_aux_hidden_states_over_pp,
    )

    set_eagle3_aux_hidden_state_layers(model, spec_config())
    verify_supports_aux_hidden_states_over_pp(model, "eagle3")
    return model.make_empty_intermediate_tensors(3, torch.float32, "cpu").tensors
