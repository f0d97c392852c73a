"""The patch machinery: checks before changes, sentinels, copies, classmethods."""

from __future__ import annotations

import sys
import types

import pytest

from vllm_dualgpu.patching.core import (
    ALREADY,
    APPLIED,
    SKIPPED,
    Patch,
    apply_patch,
    revert_patch,
)


def double_result(original):
    def wrapper(*args, **kwargs):
        return 2 * original(*args, **kwargs)

    return wrapper


@pytest.fixture
def fake_vllm(monkeypatch):
    """Two throwaway modules: a target and a module holding a `from target import f` copy."""
    target = types.ModuleType("fake_target")
    exec(
        "def f(x, y):\n    return x + y\n"
        "class K:\n    @classmethod\n    def cap(cls, device_id=0):\n        return 80 + device_id\n",
        target.__dict__,
    )
    holder = types.ModuleType("fake_holder")
    holder.f = target.f
    monkeypatch.setitem(sys.modules, "fake_target", target)
    monkeypatch.setitem(sys.modules, "fake_holder", holder)
    # The factory is looked up by name, so expose it through an importable module.
    factories = types.ModuleType("fake_factories")
    factories.double_result = double_result
    monkeypatch.setitem(sys.modules, "fake_factories", factories)
    return target, holder


def make(**kw) -> Patch:
    base = dict(
        name="t",
        target="fake_target:f",
        processes=("worker",),
        vllm_versions=">=0.30.0,<0.31",
        why="w",
        upstream="u",
        remove_when="r",
        factory="fake_factories:double_result",
        params=("x", "y"),
        copies=("fake_holder",),
    )
    base.update(kw)
    return Patch(**base)


def test_applies_once_and_rebinds_copies(fake_vllm):
    target, holder = fake_vllm
    p = make()
    first = apply_patch(p, "0.30.0")
    assert first.status == APPLIED and first.rebound == ["fake_holder"]
    assert target.f(1, 2) == 6 and holder.f(1, 2) == 6
    assert apply_patch(p, "0.30.0").status == ALREADY
    assert target.f(1, 2) == 6  # not doubled twice
    assert revert_patch(p)
    assert target.f(1, 2) == 3 and holder.f(1, 2) == 3


def test_signature_mismatch_is_skipped_and_never_applied(fake_vllm):
    target, holder = fake_vllm
    original = target.f
    out = apply_patch(make(params=("x", "y", "z")), "0.30.0")
    assert out.status == SKIPPED
    assert "takes (x, y), expected (x, y, z)" in out.reason
    assert target.f is original and holder.f is original


def test_foreign_copy_blocks_the_whole_patch(fake_vllm):
    target, holder = fake_vllm
    original = target.f
    holder.f = lambda x, y: 0  # someone else replaced the copy
    out = apply_patch(make(), "0.30.0")
    assert out.status == SKIPPED and "not vLLM's original" in out.reason
    assert target.f is original  # the target itself was not touched either


def test_version_out_of_range_is_skipped(fake_vllm):
    target, _ = fake_vllm
    original = target.f
    out = apply_patch(make(), "0.33.0")
    assert out.status == SKIPPED and "not in >=0.30.0,<0.31" in out.reason
    assert target.f is original


def test_missing_target_is_skipped(fake_vllm):
    out = apply_patch(make(target="fake_target:nope"), "0.30.0")
    assert out.status == SKIPPED and "not found" in out.reason


def test_classmethod_stays_a_classmethod(fake_vllm):
    target, _ = fake_vllm
    p = make(target="fake_target:K.cap", params=("cls", "device_id"), copies=())
    assert apply_patch(p, "0.30.0").status == APPLIED
    assert isinstance(vars(target.K)["cap"], classmethod)
    assert target.K.cap(1) == 162
    assert revert_patch(p) and target.K.cap(1) == 81


def test_pinned_source_is_checked_before_anything_changes(tmp_path, monkeypatch):
    from vllm_dualgpu.patching.source_check import check_in_file, function_digest

    (tmp_path / "fake_pinned.py").write_text("def f(x, y):\n    return x + y\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import fake_pinned

    factories = types.ModuleType("fake_factories")
    factories.double_result = double_result
    monkeypatch.setitem(sys.modules, "fake_factories", factories)
    original = fake_pinned.f
    pin = function_digest(original)
    assert check_in_file("fake_pinned:f", ("x", "y"), pin) == ""  # the front end reads the file
    other = make(target="fake_pinned:f", copies=(), source_sha256="0" * 64)
    out = apply_patch(other, "0.30.0")
    assert out.status == SKIPPED and "not the one this patch was written against" in out.reason
    assert fake_pinned.f is original
    assert "not the one" in check_in_file("fake_pinned:f", ("x", "y"), "0" * 64)
    assert apply_patch(make(target="fake_pinned:f", copies=(), source_sha256=pin), "0.30.0").status == APPLIED
    assert fake_pinned.f(1, 2) == 6
    sys.modules.pop("fake_pinned", None)
