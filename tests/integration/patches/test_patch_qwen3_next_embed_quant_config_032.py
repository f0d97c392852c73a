"""qwen3-next-embed-quant-config-032 (vLLM 0.32+, where __init__ takes reduce_results). The
behaviour is tested on the installed vLLM by tests/integration/patches/test_patch_qwen3_next_embed_quant_config.py through the entry
in range; here: this entry's checks on the installed vLLM."""

from __future__ import annotations

from _ported import assert_applies_and_reverts, entry, installed_entry_or_skip

NAME = "qwen3-next-embed-quant-config-032"


def test_applies_and_reverts(vllm_version):
    assert_applies_and_reverts(installed_entry_or_skip(NAME, vllm_version), vllm_version)


def test_same_wrapper_with_reduce_results_declared():
    old, new = entry("qwen3-next-embed-quant-config"), entry(NAME)
    assert new.factory == old.factory
    assert [p for p in new.params if p not in old.params] == ["reduce_results"]
    assert new.params.index("quant_config") == old.params.index("quant_config") == 6  # self first
