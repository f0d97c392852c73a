"""Issue #6: every pipeline stage of a hybrid model reaches the same KV block size.

Found on GPUs: the plugin split the small Qwen3.5 hybrid 1/7, so stage 0 held one Gated DeltaNet
layer and no attention layer, and the engine ran with 16-token blocks where one GPU used 144:
vLLM's ``update_block_size_for_backend`` returns early on such a stage, while a stage with
attention raises the block size to fit a GDN state. These tests use vLLM's real ``VllmConfig`` of a Qwen3.5 hybrid with PP=2 and a real
``Attention`` layer for "the stage with attention"; vLLM's CPU platform selects the backend here,
so the sizes are the CPU backend's, and the comparison is stage against stage, as on the GPU.
"""

from __future__ import annotations

import logging

import pytest
import torch

from vllm_dualgpu.patching.core import APPLIED, apply_patch, revert_patch
from vllm_dualgpu.patching.registry import for_version

NAME = "hybrid-block-size-every-stage"  # one entry per vLLM API: _find_non_ssm_backend(s)


@pytest.fixture(scope="module")
def make_config(qwen3_5_hybrid_config):
    def make(backend: str = "dualgpu", with_attention: bool = False, **kw):
        cfg = qwen3_5_hybrid_config(backend, **kw)
        if with_attention:  # a stage holding layer 3, a full-attention layer, as vLLM builds it
            from vllm.config.vllm import set_current_vllm_config
            from vllm.model_executor.layers.attention.attention import Attention

            mc, hf = cfg.model_config, cfg.model_config.hf_text_config
            default = torch.get_default_dtype()
            torch.set_default_dtype(mc.dtype)
            try:
                with set_current_vllm_config(cfg):
                    Attention(hf.num_attention_heads, mc.get_head_size(), 1.0,
                              num_kv_heads=hf.num_key_value_heads, cache_config=cfg.cache_config,
                              prefix="model.layers.3.self_attn.attn")
            finally:
                torch.set_default_dtype(default)
        return cfg

    return make


@pytest.fixture
def patched(vllm_version):
    patch = for_version(NAME, vllm_version)
    outcome = apply_patch(patch, vllm_version)
    assert outcome.status == APPLIED, outcome.reason
    yield patch
    revert_patch(patch)


def sizes(cfg) -> tuple:
    from vllm.platforms.interface import Platform

    Platform.update_block_size_for_backend(cfg)
    cc = cfg.cache_config
    return cc.block_size, cc.mamba_block_size, cc.mamba_page_size_padded


def test_stock_stages_disagree(make_config):
    """The bug, with vLLM's own code: the attention-free stage keeps its start value."""
    with_attn = sizes(make_config(with_attention=True))
    without = sizes(make_config())
    assert with_attn[0] > without[0]
    assert with_attn[1] == with_attn[0]  # align mode: Mamba states every block
    assert without[1] != with_attn[1]  # the stages cache Mamba states at different positions


def test_patched_attention_free_stage_matches_the_attention_stage(patched, make_config, caplog):
    caplog.set_level(logging.INFO, logger="vllm.dualgpu")
    reference = sizes(make_config(with_attention=True))
    assert sizes(make_config()) == reference
    assert "holds no attention layer" in caplog.text


def test_patched_attention_stage_is_unchanged(patched, make_config, vllm_version):
    patched_value = sizes(make_config(with_attention=True))
    revert_patch(patched)
    try:
        assert sizes(make_config(with_attention=True)) == patched_value
    finally:
        apply_patch(patched, vllm_version)


def test_other_executors_keep_vllms_behaviour(patched, make_config):
    cfg = make_config(backend="mp")
    before = cfg.cache_config.block_size
    assert sizes(cfg)[0] == before


def test_user_block_size_is_a_floor_as_in_vllm(patched, make_config):
    """A --block-size the model cannot use is raised on every stage alike (vLLM's phase 2)."""
    reference = sizes(make_config(with_attention=True, block_size=16))
    got = sizes(make_config(block_size=16))
    assert got == reference and got[0] >= 16


def test_a_backend_that_cannot_be_selected_leaves_vllms_behaviour_loudly(patched, make_config, monkeypatch, caplog):
    from vllm_dualgpu.patches import platforms_interface

    def broken(_cfg):
        raise RuntimeError("no backend for this head size")

    monkeypatch.setattr(platforms_interface, "model_attention_backend", broken)
    caplog.set_level(logging.WARNING, logger="vllm.dualgpu")
    cfg = make_config()
    before = cfg.cache_config.block_size
    assert sizes(cfg)[0] == before
    assert "could not be selected" in caplog.text and "--block-size" in caplog.text
