"""hybrid-block-size-every-stage-032 (vLLM 0.32, 0.33): on vLLM's real Platform and a Qwen3.5
hybrid config, an attention-free stage reaches the block size of an attention stage."""

from __future__ import annotations

from _hybrid_plural import check_entry


def test_entry(vllm_version, qwen3_5_hybrid_config):
    check_entry("hybrid-block-size-every-stage-032", vllm_version, qwen3_5_hybrid_config)
