"""Which speculative configs need auxiliary hidden states relayed between pipeline stages: the
preflight asks what vLLM's runner asks (``requires_aux_hidden_states``, vLLM 0.33's
v1/worker/gpu/spec_decode/eagle/eagle3_utils.py:15-22), so it neither refuses an EAGLE3 drafter
that uses no auxiliary states nor lets a DSpark or extract_hidden_states config reach a worker
that would then refuse it at load."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from vllm_dualgpu.engine import preflight


def spec(method: str, eagle_config=None):
    hf = SimpleNamespace(eagle_config=eagle_config) if eagle_config is not None else SimpleNamespace()
    return SimpleNamespace(method=method, draft_model_config=SimpleNamespace(hf_config=hf))


CASES = [
    ("eagle3", None, True), ("eagle3", {"use_aux_hidden_state": True}, True),
    ("eagle3", {"use_aux_hidden_state": False}, False), ("eagle3", {}, True),
    ("dflash", None, True), ("dspark", None, True), ("extract_hidden_states", None, True),
    ("mtp", None, False), ("eagle", None, False), ("ngram", None, False), ("draft_model", None, False),
]


@pytest.mark.parametrize("method,eagle_config,needs", CASES)
def test_which_methods_need_the_relay(method, eagle_config, needs):
    assert preflight.needs_aux_relay(spec(method, eagle_config)) is needs


@pytest.mark.parametrize("method,eagle_config,needs", CASES)
def test_the_rule_is_vllms(method, eagle_config, needs):
    utils = pytest.importorskip("vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils",
                                reason="this vLLM's runner has no eagle3_utils (new in 0.31+)")
    if not hasattr(utils, "requires_aux_hidden_states"):
        pytest.skip("this vLLM has no requires_aux_hidden_states")
    s = spec(method, eagle_config)
    assert bool(utils.requires_aux_hidden_states(s)) is preflight.needs_aux_relay(s)


def test_an_eagle3_drafter_without_auxiliary_states_is_not_refused(monkeypatch):
    """A target whose decoder relays nothing (Qwen3-MoE on vLLM 0.33) with an EAGLE3 drafter that
    reads no auxiliary states: nothing to relay, so nothing to refuse (it was refused)."""
    from vllm_dualgpu.engine import aux_pp

    monkeypatch.setattr(aux_pp, "find", lambda model_config: pytest.fail("asked the decoder class"))
    cfg = SimpleNamespace(speculative_config=spec("eagle3", {"use_aux_hidden_state": False}),
                          model_config=SimpleNamespace(hf_text_config=SimpleNamespace(model_type="qwen3_moe")))
    preflight._check_drafter(cfg)
