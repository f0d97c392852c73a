"""qwen3-xml-param-text-in-value-streamed-034 (vLLM 0.34, where the fast path takes the parser's
``closed`` cache). The behaviour is tested on the installed vLLM through the entry in range by
tests/integration/patches/test_patch_qwen3_xml_param_text_in_value_streamed.py; here: this
entry's checks on the installed vLLM."""

from __future__ import annotations

from _ported import assert_applies_and_reverts, entry, installed_entry_or_skip

NAME = "qwen3-xml-param-text-in-value-streamed-034"


def test_applies_and_reverts(vllm_version):
    assert_applies_and_reverts(installed_entry_or_skip(NAME, vllm_version), vllm_version)


def test_closed_declared():
    old, new = entry("qwen3-xml-param-text-in-value-streamed"), entry(NAME)
    assert new.params == (*old.params, "closed")
