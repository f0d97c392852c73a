"""torch's allocator for a dualgpu run's workers (envs.allocator_choice): expandable segments unless
the user configured the allocator or the run needs fixed segments; the executor's export never
overwrites nor outlives the user's own setting. And the registry's probe of torch's libraries."""

from __future__ import annotations

import os

import pytest

from vllm_dualgpu import envs
from vllm_dualgpu.patching import interventions as iv

VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")


@pytest.fixture(autouse=True)
def clean(monkeypatch):
    for var in VARS:
        monkeypatch.delenv(var, raising=False)
    envs.ALLOCATOR.forget()
    yield
    envs.ALLOCATOR.forget()


def test_zero_flags_run_with_expandable_segments():
    choice = envs.allocator_choice()
    assert choice.expandable
    envs.export_allocator(choice)
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    assert "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in choice.line()
    # a second run in the same process does not take the first one's export for the user's
    assert envs.users_allocator_conf() is None and envs.allocator_choice().expandable


@pytest.mark.parametrize("kwargs,reason", [
    (dict(tp_size=2), "#42609"),
    (dict(sleep_mode=True), "sleep mode"),
    (dict(kv_transfer=True), "KV connector"),
])
def test_runs_that_need_fixed_segments_keep_torchs_default(kwargs, reason):
    choice = envs.allocator_choice(**kwargs)
    assert not choice.expandable and reason in choice.line()


def test_tensor_parallelism_without_custom_all_reduce_may_expand():
    assert envs.allocator_choice(tp_size=2, custom_all_reduce=False).expandable


@pytest.mark.parametrize("var", VARS)
def test_the_users_setting_is_kept(monkeypatch, var):
    monkeypatch.setenv(var, "max_split_size_mb:512")
    choice = envs.allocator_choice()
    assert not choice.expandable and f"{var}=max_split_size_mb:512 is the user's" in choice.line()
    envs.export_allocator(choice)
    assert os.environ[var] == "max_split_size_mb:512"
    assert "PYTORCH_CUDA_ALLOC_CONF" not in os.environ or var == "PYTORCH_CUDA_ALLOC_CONF"


def test_a_later_run_that_needs_fixed_segments_takes_the_export_back():
    envs.export_allocator(envs.allocator_choice())
    envs.export_allocator(envs.allocator_choice(sleep_mode=True))
    assert "PYTORCH_CUDA_ALLOC_CONF" not in os.environ


def _torch_dir(tmp_path, libraries: dict[str, bytes]):
    lib = tmp_path / "torch" / "lib"
    lib.mkdir(parents=True)
    for name, body in libraries.items():
        (lib / name).write_bytes(body)
    return str(tmp_path / "torch")


def _probe(monkeypatch, root):
    monkeypatch.setattr(iv, "_package_dir", lambda name: root if name == "torch" else None)
    item = next(i for i in iv.INTERVENTIONS if i.name == "expandable-segments")
    return iv.probe_torch_allocator(item)


def test_probe_holds_where_torchs_allocator_names_the_setting(tmp_path, monkeypatch):
    root = _torch_dir(tmp_path, {"libc10_cuda.so": b"\0PYTORCH_CUDA_ALLOC_CONF\0",
                                 "libc10.so": b"\0expandable_segments\0"})
    assert _probe(monkeypatch, root) == (iv.HOLDS, "")


def test_probe_reports_a_torch_that_no_longer_knows_it(tmp_path, monkeypatch):
    root = _torch_dir(tmp_path, {"libc10_cuda.so": b"\0PYTORCH_CUDA_ALLOC_CONF\0", "libc10.so": b"\0"})
    status, why = _probe(monkeypatch, root)
    assert status == iv.MISSING and why.endswith("no longer name expandable_segments")


def test_probe_is_not_applicable_without_a_cuda_torch(tmp_path, monkeypatch):
    root = _torch_dir(tmp_path, {"libc10.so": b"\0PYTORCH_CUDA_ALLOC_CONF\0expandable_segments\0"})
    status, why = _probe(monkeypatch, root)
    assert status == iv.NOT_HERE and "libc10_cuda.so" in why
