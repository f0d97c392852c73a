"""Which vLLM process this is, and whether the dualgpu executor drives it (:func:`is_dualgpu_run`).

vLLM names its processes: workers ``VllmWorker-N`` (multiproc executor), the engine core
``EngineCore`` / ``EngineCore_DPn``; everything else is the front end (API server or the
``LLM`` caller), which also hosts the engine when ``VLLM_ENABLE_V1_MULTIPROCESSING=0``.
"""

from __future__ import annotations

import multiprocessing
import os

FRONTEND, ENGINE, WORKER = "frontend", "engine", "worker"
# A worker once its CUDA device is set (DualGpuWorker.init_device). Patches whose target module
# touches CUDA when imported (vLLM's GDN model files do) wait for it: imported earlier, in
# register(), they would start CUDA before the worker has chosen its GPU.
DEVICE = "device"
ALL_PROCESSES = (FRONTEND, ENGINE, WORKER, DEVICE)

# Where the executor's plan travels in the config (vllm_dualgpu.engine.handoff):
# additional_config[HANDOFF_KEY][PLAN_KEY].
HANDOFF_KEY, PLAN_KEY = "dualgpu", "plan"
# The package's executors (DualGpuExecutor, DualGpuRayExecutor) derive from this class.
PLANNED_EXECUTOR = ("vllm_dualgpu.engine.planned_executor", "PlannedExecutor")

_worker_run: dict = {"pid": None, "run": False}
"""What the worker of this process was built with (note_worker_config); keyed by pid, since
vLLM forks its processes."""


def current_process_kinds(name: str | None = None) -> frozenset[str]:
    name = multiprocessing.current_process().name if name is None else name
    if name.startswith("VllmWorker"):
        return frozenset({WORKER})
    if name.startswith("EngineCore"):
        return frozenset({ENGINE})
    if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1") == "0":
        return frozenset({FRONTEND, ENGINE})
    return frozenset({FRONTEND})


def process_label(kinds: frozenset[str]) -> str:
    return "+".join(k for k in ALL_PROCESSES if k in kinds)


def uses_dualgpu_executor(vllm_config) -> bool:
    """Whether ``vllm_config`` selects one of the package's executors (``dualgpu`` or
    ``dualgpu-ray``, or a subclass): the class, as the executor-by-name patch stores it."""
    parallel = getattr(vllm_config, "parallel_config", None)
    backend = getattr(parallel, "distributed_executor_backend", None)
    return isinstance(backend, type) and any(
        (c.__module__, c.__qualname__) == PLANNED_EXECUTOR for c in backend.__mro__)


def carries_plan(vllm_config) -> bool:
    """Whether the executor planned this run: its hand-off is in the config."""
    extra = getattr(vllm_config, "additional_config", None)
    section = extra.get(HANDOFF_KEY) if isinstance(extra, dict) else None
    return bool(isinstance(section, dict) and section.get(PLAN_KEY))


def is_dualgpu_run(vllm_config=None) -> bool:
    """The one answer to "is this a dualgpu run?", from vLLM's config, never the environment.

    With a config (front end, engine, and code that holds one): its executor is one of the
    package's. Without one (model code in a worker): the worker of this process is the
    dualgpu worker and the config it was built with carries the executor's plan
    (:func:`note_worker_config`, called by ``DualGpuWorker``). A later engine of another
    executor in the same process reads its own config, so nothing outlives an engine.
    """
    if vllm_config is not None:
        return uses_dualgpu_executor(vllm_config)
    return _worker_run["pid"] == os.getpid() and _worker_run["run"]


def note_worker_config(vllm_config) -> bool:
    """Record the config this process's worker was built with; returns :func:`is_dualgpu_run`."""
    _worker_run.update(pid=os.getpid(),
                       run=uses_dualgpu_executor(vllm_config) and carries_plan(vllm_config))
    return _worker_run["run"]
