"""The one list of run-time patches this package makes to vLLM.

``docs/patches.md`` is generated from it (``python -m vllm_dualgpu.patches.docs``), and a test
fails when the file is stale. Each entry says what it changes, where, for which vLLM releases,
why, which upstream issue or PR it relates to, and when it can go.
"""

from __future__ import annotations

from vllm_dualgpu.patches.core import Patch
from vllm_dualgpu.process import ENGINE, FRONTEND, WORKER

V030 = ">=0.30.0,<0.31"

PATCHES: tuple[Patch, ...] = (
    Patch(
        name="executor-by-name",
        target="vllm.engine.arg_utils:EngineArgs.create_engine_config",
        processes=(FRONTEND,),
        vllm_versions=V030,
        why=(
            "Turns --distributed-executor-backend dualgpu into the DualGpuExecutor class before "
            "vLLM validates it: EngineArgs._check_feature_supported rejects any other string "
            "with PP > 1 and Executor.get_class cannot resolve a bare name. Misspelled bare "
            "names get an error that lists the valid ones."
        ),
        upstream="none (vLLM has no registry of executor names for plugins)",
        remove_when="vLLM lets plugins register executor backends by name",
        factory="vllm_dualgpu.patches.arg_utils:wrap_create_engine_config",
        params=("self", "usage_context", "headless"),
        issue="#2",
    ),
    # --- memory accounting (issue #3) ---
    # --- per-rank device identity (issue #4) ---
    # --- Triton FP8 configs (issue #5) ---
    # --- speculative decoding under PP (issue #6) ---
)

__all__ = ["ENGINE", "FRONTEND", "PATCHES", "WORKER"]
