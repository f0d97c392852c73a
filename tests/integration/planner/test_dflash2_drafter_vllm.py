"""The planner's DFlash drafter terms against vLLM's own model class, built on the CPU (on the
meta device: shapes only) from the public Qwen3.8-27B DFlash2 drafter's config
(tests/fixtures/dflash2_drafter.json, ``DFlash2DraftModel``, W4A16): vLLM builds
``qwen3_dflash2.DFlash2Qwen3ForCausalLM`` for it, and its convolutions, candidate selector and
``fc`` hold the bytes the planner charges. vLLM refuses a DFlash2 drafter under its V1 model
runner ("Model Runner V1 does not support: DFlash candidate-head drafts"), which the CPU platform
would pick; the GPU runs the V2 runner, so the config is built with VLLM_USE_V2_MODEL_RUNNER=1."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import v2_runner_or_skip

from vllm_dualgpu import planner as P
from vllm_dualgpu.planner.dflash import dflash2_extras, fc_bytes

FIXTURE = Path(__file__).resolve().parents[2] / "fixtures" / "dflash2_drafter.json"
SHARED = ("model.embed_tokens.", "lm_head.", "model.mask_embedding")  # the target's, or not in a checkpoint
METADATA = ("weight_shape", "k_scale", "v_scale", "q_scale", "prob_scale", "k_zero_point", "v_zero_point",
            "q_zero_point")  # not weights: shapes, the attention layers' KV-cache scales


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("dflash2")
    target = P.reference_config()
    target.pop("_vllm_dualgpu", None)
    (root / "target").mkdir()
    (root / "target" / "config.json").write_text(json.dumps(target))
    (root / "drafter").mkdir()
    (root / "drafter" / "config.json").write_text(FIXTURE.read_text())
    return root


@pytest.fixture
def drafter(engine_config, dirs, monkeypatch):
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.distributed import parallel_state
    from vllm.model_executor.model_loader.utils import get_model_architecture
    from vllm.utils.torch_utils import set_default_torch_dtype

    v2_runner_or_skip(monkeypatch)
    cfg = engine_config(model=str(dirs / "target"), load_format="dummy", skip_tokenizer_init=True,
                        max_model_len=262144, speculative_config={
                            "method": "dflash", "model": str(dirs / "drafter"), "num_speculative_tokens": 7})
    draft = cfg.speculative_config.draft_model_config
    monkeypatch.setattr(parallel_state, "_TP", SimpleNamespace(world_size=1, rank_in_group=0))
    monkeypatch.setattr(parallel_state, "_PP", SimpleNamespace(world_size=1, rank_in_group=0, is_first_rank=True,
                                                               is_last_rank=True))
    cls, _ = get_model_architecture(draft)
    vcfg = copy.copy(cfg)  # the drafter is built with its own model config, as vLLM's loader does
    vcfg.model_config = draft
    try:
        with set_current_vllm_config(cfg), set_default_torch_dtype(draft.dtype), torch.device("meta"):
            model = cls(vllm_config=vcfg, prefix="")
    except AttributeError as exc:  # vLLM 0.30.0's compiled ops with the CPU build of torch
        pytest.skip(f"vLLM's model layers cannot be built here: {exc}")
    return cls, {n: p.numel() * p.element_size() for n, p in model.named_parameters()}


def weights(params: dict, *parts: str) -> int:
    return sum(b for n, b in params.items() if any(f".{p}." in f".{n}" for p in parts)
               and not n.endswith(METADATA))


def test_the_fixture_is_a_dflash2_drafter():
    cfg = json.loads(FIXTURE.read_text())
    assert cfg["architectures"] == ["DFlash2DraftModel"]


def test_the_convolutions_and_selector_hold_what_the_planner_charges(drafter):
    cls, params = drafter
    assert cls.__name__ == "DFlash2Qwen3ForCausalLM"
    extras = dflash2_extras(json.loads(FIXTURE.read_text()), 7)
    assert weights(params, "attention_conv", "mlp_conv", "candidate_selector") == extras.weight_bytes


def test_fc_holds_what_the_planner_charges(drafter):
    _, params = drafter
    assert weights(params, "fc", "hidden_norm") == fc_bytes(json.loads(FIXTURE.read_text()), 5)


def test_the_whole_drafter_is_what_the_planner_charges(drafter):
    """Every weight vLLM builds for the drafter but the target's embedding and head (shared) and
    the mask embedding (no file; vLLM fills it from the target's)."""
    _, params = drafter
    own = sum(b for n, b in params.items() if not n.startswith(SHARED) and not n.endswith(METADATA))
    model = P.ModelSpec.from_hf_config(P.reference_config("qwen3.8-27b"))
    spec = P.DrafterSpec.from_speculative({"method": "dflash", "num_speculative_tokens": 7,
                                           "draft_config": json.loads(FIXTURE.read_text())}, model)
    assert spec.weight_bytes == own
