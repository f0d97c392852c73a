"""When the one-host dualgpu plan applies to a run, and when the executor runs as stock vLLM.

A leaf module: the executor, the front end's checks (preflight) and the Ray planning ask it,
none of them through another.
"""

from __future__ import annotations


def planning_applies(parallel_config) -> str | None:
    """None when the dualgpu plan applies, else why the executor behaves like stock."""
    # TP groups as pipeline stages are planned (planner/tp_stages.py); TP alone is stock vLLM's.
    if parallel_config.pipeline_parallel_size < 2:
        return "pipeline_parallel_size=1"
    if parallel_config.data_parallel_size != 1 or parallel_config.nnodes > 1:
        return "data parallel or multi-node runs"
    return None
