"""A dualgpu run does not start half-patched; other executors only get a warning.

Real vLLM targets, with a test-local registry entry whose parameters are deliberately wrong.
"""

from __future__ import annotations

import importlib.metadata
import logging
from dataclasses import replace

import pytest
from vllm.v1.worker.gpu_worker import Worker

from vllm_dualgpu import plugin
from vllm_dualgpu.patching import interventions as iv
from vllm_dualgpu.patching import registry
from vllm_dualgpu.patching.core import SKIPPED, Patch
from vllm_dualgpu.process import DEVICE, ENGINE, WORKER

VERSION = importlib.metadata.version("vllm")

WRONG = Patch(
    name="test-wrong-params",
    target="vllm.v1.worker.gpu_worker:Worker.initialize_from_config",
    processes=(ENGINE,),
    vllm_versions=f"=={VERSION}",
    why="test", upstream="test", remove_when="test",
    factory="functools:wraps",
    params=("self",),  # vLLM's takes (self, kv_cache_config)
)
REASON = (
    "vllm.v1.worker.gpu_worker:Worker.initialize_from_config takes (self, kv_cache_config), "
    "expected (self)"
)


@pytest.fixture(autouse=True)
def isolated(monkeypatch, caplog):
    plugin._reset_for_tests()
    # Whatever the installed release, the plugin takes it as supported here (the last test
    # checks an unsupported one).
    monkeypatch.setattr(plugin, "installed_vllm_version", lambda: VERSION)
    from vllm_dualgpu import support

    monkeypatch.setattr(support, "SUPPORTED_VLLM", f"=={VERSION}")
    monkeypatch.setattr(iv, "INTERVENTIONS", ())
    caplog.set_level(logging.INFO, logger="vllm.dualgpu")
    logging.getLogger("vllm.dualgpu").propagate = True
    yield
    plugin._reset_for_tests()


def _records(caplog, level):
    return [r.getMessage() for r in caplog.records if r.levelno == level and r.name.startswith("vllm.dualgpu")]


def test_dualgpu_run_stops_on_a_skipped_required_patch(monkeypatch, caplog):
    monkeypatch.setattr(registry, "PATCHES", (WRONG,))
    original = Worker.__dict__["initialize_from_config"]
    with pytest.raises(plugin.StartupRefused) as info:
        plugin.ensure_for_dualgpu(frozenset({ENGINE}))
    message = str(info.value)
    assert f"required patch test-wrong-params ({REASON}) was skipped" in message
    assert "--distributed-executor-backend mp" in message and "vllm-dualgpu doctor" in message
    assert "\n" not in message
    assert _records(caplog, logging.ERROR) == [message]
    assert Worker.__dict__["initialize_from_config"] is original  # nothing half-applied
    with pytest.raises(plugin.StartupRefused):  # a second call (the device phase) refuses too
        plugin.ensure_for_dualgpu(frozenset({ENGINE}))


def test_other_executors_only_warn(monkeypatch, caplog):
    monkeypatch.setattr(registry, "PATCHES", (WRONG,))
    outcomes = plugin.ensure(frozenset({ENGINE}))
    assert [(o.patch.name, o.status, o.reason) for o in outcomes] == [
        ("test-wrong-params", SKIPPED, REASON)
    ]
    warnings = _records(caplog, logging.WARNING)
    assert len(warnings) == 1 and f"skipped test-wrong-params ({REASON})" in warnings[0]
    assert _records(caplog, logging.ERROR) == []


def test_an_optional_patch_skipped_does_not_stop_the_run(monkeypatch, caplog):
    monkeypatch.setattr(registry, "PATCHES", (replace(WRONG, optional=True),))
    outcomes = plugin.ensure_for_dualgpu(frozenset({ENGINE}))
    assert [o.status for o in outcomes] == [SKIPPED]
    assert _records(caplog, logging.ERROR) == []


def test_dualgpu_run_stops_on_an_intervention_that_does_not_hold(monkeypatch, caplog):
    monkeypatch.setattr(registry, "PATCHES", ())
    held = iv.Intervention(
        name="test-kv-private", kind=iv.PRIVATE_API,
        target="vllm.v1.worker.gpu_worker:Worker.initialize_from_config", processes=(ENGINE,),
        vllm_versions=f"=={VERSION}", why="t", upstream="t", remove_when="t",
        params=("self", "kv_cache_config"),
    )
    gone = replace(held, name="test-kv-gone", target="vllm.v1.worker.gpu_worker:Worker._no_such_private",
                   params=None)
    elsewhere = replace(gone, name="test-worker-only", processes=("worker",))
    monkeypatch.setattr(iv, "INTERVENTIONS", (held,))
    assert plugin.ensure_for_dualgpu(frozenset({ENGINE})) == []
    plugin._reset_for_tests()
    monkeypatch.setattr(iv, "INTERVENTIONS", (held, gone, elsewhere))
    with pytest.raises(plugin.StartupRefused) as info:
        plugin.ensure_for_dualgpu(frozenset({ENGINE}))
    message = str(info.value)
    assert (
        "private-api test-kv-gone (target vllm.v1.worker.gpu_worker:Worker._no_such_private not "
        "found: _no_such_private) does not hold"
        in message
    )
    assert "test-kv-private" not in message and "test-worker-only" not in message
    assert _records(caplog, logging.ERROR) == [message]


