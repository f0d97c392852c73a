"""Pipeline stages across machines: each node's recorded facts, the rank order, the refusals.

Pure: the facts come in as data (what :mod:`vllm_dualgpu.engine.ray_facts` gathered on each node
through a Ray task, or a recorded JSON file), so tests and the GPU machine can replay a fleet.
The memory of each rank is budgeted by the planner itself (``gpu_order`` fixes the rank order,
:func:`vllm_dualgpu.planner.fit` does the rest); nothing here is a second budget rule.

What is refused, one line each (:func:`cluster_problems`), and why:

- a node whose facts did not come back (task failed or timed out): nothing can be planned for
  cards nobody could read;
- fewer GPUs than ranks in the cluster, or a node where the placement group holds only some of
  the node's cards (which ones Ray hands out is its choice, so the plan cannot name them);
- a node that reports a loopback address while the cluster spans hosts: vLLM publishes each
  worker's Ray node address for its TCP store and message queues, and NCCL bootstraps over it,
  so the other hosts would dial themselves;
- ``NCCL_SOCKET_IFNAME`` / ``GLOO_SOCKET_IFNAME`` naming no interface a node has: NCCL's
  bootstrap (and gloo, vLLM's CPU groups) then finds no socket interface on that node;
- different vLLM, torch or NCCL versions across nodes: workers unpickle one config and NCCL's
  wire protocol is only promised between identical releases;
- a node whose own ``CUDA_DEVICE_ORDER`` is not ``PCI_BUS_ID``: its workers keep it, and CUDA
  would then number the cards unlike NVML, whose numbers the plan uses;
- a tensor-parallel group that would span hosts (its all-reduce on every layer would cross the
  network).
"""

from __future__ import annotations

import ipaddress
import itertools
from dataclasses import dataclass, field, replace

from vllm_dualgpu.planner.errors import PlanError
from vllm_dualgpu.planner.gpus import GIB, GpuFacts
from vllm_dualgpu.planner.objective import POOL_TOLERANCE

IFNAME_VARS = ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME")
NODE_ENV_VARS = (*IFNAME_VARS, "CUDA_DEVICE_ORDER")
"""What each node reports of its own environment (Ray workers keep a node's own values)."""
VERSION_KEYS = ("vllm", "torch", "nccl")


class ClusterRefused(PlanError):
    """The cluster cannot run this layout; one line per problem, the first is the headline."""


@dataclass(frozen=True)
class NodeFacts:
    """What one Ray node reported about itself (or, with ``error``, why it could not)."""

    node_id: str
    ip: str
    hostname: str = ""
    gpus: tuple[GpuFacts, ...] = ()
    """The node's visible cards; ``index`` is the NVML index (PCI bus order) on that node."""
    interfaces: tuple[str, ...] = ()
    env: dict = field(default_factory=dict)
    """The node's own values of :data:`NODE_ENV_VARS` (absent when unset)."""
    versions: dict = field(default_factory=dict)
    """``vllm``, ``torch``, ``nccl`` package versions (None when not installed)."""
    driver: str | None = None
    error: str | None = None

    @property
    def label(self) -> str:
        name = self.hostname or self.ip
        return f"node {name} ({self.ip}, {self.node_id[:8]})"

    def to_dict(self) -> dict:
        return {
            "node_id": self.node_id, "ip": self.ip, "hostname": self.hostname,
            "gpus": [{**g.to_dict(), "nvlink": g.nvlink, "display": g.display} for g in self.gpus],
            "interfaces": list(self.interfaces), "env": dict(self.env),
            "versions": dict(self.versions), "driver": self.driver, "error": self.error,
        }

    @classmethod
    def from_dict(cls, d: dict) -> NodeFacts:
        gpus = tuple(
            GpuFacts(index=g["index"], name=g["name"], total_bytes=g["total_bytes"],
                     free_bytes=g["free_bytes"], bandwidth_gbps=g.get("bandwidth_gbps"),
                     capability=tuple(g["capability"]) if g.get("capability") else None,
                     nvlink=g.get("nvlink"), display=g.get("display")).with_known_defaults()
            for g in d.get("gpus", ())
        )
        return cls(node_id=d["node_id"], ip=d.get("ip", ""), hostname=d.get("hostname", ""),
                   gpus=gpus, interfaces=tuple(d.get("interfaces", ())), env=dict(d.get("env", {})),
                   versions=dict(d.get("versions", {})), driver=d.get("driver"), error=d.get("error"))


