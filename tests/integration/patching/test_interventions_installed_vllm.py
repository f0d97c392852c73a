"""Every declared intervention holds for the installed vLLM (run under vLLM 0.30 and 0.33).

An entry whose range leaves the installed release out must really differ there: its check, taken
as if the release were in range, fails. So a narrow range is a finding, not a guess.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
from dataclasses import replace

import pytest

from vllm_dualgpu.patching import interventions as iv
from vllm_dualgpu.patching.core import version_in_range
from vllm_dualgpu.patching.interventions import HOLDS, INTERVENTIONS, MISSING, check_intervention

VERSION = importlib.metadata.version("vllm")


def _dsl_installed() -> bool:
    return any(importlib.util.find_spec(n) is not None for n in ("cutlass", "nvidia_cutlass_dsl"))


def _cuda_torch() -> bool:
    import torch

    return torch.version.cuda is not None


@pytest.mark.parametrize("item", INTERVENTIONS, ids=lambda i: i.name)
def test_intervention_holds_for_the_installed_vllm(item):
    if item.requires and importlib.util.find_spec(item.requires) is None:
        pytest.skip(f"{item.requires.capitalize()} not installed")
    found = check_intervention(item, VERSION)
    if version_in_range(VERSION, item.vllm_versions):
        if item.name == "cute-dsl-arch" and not _dsl_installed():
            assert found.status == iv.NOT_HERE
            return
        if item.name == "expandable-segments" and not _cuda_torch():  # vLLM 0.30's suite: a CPU torch
            assert found.status == iv.NOT_HERE and "libc10_cuda.so" in found.reason
            return
        assert found.status == HOLDS, found.reason
    else:
        assert found.status == MISSING
        assert found.reason.startswith(f"checked for vLLM {item.vllm_versions}, not {VERSION} (")
        as_if_in_range = check_intervention(replace(item, vllm_versions=f"=={VERSION}"), VERSION)
        assert as_if_in_range.status == MISSING, (
            f"{item.name} holds for vLLM {VERSION}: widen its range"
        )


def test_a_wrong_target_on_a_real_vllm_class_is_reported():
    worker = next(i for i in INTERVENTIONS if i.name == "worker-overrides-initialize-from-config")
    renamed = check_intervention(replace(worker, target=worker.target + "_renamed"), VERSION)
    assert renamed.status == MISSING
    assert "Worker.initialize_from_config_renamed not found" in renamed.reason
    other_params = check_intervention(replace(worker, params=("self", "config")), VERSION)
    assert other_params.reason == (
        "vllm.v1.worker.gpu_worker:Worker.initialize_from_config takes (self, kv_cache_config), "
        "expected (self, config)"
    )
    snapshot = next(i for i in INTERVENTIONS if i.name == "worker-init-snapshot")
    gone = check_intervention(replace(snapshot, source_names=("self.init_snapshot_v2",)), VERSION)
    assert gone.reason == (
        "vllm.v1.worker.gpu_worker:Worker.init_device no longer uses self.init_snapshot_v2"
    )


def test_doctor_counts_what_holds_and_lists_what_does_not(monkeypatch):
    from vllm_dualgpu.cli import doctor

    monkeypatch.setattr(doctor, "gpu_lines", lambda: (["GPUs: none visible (test)"], []))
    from vllm_dualgpu.patching.interventions import for_release

    here = for_release(VERSION)
    findings = [check_intervention(i, VERSION) for i in here]
    holding = [f for f in findings if f.status == HOLDS]
    lines, _ = doctor.report()
    start = next(n for n, line in enumerate(lines) if line.startswith("Other interventions for vLLM"))
    assert lines[start + 1].startswith(f"  holds    {len(holding)} of {len(here)}")
    if len(here) < len(INTERVENTIONS):
        assert lines[start + 1].endswith(f"; {len(INTERVENTIONS) - len(here)} more for other vLLM releases")
    others = lines[start + 2:start + 2 + len(findings) - len(holding)]
    for line, f in zip(others, [f for f in findings if f.status != HOLDS]):
        assert line.split()[0] == f.status.split()[0] and f" {f.intervention.name} " in line
        assert " ".join(f.reason.split()) in line


def test_doctor_fails_with_gpus_when_an_intervention_does_not_hold(monkeypatch):
    from vllm_dualgpu.cli import doctor
    from vllm_dualgpu.patching.registry import PATCHES

    import vllm_dualgpu._version

    monkeypatch.setattr(vllm_dualgpu._version, "SUPPORTED_VLLM", f"=={VERSION}")
    gpu = object()
    monkeypatch.setattr(doctor, "gpu_lines", lambda: (["GPUs: one (test)"], [gpu]))
    monkeypatch.setattr(doctor, "extension_lines", lambda: ([], True))
    monkeypatch.setattr(doctor, "config_lines", lambda gpus: [])
    monkeypatch.setattr(doctor, "patch_lines", lambda version: ([], [(p, "ready") for p in PATCHES]))
    good = replace(INTERVENTIONS[0], vllm_versions=f"=={VERSION}", probe="",
                   target="vllm.v1.worker.gpu_worker:Worker")
    monkeypatch.setattr(iv, "INTERVENTIONS", (good,))
    lines, status = doctor.report()
    assert status == 0 and f"  holds    1 of 1 ({good.kind} 1)" in lines
    monkeypatch.setattr(iv, "INTERVENTIONS", (good, replace(good, name="bad", target=good.target + "X")))
    lines, status = doctor.report()
    assert status == 1
    assert any(line.split()[:2] == ["missing", "bad"] and "WorkerX" in line for line in lines)


def test_doctor_without_ray_says_not_applicable(monkeypatch):
    """On a machine without Ray, vLLM's Ray executor module does not import: doctor reports the
    Ray interventions as not applicable, not as a failed check."""
    from vllm_dualgpu.patching.interventions import doctor_lines

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "ray" else real(name, *a))
    lines, findings = doctor_lines(VERSION)
    ray_items = [f for f in findings if f.intervention.requires == "ray"]
    assert [f.intervention.name for f in ray_items] == ["ray-bundle-indices", "ray-placement-group-reused"]
    assert all(f.status == iv.NOT_HERE for f in ray_items)
    assert all(f.reason == "not applicable: Ray not installed" for f in ray_items)
    assert not any("check failed" in line for line in lines)
