"""qwen3-xml-param-text-in-value-034 (vLLM 0.34, where the converter takes the parser's ``closed``
cache). The behaviour is tested on the installed vLLM through the entry in range by
tests/integration/patches/test_patch_qwen3_xml_param_text_in_value.py; here: this entry's checks
on the installed vLLM, and that a cache vLLM's rule filled changes nothing in what it converts."""

from __future__ import annotations

import json

from _ported import assert_applies_and_reverts, entry, installed_entry_or_skip
from qwen3_xml_parser import applied

NAME = "qwen3-xml-param-text-in-value-034"


def test_applies_and_reverts(vllm_version):
    assert_applies_and_reverts(installed_entry_or_skip(NAME, vllm_version), vllm_version)


def test_closed_declared():
    old, new = entry("qwen3-xml-param-text-in-value"), entry(NAME)
    assert new.params == (*old.params, "closed")


def test_a_cache_filled_by_vllms_rule_changes_nothing(vllm_version):
    """The parser shares one cache between the converter and vLLM's fast path, which fills it
    by vLLM's rule (here: 'x' closed, 'content' cut at '<parameter=x>')."""
    installed_entry_or_skip(NAME, vllm_version)
    from vllm.parser import qwen3

    raw = "\n<parameter=content>\nUse <parameter=x>\nfoo\n</parameter>\n<parameter=path>\na"
    want = {"content": "Use <parameter=x>\nfoo", "path": "a"}
    with applied(NAME):
        closed = qwen3._ClosedParams()
        assert "x" in qwen3._qwen3_parse_params(raw, True, closed)[0]
        assert json.loads(qwen3._qwen3_arg_converter(raw, True, closed)) == want
        done = raw + "\n</parameter>\n"
        assert json.loads(qwen3._qwen3_arg_converter(done, False, closed)) == want