def ifname_usable(spec: str, interfaces: tuple[str, ...], var: str = "NCCL_SOCKET_IFNAME") -> list[str]:
    """The interfaces ``var=spec`` lets through. NCCL's syntax: comma-separated prefixes, ``=``
    for exact names, a leading ``^`` to exclude; ``GLOO_SOCKET_IFNAME`` (torch's gloo) takes
    comma-separated exact names."""
    if var == "GLOO_SOCKET_IFNAME":
        names = {p.strip() for p in spec.split(",") if p.strip()}
        return [i for i in interfaces if i in names]
    s = spec.strip()
    exclude = s.startswith("^")
    s = s[1:] if exclude else s
    exact = s.startswith("=")
    s = s[1:] if exact else s
    names = [p.strip() for p in s.split(",") if p.strip()]

    def named(i: str) -> bool:
        return any(i == p if exact else i.startswith(p) for p in names)

    return [i for i in interfaces if named(i) != exclude]


def _is_loopback(ip: str) -> bool:
    try:
        return ipaddress.ip_address(ip).is_loopback
    except ValueError:
        return ip == "localhost"


def cluster_problems(nodes: list[NodeFacts], bundles: dict[str, int] | None, world_size: int, tp: int = 1,
                     driver_env: dict | None = None) -> list[str]:
    """Every reason this cluster cannot run ``world_size`` ranks, one line each ([] when none).

    ``bundles``: placement-group bundles (one GPU each) per node id, or None before the group
    exists (then every reachable node with GPUs counts as used); ``driver_env``: the engine's
    own ``*_SOCKET_IFNAME`` values, which vLLM hands to workers that lack their own.
    """
    out = []
    for n in nodes:
        if n.error:
            out.append(f"{n.label}: its GPU facts did not come back ({n.error}); check that the node is "
                       "alive (`ray status`), has vllm-dualgpu and nvidia-ml-py installed, and that "
                       "nvidia-smi works there")
    ok = [n for n in nodes if not n.error]
    have = sum(len(n.gpus) for n in ok)
    if have < world_size:
        listing = ", ".join(f"{n.label}: {len(n.gpus)}" for n in ok) or "no node answered"
        out.append(f"{world_size} ranks need {world_size} GPUs, but the reachable nodes have {have} "
                   f"({listing}); lower --pipeline-parallel-size or add nodes (`ray start --address ...`)")
    if bundles is None:
        bundles = {n.node_id: len(n.gpus) for n in ok}
    for n in ok:
        held = bundles.get(n.node_id, 0)
        if held and held != len(n.gpus):
            out.append(f"{n.label}: the placement group holds {held} of its {len(n.gpus)} GPUs, and "
                       "which ones Ray hands out cannot be planned; start Ray there with only the "
                       "cards to use (CUDA_VISIBLE_DEVICES before `ray start`) or size the layout "
                       "to whole nodes")
    used = [n for n in ok if bundles.get(n.node_id, 0)]
    if len({n.ip for n in used}) > 1:
        for n in used:
            if _is_loopback(n.ip):
                out.append(f"{n.label}: reports the loopback address {n.ip}, which the other hosts "
                           "cannot reach (NCCL bootstraps and vLLM's queues connect there); start "
                           "Ray on it with `--node-ip-address <its LAN address>`")
    driver_env = driver_env or {}
    for n in used:
        for var in IFNAME_VARS:
            spec = n.env.get(var, driver_env.get(var))
            if spec and not ifname_usable(spec, n.interfaces, var):
                source = "its own" if var in n.env else "the engine's, which vLLM passes on"
                out.append(f"{n.label}: {var}={spec} ({source}) names no interface it has "
                           f"({', '.join(n.interfaces) or 'none'}); set {var} on that node to one of them")
    for n in used:
        order = n.env.get("CUDA_DEVICE_ORDER")
        if order not in (None, "PCI_BUS_ID"):
            out.append(f"{n.label}: CUDA_DEVICE_ORDER={order} there numbers its cards unlike NVML, so a rank "
                       "could open another card than planned; unset it (or set PCI_BUS_ID) before `ray start`")
    for key in VERSION_KEYS:
        seen: dict[str, list[str]] = {}
        for n in used:
            seen.setdefault(str(n.versions.get(key)), []).append(n.hostname or n.ip)
        if len(seen) > 1:
            which = "; ".join(f"{v} on {', '.join(h)}" for v, h in seen.items())
            out.append(f"{key} differs across nodes ({which}): NCCL and vLLM's pickled config need "
                       "the same release on every node; install the same versions (one image) everywhere")
    if tp > 1:
        for n in used:
            if bundles[n.node_id] % tp:
                out.append(f"{n.label}: {bundles[n.node_id]} GPUs do not make whole tensor-parallel groups "
                           f"of {tp}, so a group would span hosts; use a TP size that divides each node's GPUs")
    return out


