"""The declared interventions are complete, and their check machinery reports what differs.

Pure: the checks here resolve standard-library targets, never vLLM (the installed vLLM is checked
in tests/integration/patching/test_interventions_installed_vllm.py).
"""

from __future__ import annotations

import importlib.util
import re
from dataclasses import replace
from pathlib import Path

import pytest
from packaging.specifiers import SpecifierSet

from vllm_dualgpu.patching import interventions as iv
from vllm_dualgpu.patching.interventions import (
    CLI, HOLDS, INTERVENTIONS, KINDS, MISSING, Intervention, check_all, check_intervention,
)
from vllm_dualgpu.process import ALL_PROCESSES, ENGINE, WORKER

DOC = Path(__file__).resolve().parents[3] / "docs" / "patches.md"


def _item(**kw) -> Intervention:
    base = dict(
        name="test-item", kind=iv.PRIVATE_API, target="json:dumps", processes=(ENGINE,),
        vllm_versions=">=0.30.0,<0.34", why="w", upstream="u", remove_when="r",
    )
    base.update(kw)
    return Intervention(**base)


def test_every_intervention_is_declared_completely():
    names = [i.name for i in INTERVENTIONS]
    assert len(names) == len(set(names))
    for i in INTERVENTIONS:
        assert i.kind in KINDS, i.name
        assert i.processes and set(i.processes) <= set(ALL_PROCESSES) | {CLI}, i.name
        assert i.why and i.upstream and i.remove_when and i.issue, i.name
        SpecifierSet(i.vllm_versions)  # parses
        if i.kind == iv.ENVIRONMENT:
            assert re.fullmatch(r"[A-Z][A-Z0-9_]+", i.target), i.name
            assert i.probe or ":" in i.checks, f"{i.name}: an environment variable needs a check"
        else:
            assert ":" in i.target, i.name
        assert ":" in i.check_target or i.probe, i.name


def test_the_issue_list_is_declared():
    """Issue 15 item 5 names these; each must be an entry of the kind it is."""
    by_target = {i.target: i.kind for i in INTERVENTIONS}
    assert by_target["CUTE_DSL_ARCH"] == iv.ENVIRONMENT
    assert by_target["CUDA_DEVICE_ORDER"] == iv.ENVIRONMENT
    assert by_target["VLLM_PP_LAYER_PARTITION"] == iv.ENVIRONMENT
    assert by_target["vllm.config.parallel:ParallelConfig.worker_cls"] == iv.WORKER_CLASS
    assert by_target["vllm.config.parallel:ParallelConfig.assigned_physical_gpu_ids"] == iv.CONFIG
    assert by_target["vllm.config.kernel:KernelConfig.enable_flashinfer_autotune"] == iv.CONFIG
    assert by_target["vllm.config.cache:CacheConfig.gpu_memory_utilization"] == iv.CONFIG
    assert by_target["vllm.v1.worker.gpu_worker:Worker.requested_memory"] == iv.PRIVATE_API
    assert by_target["vllm.v1.worker.gpu_worker:Worker.init_snapshot"] == iv.PRIVATE_API
    assert by_target["vllm._C_stable_libtorch:_Z18get_sm_version_numv"] == iv.NATIVE_HOOK


def _private_vllm_names_used_in(path: Path) -> set[str]:
    text = path.read_text()
    return set(re.findall(r"\b(?:k|ku|cls|module|planning_module\(\))\.(_[a-z][a-z0-9_]+)\(", text))


def test_every_private_kv_function_the_code_calls_is_declared():
    """engine/context_fit.py and patches/kv_cache_utils.py call vLLM's private KV functions
    through a module alias; every one they call is an entry."""
    pkg = Path(__file__).resolve().parents[3] / "vllm_dualgpu"
    used = _private_vllm_names_used_in(pkg / "engine" / "context_fit.py")
    used |= _private_vllm_names_used_in(pkg / "patches" / "kv_cache_utils.py")
    used |= _private_vllm_names_used_in(pkg / "engine" / "vllm_kv.py")
    used |= _private_vllm_names_used_in(pkg / "patches" / "platforms_interface.py")
    assert "_pool_bytes_per_block" in used and "_pool_bytes_per_block_from_builder" in used  # the scan works
    declared = {i.target.rsplit(".", 1)[-1].split(":")[-1] for i in INTERVENTIONS}
    assert used <= declared, f"undeclared: {sorted(used - declared)}"


def test_docs_list_every_intervention():
    text = DOC.read_text()
    for i in INTERVENTIONS:
        assert f"\n## `{i.name}`\n\n- **Kind:** {i.kind}\n- **Target:** `{i.target}`\n" in text, i.name


def test_a_target_that_exists_holds():
    assert check_intervention(_item(target="posixpath:join", params=("a", "p")), "0.30.0").status == HOLDS
    assert check_intervention(_item(target="json:JSONDecoder.decode"), "0.30.0").status == HOLDS


def test_a_missing_target_is_reported_with_its_reason():
    found = check_intervention(_item(target="json:no_such_function"), "0.30.0")
    assert found.status == MISSING
    assert "json:no_such_function not found" in found.reason
    missing_module = check_intervention(_item(target="no_such_module_xyz:f"), "0.30.0")
    assert missing_module.status == MISSING and "No module named 'no_such_module_xyz'" in missing_module.reason


