"""Forked vLLM processes (LLM(...) forks EngineCore and workers) still get their own patches.

Found on the GPU machine: with fork, vLLM's "plugins loaded" flag is inherited, so register()
never ran in EngineCore or the workers and their patches were missing. The executor and the
worker class now call plugin.ensure() for their own process kind.
"""

from __future__ import annotations

import ctypes.util
import os
import subprocess
import sys
import textwrap

from vllm_dualgpu.patching.registry import PATCHES

CHILD = textwrap.dedent(
    """
    import json, os
    from vllm_dualgpu import plugin
    plugin.register()                       # the front end (MainProcess)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            # register() in a worker cannot tell the executor: it applies no worker patch ...
            before = plugin.ensure(frozenset({"worker"}))
            # ... the dualgpu worker class then applies them (DualGpuWorker.__init__, through
            # ensure_for_dualgpu, which also refuses when a required one is skipped)
            first = plugin.ensure(frozenset({"worker"}), active=True)
            again = plugin.ensure(frozenset({"worker"}), active=True)
            os.write(w, json.dumps({"before": [o.patch.name for o in before],
                                    "first": sorted([o.patch.name, o.status] for o in first),
                                    "same": again is first}).encode())
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    print("CHILD " + os.read(r, 100000).decode())
    print("PARENT " + json.dumps(sorted([o.patch.name, o.status] for o in plugin.ensure(frozenset({"frontend"})))))
    """
)


def test_forked_worker_applies_worker_patches_once():
    import json

    r = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "VLLM_TARGET_DEVICE": "cpu"})
    assert r.returncode == 0, r.stderr[-3000:]
    child = json.loads(next(l for l in r.stdout.splitlines() if l.startswith("CHILD ")).split(" ", 1)[1])
    import vllm

    from vllm_dualgpu.patching.core import version_in_range

    # the virtual-GPU emulation's entries (Patch.when) apply only where a hand-off gives a card
    here = [p for p in PATCHES if version_in_range(vllm.__version__, p.vllm_versions) and not p.when]
    worker_patches = sorted(p.name for p in here if "worker" in p.processes)
    frontend_only = sorted(p.name for p in here if p.processes == ("frontend",))
    assert child["before"] == []
    # every worker patch of this release applied in the forked worker, not merely attempted;
    # without a CUDA driver (CI) vLLM's CUDA platform module cannot import, so its patches
    # are skipped there and only there
    no_driver = ctypes.util.find_library("cuda") is None
    cuda_platform = {p.name for p in here if p.target.startswith("vllm.platforms.cuda:")}
    assert child["first"] == [[name, "skipped" if no_driver and name in cuda_platform else "applied"]
                              for name in worker_patches]
    assert len(cuda_platform) < len(worker_patches) - 3
    assert child["same"] is True  # the second call is a no-op
    parent = json.loads(next(l for l in r.stdout.splitlines() if l.startswith("PARENT ")).split(" ", 1)[1])
    assert parent == [[name, "applied"] for name in frontend_only]  # the parent's record is its own
    logs = r.stdout + r.stderr
    worker_lines = [l for l in logs.splitlines() if "vllm-dualgpu 0.1.0 (worker, pid" in l]
    assert len(worker_lines) == 2  # register()'s, then the one line of what was applied
    assert "nothing applied yet" in worker_lines[0] and "): applied " in worker_lines[1]
    assert sum("vllm-dualgpu 0.1.0 (frontend, pid" in l for l in logs.splitlines()) == 1


def test_worker_class_ensures_patches_before_vllm_builds_it(monkeypatch):
    from vllm.v1.worker.gpu_worker import Worker

    from vllm_dualgpu import plugin
    from vllm_dualgpu.engine.worker import DualGpuWorker

    calls = []
    # A dualgpu worker refuses to start half-patched: the checked form of ensure().
    monkeypatch.setattr(plugin, "ensure_for_dualgpu", lambda kinds: calls.append(("ensure", set(kinds))))
    monkeypatch.setattr(Worker, "__init__", lambda self, *a, **k: calls.append(("init", a, k)))
    DualGpuWorker("cfg", local_rank=1, rank=1)
    assert calls == [("ensure", {"worker"}), ("init", ("cfg",), {"local_rank": 1, "rank": 1})]


def test_executor_ensures_engine_patches_first(monkeypatch):
    from types import SimpleNamespace

    from vllm.v1.executor.multiproc_executor import MultiprocExecutor

    from vllm_dualgpu import plugin
    from vllm_dualgpu.engine.executor import DualGpuExecutor

    calls = []
    monkeypatch.setattr(plugin, "ensure", lambda kinds: calls.append(("ensure", set(kinds))))
    monkeypatch.setattr(MultiprocExecutor, "_init_executor", lambda self: calls.append(("spawn",)))
    ex = object.__new__(DualGpuExecutor)
    ex.parallel_config = SimpleNamespace(pipeline_parallel_size=1, tensor_parallel_size=1,
                                         data_parallel_size=1, nnodes=1)
    ex._init_executor()
    assert calls == [("ensure", {"engine"}), ("spawn",)]
