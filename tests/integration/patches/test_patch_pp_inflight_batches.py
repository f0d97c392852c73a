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
from vllm_dualgpu.patching.core import ALREADY, APPLIED, SENTINEL, Patch, apply_patch, revert_patch
from pathlib import Path
from spec_pp import applied, pp_configs  # noqa: F401  (shared fixtures and helpers)
from vllm_dualgpu.patches.spec_common import uses_v2_model_runner


def test_inflight_batches_capped_at_pp_size(applied, pp_configs, monkeypatch):
    from vllm.config import VllmConfig

    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    applied("pp-inflight-batches")
    stock = VllmConfig.max_concurrent_batches.fget.__wrapped__
    cfg = pp_configs["dualgpu"]
    assert uses_v2_model_runner(cfg) and cfg.scheduler_config.async_scheduling
    assert stock(cfg) == 3  # vLLM 0.30: pp_size + 1
    assert cfg.max_concurrent_batches == 2
    # Workers unpickle the config and read the same property.
    assert pickle.loads(pickle.dumps(cfg)).max_concurrent_batches == 2
    # max_in_flight_tokens derives from it (scheduler reservations).
    assert cfg.max_in_flight_tokens == 2 * cfg.scheduler_config.max_num_batched_tokens


def test_inflight_batches_stock_elsewhere(applied, pp_configs, monkeypatch):
    from vllm.config import VllmConfig

    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    applied("pp-inflight-batches")
    stock = VllmConfig.max_concurrent_batches.fget.__wrapped__
    for key in ("mp", "dualgpu-pp1"):
        cfg = pp_configs[key]
        assert cfg.max_concurrent_batches == stock(cfg), key
    cfg = pp_configs["dualgpu"]
    if hasattr(cfg, "use_v2_model_runner"):  # vLLM 0.34 has no V1 runner
        monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")  # V1 runner: vLLM returns pp_size
        assert cfg.max_concurrent_batches == stock(cfg) == 2
        monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    cfg.scheduler_config.async_scheduling = False
    try:
        assert cfg.max_concurrent_batches == stock(cfg) == 2
    finally:
        cfg.scheduler_config.async_scheduling = True


def test_inflight_batches_revert_restores_stock(vllm_version, pp_configs, monkeypatch):
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    patch = registry_patch("pp-inflight-batches")
    assert apply_patch(patch, vllm_version).status in (APPLIED, ALREADY)
    assert pp_configs["dualgpu"].max_concurrent_batches == 2
    assert revert_patch(patch)
    assert pp_configs["dualgpu"].max_concurrent_batches == 3
