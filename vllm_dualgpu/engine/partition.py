"""``VLLM_PP_LAYER_PARTITION``: the user's split, told apart from the one the plugin exports.

vLLM reads the split from this variable in every worker (``vllm.distributed.utils.get_pp_indices``),
so the executor exports the planned split there. A value the plugin exported itself is never
taken back as the user's: with ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` a second ``LLM(...)`` runs in
the same process, sees the first plan's value in the environment, and must plan afresh.
"""

from __future__ import annotations

from vllm_dualgpu.envs import ExportedVariable

PARTITION_ENV = "VLLM_PP_LAYER_PARTITION"
PARTITION = ExportedVariable(PARTITION_ENV)


def users_partition_text() -> str | None:
    """The user's own VLLM_PP_LAYER_PARTITION, or None (unset, empty, or the plugin's export)."""
    return PARTITION.users_text()


def export(partition) -> None:
    """Export the planned split for the workers; None takes back an earlier export (vLLM then
    splits evenly), leaving a user's own value alone."""
    PARTITION.export(",".join(str(n) for n in partition) if partition else None)
