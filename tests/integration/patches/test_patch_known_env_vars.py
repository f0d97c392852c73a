"""known-env-vars: vLLM's unknown-variable check on vLLM's own ``validate_environ``, stock vs
patched: VLLM_DUALGPU_* is hidden from that one check, every other VLLM_* is checked as before."""

from __future__ import annotations

import os

import pytest

from conftest import apply_registry_patch
from vllm_dualgpu.patching.core import revert_patch


@pytest.fixture(autouse=True)
def only_where_it_applies(vllm_version):
    from vllm_dualgpu.patching.registry import for_version

    if for_version("known-env-vars", vllm_version).name != "known-env-vars":
        pytest.skip(f"vLLM {vllm_version} has validate_environ on Platform: "
                    "test_patch_known_env_vars_031.py")


@pytest.fixture
def validate(vllm_version):
    import vllm.envs

    patch = apply_registry_patch("known-env-vars", vllm_version)
    yield vllm.envs.validate_environ
    revert_patch(patch)


def test_stock_refuses_this_packages_variables(monkeypatch, vllm_version):
    import vllm.envs

    monkeypatch.setenv("VLLM_DUALGPU_RESERVE", "1GiB")
    stock = getattr(vllm.envs.validate_environ, "__wrapped__", vllm.envs.validate_environ)
    # one of ours is flagged (the test session also sets VLLM_DUALGPU_MACHINE_PROFILE, which
    # stock may name first)
    with pytest.raises(ValueError, match=r"VLLM_DUALGPU_(RESERVE|MACHINE_PROFILE)"):
        stock(True)


def test_patched_hides_ours_and_restores_them(validate, monkeypatch):
    monkeypatch.setenv("VLLM_DUALGPU_RESERVE", "1GiB")
    validate(True)  # no refusal
    assert os.environ["VLLM_DUALGPU_RESERVE"] == "1GiB"  # put back after the check


def test_patched_still_refuses_other_unknown_variables(validate, monkeypatch):
    monkeypatch.setenv("VLLM_DUALGPU_RESERVE", "1GiB")
    monkeypatch.setenv("VLLM_NOT_A_REAL_SETTING", "1")
    with pytest.raises(ValueError, match="VLLM_NOT_A_REAL_SETTING"):
        validate(True)
    assert os.environ["VLLM_DUALGPU_RESERVE"] == "1GiB"  # restored on the error path too
