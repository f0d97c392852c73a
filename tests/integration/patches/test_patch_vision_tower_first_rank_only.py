"""Speculative decoding under PP (issue #6): each patch on real vLLM objects, stock vs patched.

Every test shows the stock behaviour (vLLM's original, reached through ``__wrapped__`` or by
reverting the patch) and the patched one, so each fails without its patch.
"""


from __future__ import annotations
import functools
import pickle
import shutil
import sys
import types
import pytest
import torch
from torch import nn
from conftest import apply_registry_patch, registry_patch
from vllm_dualgpu.patching.registry import for_version
from vllm_dualgpu.patching.core import ALREADY, APPLIED, SENTINEL, Patch, apply_patch, revert_patch
from pathlib import Path
from spec_pp import applied, pp_configs  # noqa: F401  (shared fixtures and helpers)


def toy_vl_class():
    """A multimodal model built the way vLLM's Qwen3-VL/Qwen3.5 build theirs."""
    from vllm.model_executor.models.interfaces import SupportsMultiModal

    class ToyVL(nn.Module, SupportsMultiModal):
        def __init__(self, vllm_config):
            super().__init__()
            with self._mark_tower_model(vllm_config, {"image", "video"}):
                self.visual = nn.Linear(64, 64)
            self.lm = nn.Linear(8, 8)

    return ToyVL


def vl_config(pp_config, limit: int | None = None):
    from vllm.config.multimodal import MultiModalConfig

    mm = MultiModalConfig(limit_per_prompt={} if limit is None else {"image": limit, "video": limit})
    model_config = types.SimpleNamespace(get_multimodal_config=lambda: mm)
    return types.SimpleNamespace(
        model_config=model_config,
        parallel_config=pp_config.parallel_config,
        use_v2_model_runner=True,
    )


@pytest.mark.parametrize("first_rank", [False, True])
def test_vision_tower_only_on_the_first_rank(applied, pp_configs, monkeypatch, first_rank):
    import vllm
    from vllm.distributed import parallel_state
    from vllm.model_executor.models.interfaces import SupportsMultiModal
    from vllm.model_executor.models.utils import StageMissingLayer

    name = "vision-tower-first-rank-only"
    patch = applied(name) if for_version(name, vllm.__version__) else None  # fixed in 0.33
    group = types.SimpleNamespace(world_size=2, is_first_rank=first_rank, is_last_rank=not first_rank)
    monkeypatch.setattr(parallel_state, "_PP", group)
    ToyVL = toy_vl_class()
    cfg = vl_config(pp_configs["dualgpu"])

    model = ToyVL(cfg)
    vision_params = sum(p.numel() for n, p in model.named_parameters() if n.startswith("visual"))
    if first_rank:
        assert isinstance(model.visual, nn.Linear) and vision_params == 64 * 64 + 64
    else:
        assert isinstance(model.visual, StageMissingLayer) and vision_params == 0
        assert model.visual.stage_name == "vision_tower"
    assert model._tower_model_names == ["visual"]
    if patch is None:
        return  # vLLM itself built the tower on the first rank only (upstream fix)

    # vLLM 0.30 builds the tower on every rank.
    assert revert_patch(patch)
    try:
        stock = ToyVL(cfg)
        assert isinstance(stock.visual, nn.Linear)
        assert isinstance(vars(SupportsMultiModal)["_mark_tower_model"], types.FunctionType)
    finally:
        import vllm

        assert apply_patch(patch, vllm.__version__).status == APPLIED


def test_vision_tower_stock_for_other_executors_and_disabled_modalities(applied, pp_configs, monkeypatch):
    from vllm.distributed import parallel_state
    from vllm.model_executor.models.utils import StageMissingLayer

    applied("vision-tower-first-rank-only")  # vLLM 0.33 does it itself: skipped there
    group = types.SimpleNamespace(world_size=2, is_first_rank=False, is_last_rank=True)
    monkeypatch.setattr(parallel_state, "_PP", group)
    ToyVL = toy_vl_class()
    assert isinstance(ToyVL(vl_config(pp_configs["mp"])).visual, nn.Linear)
    v1 = vl_config(pp_configs["dualgpu"])
    v1.use_v2_model_runner = False  # the V1 runner may run the encoder on any rank
    assert isinstance(ToyVL(v1).visual, nn.Linear)
    # vLLM's own rule still applies: no images or videos, no tower, on every rank.
    monkeypatch.setattr(group, "is_first_rank", True)
    assert isinstance(ToyVL(vl_config(pp_configs["dualgpu"], limit=0)).visual, StageMissingLayer)
