"""kv-drafter-pages-promoted-033 (vLLM 0.33, kv_cache_planning.py). The grouping and page behaviour is tested on the
installed vLLM through the entry in range by tests/test_spec_decode_pp.py (KV groups) and
tests/test_spec_kv_pages.py (drafter pages); here: this entry's checks on the installed vLLM."""

from __future__ import annotations

from _ported import assert_applies_and_reverts, installed_entry_or_skip


def test_applies_and_reverts(vllm_version):
    assert_applies_and_reverts(installed_entry_or_skip("kv-drafter-pages-promoted-033", vllm_version), vllm_version)
