"""Apply a dualgpu plan on vLLM's Ray executor: facts from every node, ranks across nodes.

Runs in the EngineCore process before :class:`vllm.v1.executor.ray_executor_v2.RayExecutorV2`
spawns its workers. It gathers each GPU node's facts by a Ray task on that node
(:mod:`vllm_dualgpu.engine.ray_facts`), refuses what cannot work
(:func:`vllm_dualgpu.planner.cluster.cluster_problems`), lets vLLM create its placement group,
plans each order of the nodes the fleet planner would (:func:`vllm_dualgpu.planner.cluster.rank_orders`:
a node's cards together) with the order fixed, keeps the fleet planner's choice
(:func:`vllm_dualgpu.planner.cluster.best_plan`), and hands it over through vLLM's own interfaces:

- ``VLLM_RAY_BUNDLE_INDICES``: which placement-group bundle (so which node) each rank takes;
  RayExecutorV2 reads it in place of its driver-node-first sort (``get_bundles_for_indices``);
- ``VLLM_PP_LAYER_PARTITION``: the split (:mod:`vllm_dualgpu.engine.partition`); Ray workers get
  the engine's environment (``get_driver_env_vars``, node-local values win);
- the typed hand-off record with each rank's node, GPU, reserve and cap
  (:mod:`vllm_dualgpu.engine.handoff`); each worker puts its node's planned GPU order in
  ``assigned_physical_gpu_ids`` (:func:`prepare_worker`).
"""

from __future__ import annotations

import inspect
import os
from collections import Counter
from dataclasses import replace

from vllm_dualgpu import envs
from vllm_dualgpu.engine import handoff, kv_pricing, planning
from vllm_dualgpu.log import logger
from vllm_dualgpu.nvml import VisibleGpu
from vllm_dualgpu.planner.cluster import (
    IFNAME_VARS,
    ClusterRefused,
    NodeFacts,
    cluster_problems,
    best_plan,
    describe,
    plan_cards,
    rank_orders,
    refuse_if_any,
)

BUNDLE_ENV = "VLLM_RAY_BUNDLE_INDICES"
RAY_DEVICE_KEY = "GPU"  # vLLM's CUDA platform's ray_device_key


def planning_applies(parallel_config) -> str | None:
    """None when the plan applies on Ray, else why the executor runs as vLLM's Ray executor."""
    from vllm_dualgpu.engine.plan_scope import planning_applies as one_host

    why = one_host(parallel_config)
    if why is None and parallel_config.tensor_parallel_size != 1:
        why = f"tensor_parallel_size={parallel_config.tensor_parallel_size} (plans on Ray cover TP=1)"
    return why


def driver_env() -> dict:
    return {v: os.environ[v] for v in IFNAME_VARS if os.environ.get(v)}


def bundle_nodes(placement_group) -> list[tuple[int, str]]:
    """(bundle index, node id) of each GPU bundle of the placement group, in bundle order."""
    from ray.util.placement_group import placement_group_table

    where = placement_group_table(placement_group)["bundles_to_node_id"]
    return [(i, where[i]) for i, spec in enumerate(placement_group.bundle_specs) if spec.get(RAY_DEVICE_KEY)]


def start_ray(parallel_config) -> None:
    """Connect to the Ray cluster as vLLM's initialize_ray_cluster does (a no-op when connected)."""
    import ray

    if not ray.is_initialized():
        if os.environ.get("RAY_USAGE_STATS_ENABLED", "0") != "1":
            os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
        ray.init(runtime_env=parallel_config.ray_runtime_env)


def create_placement_group(parallel_config) -> None:
    """vLLM's own placement group (RayExecutorV2 then finds it in the config and reuses it)."""
    from vllm.v1.executor.ray_utils import initialize_ray_cluster

    # 0.30 has require_gpu_on_driver (RayExecutorV2 passes False); 0.33 dropped the argument.
    params = inspect.signature(initialize_ray_cluster).parameters
    initialize_ray_cluster(parallel_config, **({"require_gpu_on_driver": False}
                                                if "require_gpu_on_driver" in params else {}))