def test_an_unsupported_vllm_stops_a_dualgpu_run(monkeypatch):
    monkeypatch.setattr(plugin, "installed_vllm_version", lambda: "0.29.0")
    with pytest.raises(plugin.StartupRefused, match=r"supports vLLM .*, found 0\.29\.0"):
        plugin.ensure_for_dualgpu(frozenset({ENGINE}))


def test_the_executor_stops_before_planning_on_a_skipped_required_patch(monkeypatch):
    """The refusal is reached from the dualgpu executor itself, before any GPU is planned."""
    from types import SimpleNamespace

    import vllm.platforms

    from vllm_dualgpu.engine import executor, planning

    monkeypatch.setattr(registry, "PATCHES", (WRONG,))
    monkeypatch.setattr(vllm.platforms, "_current_platform", SimpleNamespace(is_cuda=lambda: True))
    planned = []
    monkeypatch.setattr(planning, "apply_plan", lambda cfg: planned.append(cfg))
    ex = object.__new__(executor.DualGpuExecutor)
    ex.parallel_config = SimpleNamespace(pipeline_parallel_size=2, tensor_parallel_size=1,
                                         data_parallel_size=1, nnodes=1)
    ex.vllm_config = SimpleNamespace()
    with pytest.raises(plugin.StartupRefused, match="required patch test-wrong-params"):
        ex._init_executor()
    assert planned == []


@pytest.mark.parametrize("kind", [WORKER, DEVICE])
def test_a_worker_process_of_a_dualgpu_run_stops_on_a_skipped_required_patch(monkeypatch, kind):
    """In a worker (or its device phase) register() ran first, outside any notion of the run
    (nothing tells a fresh worker process which executor drives it): the dualgpu worker's own
    ensure_for_dualgpu still applies and checks the required patches of its kind."""
    monkeypatch.setattr(registry, "PATCHES", (replace(WRONG, processes=(kind,)),))
    plugin.ensure(frozenset({kind}))  # register() in that process: applies nothing there
    with pytest.raises(plugin.StartupRefused, match="required patch test-wrong-params"):
        plugin.ensure_for_dualgpu(frozenset({kind}))


def test_a_required_patch_of_the_kind_that_never_ran_is_a_problem(monkeypatch):
    """The required set comes from the registry, the installed vLLM and the process kind, not
    from the outcomes: no outcome at all for a required patch is not a pass."""
    monkeypatch.setattr(registry, "PATCHES", (replace(WRONG, processes=(WORKER,)),))
    problems = plugin.startup_problems(frozenset({WORKER}), [])
    assert problems == ["required patch test-wrong-params was not applied in this process"]


def test_a_kind_counts_as_done_only_after_it_succeeded(monkeypatch):
    """An exception part-way leaves the kind to be applied again, not marked done with nothing
    applied and nothing reported."""
    from vllm_dualgpu.patching import core

    monkeypatch.setattr(registry, "PATCHES", (replace(WRONG, optional=True),))
    real = core.apply_patch
    calls = []

    def fails_once(patch, version):
        calls.append(patch.name)
        if len(calls) == 1:
            raise RuntimeError("interrupted")
        return real(patch, version)

    monkeypatch.setattr(plugin, "apply_patch", fails_once)
    with pytest.raises(RuntimeError, match="interrupted"):
        plugin.ensure(frozenset({ENGINE}))
    outcomes = plugin.ensure(frozenset({ENGINE}))
    assert [(o.patch.name, o.status) for o in outcomes] == [("test-wrong-params", SKIPPED)]


@pytest.mark.parametrize("kind", [WORKER])
def test_conditional_patches_are_not_required_of_every_dualgpu_process(kind):
    """The real registry: an entry that applies only under a condition (``Patch.when``, the
    virtual-GPU emulation) is not required of every dualgpu process of its kind, else every
    dualgpu worker on real cards is refused for patches it must not apply. Seen on a GPU: every
    worker refused with "required patch virtual-gpus-memory-info was not applied"."""
    conditional = [p.name for p in registry.PATCHES if p.when and kind in p.processes]
    assert conditional, "the registry has conditional entries for this kind"
    required = {p.name for p in plugin.required_patches(frozenset({kind}), VERSION)}
    assert not required.intersection(conditional)
