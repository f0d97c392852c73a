"""kv-drafter-pages-promoted-033 (vLLM 0.33, kv_cache_planning.py). The grouping and page behaviour is tested on the
installed vLLM through the entry in range by tests/integration/patches/test_patch_kv_groups_without_padding.py (KV groups) and
tests/integration/patches/test_patch_kv_drafter_pages_promoted.py (drafter pages); here: this entry's checks on the installed vLLM."""

from __future__ import annotations

from _ported import assert_applies_and_reverts, installed_entry_or_skip


def test_applies_and_reverts(vllm_version):
    assert_applies_and_reverts(installed_entry_or_skip("kv-drafter-pages-promoted-033", vllm_version), vllm_version)
