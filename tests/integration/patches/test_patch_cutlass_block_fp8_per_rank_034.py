"""cutlass-block-fp8-per-rank-034 (vLLM 0.34, whose is_supported differs from 0.30-0.33's only in
its refusal message). The behaviour is tested on the installed vLLM through the entry in range by
tests/integration/patches/test_patch_cutlass_block_fp8_per_rank.py; here: this entry's checks on
the installed vLLM, and that it is the same fix as the 0.30-0.33 entry."""

from __future__ import annotations

from _ported import assert_applies_and_reverts, entry, installed_entry_or_skip

NAME = "cutlass-block-fp8-per-rank-034"


def test_applies_and_reverts(vllm_version):
    assert_applies_and_reverts(installed_entry_or_skip(NAME, vllm_version), vllm_version)


def test_same_target_and_fix_as_the_older_entry_with_its_own_pin():
    old, new = entry("cutlass-block-fp8-per-rank"), entry(NAME)
    assert (new.target, new.params, new.factory) == (old.target, old.params, old.factory)
    assert new.source_sha256 != old.source_sha256