def test_other_parameters_are_reported():
    found = check_intervention(_item(target="json:loads", params=("s", "cls")), "0.30.0")
    assert found.status == MISSING
    # json.loads(s, *, cls=None, object_hook=None, ..., **kw), as Python documents it
    assert found.reason == (
        "json:loads takes (s, cls, object_hook, parse_float, parse_int, parse_constant, "
        "object_pairs_hook, kw), expected (s, cls)"
    )


def test_a_name_the_source_no_longer_uses_is_reported():
    holds = _item(target="json:dumps", source_names=("JSONEncoder",))
    assert check_intervention(holds, "0.30.0").status == HOLDS
    gone = check_intervention(replace(holds, source_names=("JSONEncoder", "no_such_name")), "0.30.0")
    assert gone.status == MISSING and gone.reason == "json:dumps no longer uses no_such_name"


def test_checks_resolves_another_object_than_the_target():
    item = _item(target="SOME_ENV_VAR", kind=iv.ENVIRONMENT, checks="json:no_such")
    assert "json:no_such not found" in check_intervention(item, "0.30.0").reason


def test_a_release_outside_the_range_is_not_taken_on_trust():
    found = check_intervention(_item(vllm_versions=">=0.30.0,<0.31"), "0.33.0")
    assert found.status == MISSING
    assert found.reason == (
        "checked for vLLM >=0.30.0,<0.31, not 0.33.0 (its check passes, so the range may widen)"
    )
    gone = check_intervention(_item(vllm_versions=">=0.30.0,<0.31", target="json:gone"), "0.33.0")
    assert gone.reason.startswith("checked for vLLM >=0.30.0,<0.31, not 0.33.0 (target json:gone not found")


def test_check_all_selects_by_process():
    items = (_item(name="e", processes=(ENGINE,)), _item(name="w", processes=(WORKER,)))
    assert [f.intervention.name for f in check_all("0.30.0", frozenset({WORKER}), items)] == ["w"]
    assert len(check_all("0.30.0", None, items)) == 2


def test_native_symbol_probe_reads_the_library_file(tmp_path, monkeypatch):
    pkg = tmp_path / "fakepkg_iv"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "libthing.so").write_bytes(b"\x7fELF....\0_Z3foov\0other\0")
    monkeypatch.syspath_prepend(str(tmp_path))
    import importlib.machinery

    monkeypatch.setattr(importlib.machinery, "EXTENSION_SUFFIXES",
                        [".so", *importlib.machinery.EXTENSION_SUFFIXES])
    found = iv.probe_native_symbol(_item(target="fakepkg_iv.libthing:_Z3foov"))
    assert found == (HOLDS, "")
    status, reason = iv.probe_native_symbol(_item(target="fakepkg_iv.libthing:_Z3barv"))
    assert status == MISSING and reason == "libthing.so does not name _Z3barv"
    status, reason = iv.probe_native_symbol(_item(target="fakepkg_iv.nolib:_Z3foov"))
    assert status == MISSING and reason == "vLLM ships no fakepkg_iv.nolib library"


def test_cute_dsl_probe_not_here_without_the_dsl(monkeypatch):
    monkeypatch.setattr(iv, "_package_dir", lambda name: None)
    status, reason = iv.probe_cute_dsl_arch(_item(target="CUTE_DSL_ARCH"))
    assert status == iv.NOT_HERE and "not installed" in reason


def test_cute_dsl_probe_reads_the_dsl_source(tmp_path, monkeypatch):
    root = tmp_path / "cutlass"
    (root / "base_dsl").mkdir(parents=True)
    env = root / "base_dsl" / "env_manager.py"
    monkeypatch.setattr(iv, "_package_dir", lambda name: str(root) if name == "cutlass" else None)
    env.write_text('x = f"{prefix}_ARCH"\ndef detect_gpu_arch(prefix):\n    pass\n')
    assert iv.probe_cute_dsl_arch(_item(target="CUTE_DSL_ARCH")) == (HOLDS, "")
    env.write_text('x = f"{prefix}_TARGET"\ndef detect_gpu_arch(prefix):\n    pass\n')
    status, reason = iv.probe_cute_dsl_arch(_item(target="CUTE_DSL_ARCH"))
    assert status == MISSING and reason.endswith('no longer has _ARCH"')


@pytest.mark.parametrize("item", [i for i in INTERVENTIONS if i.probe], ids=lambda i: i.name)
def test_probes_load(item):
    module, fn = item.probe.split(":", 1)
    assert callable(getattr(__import__(module, fromlist=[fn]), fn))


def test_a_check_that_raises_is_a_finding_at_start_as_in_doctor():
    """check_all (a dualgpu run's start) and doctor_lines give the same verdict for a check
    that raises: MISSING with the error, never the exception escaping one of them."""
    broken = _item(name="broken", probe="json:loads")  # json.loads(item) raises TypeError
    found = check_all("0.30.0", None, (broken,))
    assert [(f.status, f.reason.split(":")[0]) for f in found] == [(MISSING, "check failed")]
    assert "TypeError" in found[0].reason


def test_an_intervention_on_a_library_that_is_absent_is_not_applicable(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "ray" else real(name, *a))
    found = check_intervention(_item(requires="ray", target="json:gone"), "0.30.0")
    assert (found.status, found.reason) == (iv.NOT_HERE, "not applicable: Ray not installed")


def test_every_intervention_on_vllms_ray_modules_requires_ray():
    for i in INTERVENTIONS:
        on_ray = i.check_target.split(":")[0].startswith(("vllm.v1.executor.ray", "ray"))
        assert (i.requires == "ray") == on_ray, i.name
