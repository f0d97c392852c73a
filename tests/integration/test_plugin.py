"""register(): version gate, per-process selection, the one summary line."""

from __future__ import annotations

import logging

import pytest

from vllm_dualgpu import plugin
from vllm_dualgpu.process import ENGINE, FRONTEND, WORKER, current_process_kinds


@pytest.fixture(autouse=True)
def fresh_plugin_state():
    plugin._reset_for_tests()
    yield
    plugin._reset_for_tests()


@pytest.fixture
def caplog_dualgpu(caplog):
    caplog.set_level(logging.INFO, logger="vllm.dualgpu")
    logging.getLogger("vllm.dualgpu").propagate = True
    return caplog


def test_unsupported_vllm_version_warns_once_and_applies_only_the_guard(monkeypatch, caplog_dualgpu):
    monkeypatch.setattr(plugin, "installed_vllm_version", lambda: "0.35.0")
    applied = []
    monkeypatch.setattr(plugin, "apply_patch", lambda p, v: applied.append((p.name, v)))
    plugin.ensure(frozenset({"frontend"}))
    plugin.ensure(frozenset({"frontend"}))
    warnings = [r for r in caplog_dualgpu.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "supports vLLM >=0.30.0,<0.35, found 0.35.0" in warnings[0].getMessage()
    assert applied == [("dualgpu-needs-supported-vllm", "0.35.0")]


def test_process_kinds_from_vllm_process_names(monkeypatch):
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    assert current_process_kinds("VllmWorker-1") == {WORKER}
    assert current_process_kinds("EngineCore_DP0") == {ENGINE}
    assert current_process_kinds("MainProcess") == {FRONTEND}
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    assert current_process_kinds("MainProcess") == {FRONTEND, ENGINE}


def test_workers_of_other_executors_get_no_patches():
    assert plugin.select_patches(frozenset({WORKER}), active=False) == ()


def test_frontend_gets_the_executor_selection_patch():
    names = [p.name for p in plugin.select_patches(frozenset({FRONTEND}), active=False)]
    assert "executor-by-name" in names


def test_every_declared_patch_is_complete():
    from vllm_dualgpu.patching.registry import PATCHES
    from vllm_dualgpu.process import ALL_PROCESSES

    names = [p.name for p in PATCHES]
    assert len(names) == len(set(names))
    for p in PATCHES:
        assert ":" in p.target and ":" in p.factory
        assert p.processes and set(p.processes) <= set(ALL_PROCESSES)
        assert p.why and p.upstream and p.remove_when and p.params


def test_docs_patches_md_is_generated_from_the_registry():
    from pathlib import Path

    from vllm_dualgpu.patching.docs import render

    doc = Path(__file__).resolve().parents[2] / "docs" / "patches.md"
    assert doc.read_text() == render(), "docs/patches.md is stale: python -m vllm_dualgpu.patching.docs"


def test_model_module_patches_wait_for_the_device():
    """vLLM's GDN model files start CUDA when imported (flash_linear_attention's utils ask device
    0 for its name and capability), so their patches apply in the 'device' phase, which
    DualGpuWorker.init_device runs once its GPU is set; register() in a worker leaves them."""
    from vllm_dualgpu.process import DEVICE

    worker = {p.name for p in plugin.select_patches(frozenset({WORKER}), active=True)}
    device = {p.name for p in plugin.select_patches(frozenset({DEVICE}), active=True)}
    assert device == {"qwen3-next-aux-hidden-relay", "qwen3-5-aux-hidden-layers"}
    assert not device & worker
    assert plugin.select_patches(frozenset({DEVICE}), active=False) == ()


def test_worker_registration_imports_no_model_module():
    import subprocess
    import sys

    code = (
        "import multiprocessing, sys\n"
        "multiprocessing.current_process().name = 'VllmWorker-1'\n"
        "from vllm_dualgpu import plugin\n"
        "plugin.register()\n"
        "print(sorted(m for m in sys.modules if m.startswith(('vllm.model_executor.models.qwen3_next',\n"
        "      'vllm.model_executor.models.qwen3_5', 'vllm.third_party.flash_linear_attention'))))\n"
    )
    env = {**__import__("os").environ, "VLLM_DUALGPU_ACTIVE": "1", "VLLM_TARGET_DEVICE": "cpu"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip().splitlines()[-1] == "[]"


def test_device_phase_goes_into_the_rank_summary(caplog):
    """No second INFO line per process: applied device-phase patches are listed in the rank's
    summary line; a skipped one also gets a WARNING saying why."""
    from conftest import registry_patch

    from vllm_dualgpu import rank_summary
    from vllm_dualgpu.patching.core import APPLIED, SKIPPED, Outcome

    caplog.set_level(logging.INFO, logger="vllm.dualgpu")
    logging.getLogger("vllm.dualgpu").propagate = True
    rank_summary.clear()
    relay, layers = registry_patch("qwen3-next-aux-hidden-relay"), registry_patch("qwen3-5-aux-hidden-layers")
    plugin._note_device_phase([Outcome(relay, APPLIED), Outcome(layers, SKIPPED, "source differs")])
    fact = rank_summary.facts()["patched once the device was set"]
    assert fact == "qwen3-next-aux-hidden-relay; skipped qwen3-5-aux-hidden-layers (source differs)"
    (warning,) = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert "qwen3-5-aux-hidden-layers (source differs)" in warning.getMessage()
    assert not [r for r in caplog.records if r.levelno == logging.INFO]
    rank_summary.clear()
