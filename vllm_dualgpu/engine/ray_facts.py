"""Each Ray node's GPU and network facts, read on that node by a Ray task.

:func:`read_node_facts` runs on the node (scheduled there with a hard node affinity): the GPUs
through NVML (:func:`vllm_dualgpu.nvml.read_visible_gpus`, under the same
``CUDA_VISIBLE_DEVICES`` the node's vLLM workers see: Ray is told not to set it, as vLLM's Ray
executor tells it for its workers), the node's Ray address, its network interfaces, its own
``*_SOCKET_IFNAME`` and ``CUDA_DEVICE_ORDER`` settings and the vLLM/torch/NCCL releases installed there. It returns the
recorded JSON form (:class:`vllm_dualgpu.planner.cluster.NodeFacts`), so a run can be replayed.
"""

from __future__ import annotations

import socket
from importlib import metadata

from vllm_dualgpu.log import logger
from vllm_dualgpu.planner.cluster import NODE_ENV_VARS, NodeFacts

#: Seconds to wait for every node's answer.
FACTS_TIMEOUT_S = 60.0
# Ray sets CUDA_VISIBLE_DEVICES for tasks unless told not to; vLLM's workers run with it unset.
NOSET_ENV = {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"}
NCCL_PACKAGES = ("nvidia-nccl-cu13", "nvidia-nccl-cu12", "nvidia-nccl-cu11")


def _version(*packages: str) -> str | None:
    for p in packages:
        try:
            return metadata.version(p)
        except metadata.PackageNotFoundError:
            continue
    return None


def read_node_facts() -> dict:
    """This node's facts (runs inside a Ray task on the node)."""
    import os

    import ray

    from vllm_dualgpu import nvml

    gpus = [{"index": g.physical_id, "name": g.name, "total_bytes": g.total_bytes,
             "free_bytes": g.free_bytes, "bandwidth_gbps": g.bandwidth_gbps,
             "capability": list(g.capability), "nvlink": g.nvlink, "display": g.display}
            for g in nvml.read_visible_gpus()]
    return {
        "node_id": ray.get_runtime_context().get_node_id(),
        "ip": ray.util.get_node_ip_address(),
        "hostname": socket.gethostname(),
        "gpus": gpus,
        "interfaces": [name for _, name in socket.if_nameindex()],
        "env": {v: os.environ[v] for v in NODE_ENV_VARS if os.environ.get(v)},
        "versions": {"vllm": _version("vllm"), "torch": _version("torch"), "nccl": _version(*NCCL_PACKAGES)},
        "driver": nvml.driver_version(),
        "error": None,
    }


def gpu_nodes() -> list[dict]:
    """The alive Ray nodes that offer GPUs (``ray.nodes()`` entries)."""
    import ray

    return [n for n in ray.nodes() if n.get("Alive") and n.get("Resources", {}).get("GPU", 0) > 0]


def gather(nodes: list[dict], timeout_s: float = FACTS_TIMEOUT_S) -> list[NodeFacts]:
    """One task per node, pinned there; a node that fails or does not answer in time comes back
    as facts with ``error`` set (the refusal names it). ``nodes``: ``ray.nodes()`` entries."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    task = ray.remote(read_node_facts)
    refs = [task.options(num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False),
                         runtime_env={"env_vars": NOSET_ENV}, max_retries=0).remote()
            for n in nodes]
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
    done = set(ready)
    out = []
    for n, ref in zip(nodes, refs):
        ip = n.get("NodeManagerAddress", "")
        if ref not in done:
            ray.cancel(ref, force=True)
            out.append(NodeFacts(n["NodeID"], ip, error=f"no answer within {timeout_s:.0f} s"))
            continue
        try:
            out.append(NodeFacts.from_dict(ray.get(ref)))
        except Exception as exc:  # the task raised on the node (NVML, import), or the node died
            first = str(exc).strip().splitlines()
            why = next((line for line in reversed(first) if line.strip()), type(exc).__name__)
            out.append(NodeFacts(n["NodeID"], ip, error=why.strip()[:300]))
    for f in out:
        logger.info("vllm-dualgpu: %s: %s", f.label, f.error or ", ".join(
            f"{g.index}:{g.short_name}" for g in f.gpus) or "no GPUs")
    return out