def apply_cluster_plan(vllm_config) -> planning.AppliedPlan:
    """The executor's entry: facts, refusals, placement group, plan (see the module docstring)."""
    from vllm_dualgpu.engine import ray_facts

    pc = vllm_config.parallel_config
    if os.environ.get(BUNDLE_ENV):
        raise ClusterRefused(f"vllm-dualgpu: {BUNDLE_ENV}={os.environ[BUNDLE_ENV]} is set, but the dualgpu-ray "
                             "executor places the ranks itself; unset it (or use --distributed-executor-backend ray)")
    # As on one host (engine/planning.py): CUDA numbers the cards as NVML does. Ray workers get
    # the engine's environment where their node sets no value of its own (refused otherwise).
    os.environ["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
    start_ray(pc)
    nodes = ray_facts.gather(ray_facts.gpu_nodes())
    refuse_if_any(cluster_problems(nodes, None, pc.world_size, pc.tensor_parallel_size, driver_env()))
    create_placement_group(pc)
    return apply_to_bundles(vllm_config, nodes, bundle_nodes(pc.placement_group))


def apply_to_bundles(vllm_config, nodes: list[NodeFacts], bundles: list[tuple[int, str]]) -> planning.AppliedPlan:
    """Plan ``nodes`` for the placement group's ``bundles`` and hand the plan over."""
    from vllm_dualgpu.planner import ModelSpec

    pc = vllm_config.parallel_config
    held = Counter(node for _, node in bundles)
    refuse_if_any(cluster_problems(nodes, dict(held), pc.world_size, pc.tensor_parallel_size, driver_env()))
    settings = planning._settings(vllm_config)
    sizes = settings["reserve_bytes"]  # None: each card by its display state
    if sizes is not None and len(sizes) > 1:
        raise ClusterRefused(f"vllm-dualgpu: {envs.RESERVE} lists one reserve per card, which names cards of "
                             "one host; across Ray nodes give one value for every card")
    model = ModelSpec.from_hf_config(vllm_config.model_config.hf_config.to_dict(),
                                     quantization=vllm_config.model_config.quantization)
    user_partition = settings["user_partition"]
    request = planning.plan_request(vllm_config, user_partition)
    order, reserves, cards, ordered_request, result = plan_across_nodes(
        model, [n for n in nodes if not n.error and held.get(n.node_id)], request, sizes,
        settings.get("gpu_memory_utilization"))
    # vLLM's own (patched) KV functions price the chosen order's split, as on one host.
    result, _ = kv_pricing.reprice(vllm_config, result, lambda groupings: planning.plan_or_explain(
        model, cards, ordered_request, kv_groupings=groupings))

    # Bundles of one node are interchangeable (vLLM maps a node's workers to its GPUs by local
    # rank), so each rank takes the next unused bundle of its node.
    free = {node: [i for i, n in bundles if n == node] for node in held}
    indices = [free[n.node_id].pop(0) for n, _ in order]
    os.environ[BUNDLE_ENV] = ",".join(map(str, indices))
    ranked = [VisibleGpu(g.index, g.name, g.total_bytes, g.free_bytes, g.capability or (0, 0),
                         g.bandwidth_gbps, "", g.nvlink) for _, g in order]
    why = [r.why for r in reserves]
    record = planning._handoff(result, ranked, user_partition, why=why)
    record = replace(record, ranks=tuple(replace(r, node_id=n.node_id) for r, (n, _) in zip(record.ranks, order)))
    planning.hand_over(vllm_config, record, off="per-rank memory budgets and the planned GPU order inside each node",
                       kept="the rank order and layer split", workspace_bytes=result.flashinfer_workspace_bytes)
    logger.info("vllm-dualgpu plan on Ray: ranks %s, layers %s, bundles %s, predicted KV pool %s blocks, "
                "max context %s tokens", describe(order), "/".join(map(str, result.partition)),
                os.environ[BUNDLE_ENV], f"{result.num_blocks:,}", f"{result.max_context_tokens:,}")
    logger.info("vllm-dualgpu: %s", planning.kept_free_line(record))
    _record_nodes(result, ranked, nodes, indices)
    return planning.AppliedPlan(result, ranked)


def _reserves(sizes: list[int] | None, order) -> list:
    """Each card's reserve in rank order (``envs.Reserve``): VLLM_DUALGPU_RESERVE's one size
    for every card, else by the card's display state, as on one host."""
    return envs.card_reserves(sizes, [g.display for _, g in order])


def _record_nodes(result, ranked: list[VisibleGpu], nodes: list[NodeFacts], indices: list[int]) -> None:
    """``VLLM_DUALGPU_PLAN_FILE``: the plan as on one host, plus every node's recorded facts and
    the bundles, so the GPU run can be replayed (``NodeFacts.from_dict``)."""
    planning._write_plan_file(result, ranked, extra={"ray_nodes": [n.to_dict() for n in nodes],
                                                     "ray_bundle_indices": indices})


def plan_across_nodes(model, nodes: list[NodeFacts], request, sizes: list[int] | None,
                      utilization: float | None):
    """(rank order, its cards' reserves (``envs.Reserve``), the planner's cards and request for
    it, the plan): every order :func:`rank_orders` offers is planned with the order fixed, and
    the fleet planner's rule picks among those that fit (``plan --fleet`` shows the same
    choice); when none fits, the one reaching the longest context explains or warns
    (:func:`vllm_dualgpu.engine.planning.plan_or_explain`). ``sizes``: VLLM_DUALGPU_RESERVE's
    one size for every card; None: each card keeps its default by its display state."""
    from vllm_dualgpu.planner import PlanError, fit

    tried, errors = [], []
    for order in rank_orders(nodes):
        reserves = _reserves(sizes, order)
        caps = planning._utilization_caps(utilization, [g.total_bytes for _, g in order])
        cards = plan_cards(order, [r.bytes for r in reserves], caps)
        req = replace(request, gpu_order=list(range(len(cards))))
        try:
            tried.append((order, reserves, cards, req, fit(model, cards, req)))
        except PlanError as e:  # does not fit at all in this order
            errors.append(e)
    if not tried:
        raise errors[0]
    fitting = [t for t in tried if t[4].fits]
    if fitting:
        chosen = best_plan([t[4].plan for t in fitting])
        return next((o, w, c, r, f.plan) for o, w, c, r, f in fitting if f.plan is chosen)
    order, reserves, cards, req, _ = max(tried, key=lambda t: t[4].largest_max_model_len)
    return order, reserves, cards, req, planning.plan_or_explain(model, cards, req)


def node_gpu_order(plan: handoff.Handoff | None, rank: int) -> list[int] | None:
    """The physical GPU ids of ``rank``'s node in rank order (None: not a Ray plan)."""
    me = plan.rank(rank) if plan else None
    if me is None or me.node_id is None:
        return None
    return [r.physical_gpu_id for r in plan.ranks if r.node_id == me.node_id]


def prepare_worker(worker) -> None:
    """In a Ray worker, before vLLM's ``init_device``: this node's GPUs in planned rank order.

    RayExecutorV2 gives every worker of a node the node's GPU ids sorted and a local rank (its
    place among the node's workers in rank order); the worker takes ``ids[local_rank]``. The
    planned order puts the card with the most memory last, so it replaces the sorted list with
    the same ids in planned order. ``distributed_executor_backend`` becomes ``"ray"`` in this
    worker's copy of the config: vLLM's worker tests that name, not ``uses_ray``, to skip its
    one-host check ``local_world_size <= len(assigned_physical_gpu_ids)`` (gpu_worker.py
    init_device), which a cross-node layout fails.
    """
    ids = node_gpu_order(handoff.load(worker.vllm_config), worker.rank)
    if ids is None:
        return
    pc = worker.parallel_config
    if sorted(ids) != sorted(pc.assigned_physical_gpu_ids or []):
        raise RuntimeError(f"vllm-dualgpu: rank {worker.rank}: Ray gave this node GPUs "
                           f"{pc.assigned_physical_gpu_ids}, the plan has {ids}; restart with the same cards")
    pc.assigned_physical_gpu_ids = ids
    pc.distributed_executor_backend = "ray"
