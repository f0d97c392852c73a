"""Which vLLM process this is, and whether the dualgpu executor drives it.

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

# Set by DualGpuExecutor before it spawns workers; workers inherit it. Patches that change
# behaviour check it, so other executors ("mp", "ray", ...) run exactly as stock vLLM.
ACTIVE_ENV = "VLLM_DUALGPU_ACTIVE"


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


def dualgpu_active() -> bool:
    return os.environ.get(ACTIVE_ENV) == "1"
