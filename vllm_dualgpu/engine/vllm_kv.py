"""vLLM's own KV planning functions, called the way each supported release takes them.

vLLM 0.32 gave ``_pool_bytes_per_block`` a ``vllm_config`` parameter; 0.33 moved KV planning
to ``vllm/v1/core/kv_cache_planning.py`` and passes the platform's KV config builder first. The
after-profiling context check (engine/context_fit.py) and the KV grouping patches
(patches/kv_cache_utils.py) both price KV with vLLM's functions through here. Each private name
is declared in patching/interventions.py (kv-*).
"""

from __future__ import annotations

import contextvars
from dataclasses import dataclass


@dataclass(frozen=True)
class _Workers:
    """Every rank's layers and KV memory, while vLLM forms the KV cache groups: the grouping
    patches (patches/kv_cache_utils.py) read it; outside that call it is unset."""

    vllm_config: object
    specs: tuple[dict, ...]
    memory: tuple[int, ...]


_WORKERS: contextvars.ContextVar[_Workers | None] = contextvars.ContextVar(
    "vllm_dualgpu_kv_workers", default=None
)


def planning_module():
    """vLLM's module holding KV planning: kv_cache_planning from 0.33, kv_cache_utils before."""
    try:
        from vllm.v1.core import kv_cache_planning as module
    except ImportError:
        from vllm.v1.core import kv_cache_utils as module
    return module


def _estimator_args(vllm_config) -> tuple:
    """The leading arguments of vLLM's estimators: 0.33 takes the platform's builder first."""
    module = planning_module()
    if module.__name__.endswith("kv_cache_planning"):
        from vllm.v1.core.kv_cache_config_builder import get_kv_cache_config_builder

        return (get_kv_cache_config_builder(vllm_config), vllm_config)
    return (vllm_config,)


def project_groups(kv_cache_groups: list, worker_spec: dict) -> list:
    """vLLM's projection of the model's groups onto one rank's layers."""
    return planning_module()._project_kv_cache_groups_to_worker(kv_cache_groups, worker_spec)


def max_memory_usage_bytes(vllm_config, kv_cache_groups: list) -> int:
    """vLLM's KV bytes for one max_model_len request on these (projected) groups."""
    return planning_module()._max_memory_usage_bytes_from_groups(
        *_estimator_args(vllm_config), kv_cache_groups)


def estimate_max_model_len(vllm_config, kv_cache_groups: list, available: int) -> int:
    """vLLM's longest request that ``available`` bytes of KV memory hold on these groups."""
    return planning_module()._estimate_max_model_len_from_groups(
        *_estimator_args(vllm_config), kv_cache_groups, available)


def pool_bytes_per_block(vllm_config, kv_cache_groups: list) -> int:
    """Bytes one block takes in a rank's pool (vLLM's null-block reservation), per release:
    ``(groups)`` in 0.30/0.31, ``(vllm_config, groups)`` in 0.32, through the builder in 0.33."""
    import inspect

    module = planning_module()
    if hasattr(module, "_pool_bytes_per_block_from_builder"):
        return module._pool_bytes_per_block_from_builder(*_estimator_args(vllm_config),
                                                          kv_cache_groups)
    if "vllm_config" in inspect.signature(module._pool_bytes_per_block).parameters:
        return module._pool_bytes_per_block(vllm_config, kv_cache_groups)
    return module._pool_bytes_per_block(kv_cache_groups)


def model_kv_cache_groups(vllm_config, kv_cache_specs: list) -> list:
    """The whole model's groups as vLLM forms them from every rank's specs (a copy is merged)."""
    import copy

    module = planning_module()
    specs = [copy.deepcopy(s) for s in kv_cache_specs]
    if hasattr(module, "get_global_kv_cache_groups"):
        return module.get_global_kv_cache_groups(vllm_config, specs)
    merged: dict = {}
    for s in specs:
        merged.update(s)
    return module.get_kv_cache_groups(vllm_config, merged)


def groups_for_ranks(vllm_config, rank_specs: list[dict], memory: list[int]) -> list:
    """The model's KV cache groups as vLLM forms them when every rank's layers and KV memory
    are known, as inside ``get_kv_cache_configs`` at run time (the grouping patches act where
    applied). The executor prices its plan with this before the workers exist."""
    token = _WORKERS.set(_Workers(vllm_config, tuple(dict(s) for s in rank_specs), tuple(memory)))
    try:
        return model_kv_cache_groups(vllm_config, [dict(s) for s in rank_specs])
    finally:
        _WORKERS.reset(token)
