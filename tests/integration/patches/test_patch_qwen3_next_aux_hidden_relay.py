"""qwen3-next-aux-hidden-relay: one of the patches that relay auxiliary hidden states across PP stages for
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
from aux_relay import AUX_LAYERS, FLAG, INPUT_IDS, LAYERS, NUM_LAYERS, POSITIONS, RELAY, active, causal_lm, decoder, patched, run, stage  # noqa: F401  (shared fixtures and helpers)


def test_two_stages_give_the_last_stage_every_state_in_order(patched, active, stage):
    from vllm.model_executor.models.qwen3_next import Qwen3NextModel
    from vllm.sequence import IntermediateTensors

    stage(0, 1)
    whole = decoder(Qwen3NextModel, 0, NUM_LAYERS)
    whole._set_aux_hidden_state_layers(AUX_LAYERS)
    ref_hidden, ref_aux = run(whole)
    assert len(ref_aux) == 3

    stage(0, 2)
    first = decoder(Qwen3NextModel, 0, 2)
    first._set_aux_hidden_state_layers(AUX_LAYERS)
    sent = run(first)
    assert isinstance(sent, IntermediateTensors)
    # Layers 1 and 2 are captured on the first stage (inputs of layers 1 and 2).
    assert sorted(sent.tensors) == ["aux_hidden_states_0", "aux_hidden_states_1", "hidden_states", "residual"]
    torch.testing.assert_close(sent["aux_hidden_states_0"], ref_aux[0])
    torch.testing.assert_close(sent["aux_hidden_states_1"], ref_aux[1])

    stage(1, 2)
    last = decoder(Qwen3NextModel, 2, NUM_LAYERS)
    last._set_aux_hidden_state_layers(AUX_LAYERS)
    assert (last._aux_slot_base_cached, last._aux_upstream_total_cached) == (2, 2)
    hidden, aux = run(last, sent)
    torch.testing.assert_close(hidden, ref_hidden)
    assert len(aux) == 3
    for got, want in zip(aux, ref_aux):
        torch.testing.assert_close(got, want)

    # vLLM 0.30's forward: the first stage sends no auxiliary states and the last stage returns
    # only its own, so the drafter would get one state instead of three.
    stock = Qwen3NextModel.forward.__wrapped__
    stage(0, 2)
    stock_sent = stock(first, INPUT_IDS, POSITIONS)
    assert sorted(stock_sent.tensors) == ["hidden_states", "residual"]
    stage(1, 2)
    last._aux_upstream_total_cached = 0  # vLLM's forward never reads the upstream slots
    _, stock_aux = stock(last, None, POSITIONS, stock_sent)
    assert len(stock_aux) == 1


def test_three_stages_relay_through_the_middle(patched, active, stage):
    """The middle stage adds its own slots after the upstream ones; vLLM's PPHandler forwards
    the upstream slots (aux_hidden_state_relay_keys) next to them."""
    from vllm.model_executor.models.qwen3_next import Qwen3NextModel
    from vllm.v1.worker.gpu.pp_utils import PPHandler
    from vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils import aux_hidden_state_relay_keys

    layers = (1, 3, 4)
    stage(0, 1)
    whole = decoder(Qwen3NextModel, 0, NUM_LAYERS)
    whole._set_aux_hidden_state_layers(layers)
    ref_hidden, ref_aux = run(whole)

    stage(0, 3)
    a = decoder(Qwen3NextModel, 0, 1)
    a._set_aux_hidden_state_layers(layers)
    sent_a = run(a)
    assert sorted(k for k in sent_a.tensors if k.startswith("aux")) == ["aux_hidden_states_0"]

    stage(1, 3)
    b = decoder(Qwen3NextModel, 1, 3)
    b._set_aux_hidden_state_layers(layers)
    keys = aux_hidden_state_relay_keys(causal_lm(nn.Module, b))
    assert keys == ("aux_hidden_states_0",)
    out_b = run(b, sent_a)
    assert sorted(k for k in out_b.tensors if k.startswith("aux")) == ["aux_hidden_states_1"]
    sent_b = PPHandler.relay_aux_hidden_states(SimpleNamespace(aux_hidden_state_relay_keys=keys), sent_a, out_b)

    stage(2, 3)
    c = decoder(Qwen3NextModel, 3, NUM_LAYERS)
    c._set_aux_hidden_state_layers(layers)
    hidden, aux = run(c, sent_b)
    torch.testing.assert_close(hidden, ref_hidden)
    assert len(aux) == len(ref_aux) == 3
    for got, want in zip(aux, ref_aux):
        torch.testing.assert_close(got, want)


def test_without_pp_the_forward_computes_what_vllm_does(patched, stage):
    from vllm.model_executor.models.qwen3_next import Qwen3NextModel

    stage(0, 1)
    model = decoder(Qwen3NextModel, 0, NUM_LAYERS)
    stock = Qwen3NextModel.forward.__wrapped__
    torch.testing.assert_close(run(model), stock(model, INPUT_IDS, POSITIONS))  # no aux layers
    model._set_aux_hidden_state_layers((0, 2, 4))
    hidden, aux = run(model)
    stock_hidden, stock_aux = stock(model, INPUT_IDS, POSITIONS)
    torch.testing.assert_close(hidden, stock_hidden)
    assert len(aux) == len(stock_aux) == 3
    for got, want in zip(aux, stock_aux):
        torch.testing.assert_close(got, want)


def test_apply_is_idempotent_and_revert_restores(vllm_version, qwen3_5):
    from vllm.model_executor.models.interfaces import EagleModelMixin
    from vllm.model_executor.models.qwen3_next import Qwen3NextModel

    owners = {RELAY: (Qwen3NextModel, "forward"), FLAG: (EagleModelMixin, "_set_aux_hidden_state_layers"),
              LAYERS: (qwen3_5.Qwen3_5ForCausalLMBase, "set_aux_hidden_state_layers")}
    for name, (owner, attr) in owners.items():
        patch = registry_patch(name)
        revert_patch(patch)
        original = vars(owner)[attr]
        assert apply_patch(patch, vllm_version).status == APPLIED
        replaced = vars(owner)[attr]
        assert getattr(replaced, SENTINEL) == name and replaced.__wrapped__ is original
        assert apply_patch(patch, vllm_version).status == ALREADY and vars(owner)[attr] is replaced
        assert revert_patch(patch) and vars(owner)[attr] is original
        assert not revert_patch(patch)
    # Qwen3.5's decoder inherits the forward; the replacement has no closure (vLLM's bytecode
    # hook swaps its __code__) and a qualname of its own (vLLM's AOT cache key).
    assert "forward" not in vars(qwen3_5.Qwen3_5Model)
    assert apply_patch(registry_patch(RELAY), vllm_version).status == APPLIED
    try:
        assert qwen3_5.Qwen3_5Model.forward is Qwen3NextModel.forward
        assert Qwen3NextModel.forward.__closure__ is None
        assert Qwen3NextModel.forward.__qualname__ != Qwen3NextModel.forward.__wrapped__.__qualname__
    finally:
        revert_patch(registry_patch(RELAY))


@pytest.mark.parametrize("name", [RELAY, LAYERS])
def test_other_source_is_refused_before_anything_changes(vllm_version, qwen3_5, name):
    from vllm_dualgpu.patching.source_check import check_in_file

    patch = registry_patch(name)
    revert_patch(patch)
    # The front end's file check and the worker's live check agree on vLLM's source.
    assert check_patch(patch, vllm_version).status == "ready"
    assert check_in_file(patch.target, patch.params, patch.source_sha256) == ""
    other = dataclasses.replace(patch, source_sha256="0" * 64)
    from vllm_dualgpu.patching.core import _function_of, _raw_attr, _resolve_owner

    before = _function_of(_raw_attr(*_resolve_owner(patch)))
    outcome = apply_patch(other, vllm_version)
    assert outcome.status == SKIPPED and "not the one this patch was written against" in outcome.reason
    assert _function_of(_raw_attr(*_resolve_owner(patch))) is before
    assert "not the one this patch was written against" in check_in_file(other.target, other.params, other.source_sha256)


def drafter_config(model_type: str, method: str = "eagle3", architectures=("Qwen3_5ForConditionalGeneration",)):
    return SimpleNamespace(
        speculative_config=SimpleNamespace(method=method),
        model_config=SimpleNamespace(
            hf_text_config=SimpleNamespace(model_type=model_type),
            hf_config=SimpleNamespace(architectures=list(architectures)),
        ),
    )


@pytest.mark.parametrize(
    "model_type,arch",
    [("qwen3_5_text", "Qwen3_5ForConditionalGeneration"), ("qwen3_5_moe_text", "Qwen3_5MoeForConditionalGeneration"),
     ("qwen3_5_text", "Qwen3_5ForCausalLM"), ("qwen3_next", "Qwen3NextForCausalLM")],
)
@pytest.mark.parametrize("method", ["eagle3", "dflash"])
def test_preflight_accepts_the_family_when_the_relay_applies(model_type, arch, method):
    from vllm_dualgpu.engine import preflight

    before = set(sys.modules)
    preflight._check_drafter(drafter_config(model_type, method, (arch,)))
    # Decided from vLLM's files: no model module is imported in the front end.
    assert not {m for m in set(sys.modules) - before if m.startswith("vllm.model_executor.models.")}


def test_preflight_refuses_when_a_relay_patch_is_missing_or_would_skip(monkeypatch):
    from vllm_dualgpu.engine import preflight
    from vllm_dualgpu.patching import registry

    without = tuple(p for p in PATCHES if p.name != LAYERS)
    monkeypatch.setattr(registry, "PATCHES", without)
    preflight._check_drafter(drafter_config("qwen3_5_text"))  # the multimodal class needs no LAYERS
    with pytest.raises(preflight.PreflightError, match=f"patch {LAYERS} is not in the registry"):
        preflight._check_drafter(drafter_config("qwen3_5_text", architectures=("Qwen3_5ForCausalLM",)))

    pinned_elsewhere = tuple(
        dataclasses.replace(p, source_sha256="0" * 64) if p.name == RELAY else p for p in PATCHES
    )
    monkeypatch.setattr(registry, "PATCHES", pinned_elsewhere)
    with pytest.raises(preflight.PreflightError, match=f"method 'dflash' needs auxiliary.*'qwen3_next'.*{RELAY}.*not the one"):
        preflight._check_drafter(drafter_config("qwen3_next", "dflash"))

    monkeypatch.setattr(registry, "PATCHES", PATCHES)
    from vllm_dualgpu import support

    monkeypatch.setattr(support, "installed_vllm_version", lambda: "0.35.0")
    with pytest.raises(preflight.PreflightError, match="written for vLLM >=0.30.0,<0.35, found 0.35.0"):
        preflight._check_drafter(drafter_config("qwen3_5_text"))


def test_preflight_keeps_refusing_other_model_types_and_accepts_vllms_own():
    import importlib.metadata
    import re

    from vllm_dualgpu.engine import preflight

    named = f"which vLLM {re.escape(importlib.metadata.version('vllm'))} does not do for model type 'deepseek_v3'"
    with pytest.raises(preflight.PreflightError, match=named):
        preflight._check_drafter(drafter_config("deepseek_v3", architectures=("DeepseekV3ForCausalLM",)))
    preflight._check_drafter(drafter_config("llama", architectures=("LlamaForCausalLM",)))
    preflight._check_drafter(drafter_config("qwen3_5_text", method="mtp"))
