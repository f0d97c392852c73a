"""Shared checks for registry entries that port a patch to another vLLM release's API.

Each entry has its own module (``test_patch_<name>.py``); they share these. An entry whose
range excludes the installed vLLM is checked against its release's sources by
``python -m vllm_dualgpu.patching.static_check`` in ``scripts/test.sh`` instead.
"""

from __future__ import annotations

import contextlib

import pytest


def entry(name: str):
    from vllm_dualgpu.patching.registry import PATCHES

    return next(p for p in PATCHES if p.name == name)


def installed_entry_or_skip(name: str, vllm_version: str):
    """The entry, when the installed vLLM is in its range; else skip (static checks cover it)."""
    from vllm_dualgpu.patching.core import version_in_range

    patch = entry(name)
    if not version_in_range(vllm_version, patch.vllm_versions):
        pytest.skip(f"{name} is for vLLM {patch.vllm_versions}, installed {vllm_version} "
                    "(its release's sources are checked by scripts/test.sh's static checks)")
    return patch


@contextlib.contextmanager
def unpatched(patch, vllm_version: str):
    """vLLM's original in place for the block (an earlier plugin run in this test process may
    have applied the entry); the state before is restored afterwards."""
    from vllm_dualgpu.patching.core import ALREADY, APPLIED, apply_patch, check_patch, revert_patch

    was_applied = check_patch(patch, vllm_version).status == ALREADY
    if was_applied:
        assert revert_patch(patch)
    try:
        yield
    finally:
        revert_patch(patch)
        if was_applied:
            assert apply_patch(patch, vllm_version).status == APPLIED


def assert_applies_and_reverts(patch, vllm_version: str) -> None:
    with unpatched(patch, vllm_version):
        _applies_and_reverts(patch, vllm_version)


def _applies_and_reverts(patch, vllm_version: str) -> None:
    """core's checks pass on the installed vLLM (target, parameters, pin, copies), the patch
    applies once, a second time is a no-op, and revert gives vLLM its original back."""
    from vllm_dualgpu.patching.core import (
        ALREADY, APPLIED, READY, _function_of, _raw_attr, _resolve_owner, apply_patch,
        check_patch, revert_patch,
    )

    original = _function_of(_raw_attr(*_resolve_owner(patch)))
    assert check_patch(patch, vllm_version).status == READY, check_patch(patch, vllm_version).reason
    assert apply_patch(patch, vllm_version).status == APPLIED
    try:
        assert apply_patch(patch, vllm_version).status == ALREADY
        assert _function_of(_raw_attr(*_resolve_owner(patch))) is not original
    finally:
        assert revert_patch(patch)
    assert _function_of(_raw_attr(*_resolve_owner(patch))) is original
