"""Shared test of the 0.31+ hybrid-block-size entries (``_find_non_ssm_backends``)."""

from __future__ import annotations

import pytest

from _ported import assert_applies_and_reverts, installed_entry_or_skip, unpatched


def check_entry(name: str, vllm_version: str, qwen3_5_hybrid_config) -> None:
    from vllm.platforms.interface import Platform

    from vllm_dualgpu.patching.core import APPLIED, apply_patch

    patch = installed_entry_or_skip(name, vllm_version)
    assert_applies_and_reverts(patch, vllm_version)

    def sizes(cfg):
        Platform.update_block_size_for_backend(cfg)
        return cfg.cache_config.block_size, cfg.cache_config.mamba_block_size

    # A stage without attention: vLLM's finder returns [] there; stock keeps its start value.
    with unpatched(patch, vllm_version):
        stock = sizes(qwen3_5_hybrid_config())
        assert apply_patch(patch, vllm_version).status == APPLIED
        patched = sizes(qwen3_5_hybrid_config())
        assert patched[0] > stock[0] and patched[1] == patched[0]
        assert sizes(qwen3_5_hybrid_config("mp")) == stock  # other executors: vLLM's behaviour


def plural_finder_required() -> None:
    from vllm.platforms.interface import Platform

    if not hasattr(Platform, "_find_non_ssm_backends"):
        pytest.skip("this vLLM has the singular _find_non_ssm_backend (0.30)")
