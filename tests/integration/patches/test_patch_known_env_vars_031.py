"""known-env-vars-031: vLLM 0.31+'s Platform.validate_environ does not flag VLLM_DUALGPU_*."""

from __future__ import annotations

import os

import pytest

from _ported import assert_applies_and_reverts, installed_entry_or_skip, unpatched

NAME = "known-env-vars-031"


@pytest.fixture
def patch(vllm_version):
    return installed_entry_or_skip(NAME, vllm_version)


def test_applies_and_reverts(patch, vllm_version):
    assert_applies_and_reverts(patch, vllm_version)


def test_hides_only_this_packages_variables(patch, vllm_version, monkeypatch):
    from vllm.platforms.interface import Platform

    from vllm_dualgpu.patching.core import APPLIED, apply_patch

    monkeypatch.setenv("VLLM_DUALGPU_RESERVE", "1GiB")
    with unpatched(patch, vllm_version):
        # the problem, stock: one of ours is flagged (the test session also sets
        # VLLM_DUALGPU_MACHINE_PROFILE, which stock may name first)
        with pytest.raises(ValueError, match=r"Unknown vLLM environment variable detected: VLLM_DUALGPU_\w+"):
            Platform.validate_environ(True)
        assert apply_patch(patch, vllm_version).status == APPLIED
        Platform.validate_environ(True)  # ours: hidden from the check
        assert os.environ["VLLM_DUALGPU_RESERVE"] == "1GiB"  # and put back
        monkeypatch.setenv("VLLM_NOT_A_REAL_VARIABLE", "1")
        with pytest.raises(ValueError, match="VLLM_NOT_A_REAL_VARIABLE"):  # others still checked
            Platform.validate_environ(True)