def _spend_key(g: GpuFacts) -> tuple:
    """The planner's "most memory to spend" order (search._orders picks the last card by it)."""
    return (g.budget_bytes, g.total_bytes, g.bandwidth_gbps or 0, g.index)


#: Up to this many nodes every order of the nodes is planned (the fleet planner does the same).
MAX_PERMUTED_NODES = 4


def rank_orders(nodes: list[NodeFacts]) -> list[list[tuple[NodeFacts, GpuFacts]]]:
    """The rank orders worth planning: each node's cards together (one network hop per node
    boundary), smallest budget first inside a node, as ``plan --fleet`` orders a host's stages;
    every order of the nodes, the first one with the node holding the card with the most
    memory last (that card then last of all: it holds the output head and the sampler)."""
    base = sorted(nodes, key=lambda n: (max(map(_spend_key, n.gpus)), n.ip, n.node_id))
    inside = {n.node_id: sorted(n.gpus, key=lambda g: (g.budget_bytes, g.total_bytes, g.index)) for n in base}
    perms = itertools.permutations(base) if len(base) <= MAX_PERMUTED_NODES else [base]
    return [[(n, g) for n in perm for g in inside[n.node_id]] for perm in perms]


def best_plan(plans: list, hops=lambda p: 0):
    """The fleet planner's choice among plans that fit: the largest KV pool (within the
    planner's POOL_TOLERANCE), then the fewest network hops, then the fastest decode step. Pools
    are compared in tokens of --max-model-len requests: each plan's KV grouping is its split's,
    so blocks of two plans can differ in size."""
    best = max(p.pool_tokens for p in plans)
    near = [p for p in plans if p.pool_tokens >= best * POOL_TOLERANCE]
    return min(near, key=lambda p: (hops(p), p.predicted_decode_ms or 0.0))


def plan_cards(order: list[tuple[NodeFacts, GpuFacts]], reserves: list[int],
               caps: list[int] | None = None) -> list[GpuFacts]:
    """The planner's cards for ``order``: indexed by rank, each with its reserve and cap."""
    return [replace(g, index=r, reserve_bytes=reserves[r], cap_bytes=caps[r] if caps else None)
            for r, (_, g) in enumerate(order)]


def describe(order: list[tuple[NodeFacts, GpuFacts]]) -> str:
    return " -> ".join(f"{n.hostname or n.ip}:{g.index}:{g.short_name} ({g.free_bytes / GIB:.1f} GiB free)"
                       for n, g in order)


def refuse_if_any(problems: list[str]) -> None:
    if problems:
        more = f" (and {len(problems) - 1} more below)" if len(problems) > 1 else ""
        raise ClusterRefused("vllm-dualgpu: the Ray cluster cannot run this layout: " + problems[0] + more
                             + "".join(f"\n  {p}" for p in problems[1:]))
