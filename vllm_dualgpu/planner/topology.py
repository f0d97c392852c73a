"""Plan a box or a small fleet: which topologies fit, what each gives, and which to pick.

Input: the cards of each host (:class:`Fleet`). Enumerated for each tensor-parallel size ``t``
(1, and 2/4/8 where a host has that many cards):

* ``host-tp1``: one pipeline over all of a host's cards, one replica per host;
* ``host-tp{t}``: TP groups of ``t`` equal cards as the pipeline stages of one replica per host;
* ``group-tp{t}``: one replica per TP group (``group-tp1``: one replica per card);
* ``fleet-tp{t}``: one pipeline whose stages span the hosts.

A TP group holds cards of one kind (same name and memory) and is planned as equals at its
smallest card's free memory and slowest card's bandwidth; a group that would mix kinds is
refused with the reason. Every replica is planned by :func:`~vllm_dualgpu.planner.search.plan`
on the model as one TP rank sees it (:mod:`topology_shard`), so there is one memory model; speed
comes from the planner's decode reads plus the links (:mod:`topology_speed`).
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass, field, replace

from vllm_dualgpu.planner.cluster import best_plan
from vllm_dualgpu.planner.errors import BadRequest, ModelDoesNotFit, PlanError
from vllm_dualgpu.planner.gpus import GpuFacts, parse_gpus
from vllm_dualgpu.planner.model import ModelSpec
from vllm_dualgpu.planner.search import Fit, Plan, PlanRequest, fit, plan
from vllm_dualgpu.planner.topology_shard import shard_config, tp_extra_reserve
from vllm_dualgpu.planner.topology_speed import LinkModel, StageSpeed, step_ms, throughput

DEFAULT_TP_SIZES = (1, 2, 4, 8)
PREFERENCES = ("throughput", "latency", "context")
#: topologies within this share of the best figure count as equal; the tie-breaks decide
TIE = 0.97
# How ready a topology is, best first: the recommendation takes the best of the readiest.
STATUS_ORDER = ("yes", "CPU-tested", "not yet")
_HOST_NAME = re.compile(r"^\s*([A-Za-z0-9_.-]+)\s*=(.*)$", re.S)


# --------------------------------------------------------------------------------------------
# the fleet


@dataclass(frozen=True)
class Card:
    host: str
    gpu: GpuFacts

    @property
    def label(self) -> str:
        return f"{self.host}:{self.gpu.index} {self.gpu.short_name}"

    @property
    def kind(self) -> tuple[str, int]:
        return (self.gpu.short_name.lower(), self.gpu.total_bytes)


@dataclass(frozen=True)
class Host:
    name: str
    gpus: tuple[GpuFacts, ...]

    def cards(self) -> list[Card]:
        return [Card(self.name, g) for g in self.gpus]


@dataclass(frozen=True)
class Fleet:
    hosts: tuple[Host, ...]

    def __post_init__(self):
        if not self.hosts:
            raise BadRequest("the fleet has no hosts")
        names = [h.name for h in self.hosts]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise BadRequest(f"host name(s) {dup} given twice; name each host once")

    def cards(self) -> list[Card]:
        return [c for h in self.hosts for c in h.cards()]

    def to_dict(self) -> dict:
        return {"hosts": [{"name": h.name, "gpus": [g.to_dict() for g in h.gpus]} for h in self.hosts]}


def split_hosts(spec: str) -> list[tuple[str, str]]:
    """(host name, its ``--gpus`` card list) for each ``;``-separated host of ``spec``."""
    parts = [p for p in spec.split(";") if p.strip()]
    if not parts:
        raise BadRequest("--gpus names no host; write e.g. 'box1=RTX 5080,RTX 5080;box2=RTX 4070 Ti SUPER'")
    out = []
    for i, part in enumerate(parts, 1):
        m = _HOST_NAME.match(part)
        name, cards = (m.group(1), m.group(2)) if m else (f"host{i}", part)
        if not cards.strip():
            raise BadRequest(f"host {name!r} has no cards; write e.g. '{name}=RTX 5080,RTX 5080'")
        out.append((name, cards))
    return out


def parse_fleet(spec: str) -> Fleet:
    """``--gpus`` for a fleet: hosts separated by ``;``, each ``[NAME=]CARD,CARD...`` in the
    ``--gpus`` card syntax (CUDA order inside the host). Unnamed hosts are ``host1``, ``host2``...

        RTX 5080,RTX 5080;RTX 4070 Ti SUPER,RTX 4070 Ti SUPER
        box1=RTX 5080,RTX 5080;box2=RTX 4070 Ti SUPER:16GiB:reserve=0,RTX 4070 Ti SUPER
    """
    hosts = [Host(name, tuple(parse_gpus(cards))) for name, cards in split_hosts(spec)]
    return Fleet(tuple(hosts))


def file_hosts(d: dict) -> list[tuple[str, str]]:
    """(host name, ``--gpus`` card list) for each host of a fleet file's ``hosts``:
    ``[{"name": "box1", "gpus": "RTX 5080,RTX 5080"}, ...]`` (``gpus`` a ``--gpus`` string or a
    list of card entries; a host without ``name`` is ``host1``, ``host2``...)."""
    hosts = d.get("hosts") if isinstance(d, dict) else None
    if not isinstance(hosts, list) or not hosts:
        raise BadRequest('the fleet file needs "hosts": [{"name": "box1", "gpus": "RTX 5080,RTX 5080"}, ...]')
    out = []
    for i, h in enumerate(hosts, 1):
        if not isinstance(h, dict) or "gpus" not in h:
            raise BadRequest(f'host {i} of the fleet file needs "gpus" (a --gpus string or a list of cards)')
        g = h["gpus"]
        spec = ",".join(g) if isinstance(g, list) and all(isinstance(x, str) for x in g) else g
        if not isinstance(spec, str) or not spec.strip():
            raise BadRequest(f'host {i}: "gpus" must be a non-empty string or list of strings')
        name = str(h.get("name") or f"host{i}")
        if not _HOST_NAME.match(name + "=x"):
            raise BadRequest(f"host name {name!r}: use letters, digits, '.', '_' or '-'")
        out.append((name, spec))
    return out


def fleet_from_dict(d: dict) -> Fleet:
    """The :class:`Fleet` of a fleet file's ``hosts`` (see :func:`file_hosts`)."""
    return Fleet(tuple(Host(name, tuple(parse_gpus(spec))) for name, spec in file_hosts(d)))


_REQUEST_KEYS = set(PlanRequest.__dataclass_fields__) - {"pp_size", "layer_partition", "gpu_order", "memory"}


def request_from_dict(serve: dict | None) -> PlanRequest:
    """A :class:`PlanRequest` from a fleet file's ``serve`` object (``PlanRequest`` field names;
    the topology decides ``pp_size``, ``layer_partition`` and ``gpu_order``)."""
    serve = dict(serve or {})
    bad = sorted(set(serve) - _REQUEST_KEYS)
    if bad:
        raise BadRequest(f"unknown serve key(s) {bad}; use {', '.join(sorted(_REQUEST_KEYS))}")
    return PlanRequest(**serve)


# --------------------------------------------------------------------------------------------
# layouts (what runs where, before planning)


@dataclass(frozen=True)
class ReplicaLayout:
    name: str
    stages: tuple[tuple[Card, ...], ...]  # each stage a TP group; host order, the plan orders ranks
    refusal: str | None = None

    @property
    def cards(self) -> list[Card]:
        return [c for s in self.stages for c in s]

    @property
    def hosts(self) -> list[str]:
        return list(dict.fromkeys(c.host for s in self.stages for c in s))


@dataclass(frozen=True)
class Layout:
    id: str
    label: str
    tp: int
    scope: str
    replicas: tuple[ReplicaLayout, ...]
    idle: tuple[tuple[Card, str], ...] = ()
    aliases: tuple[str, ...] = ()

    def key(self):
        return frozenset(
            frozenset(tuple(sorted((c.host, c.gpu.index) for c in s)) for s in r.stages) for r in self.replicas if not r.refusal
        )


def group_host(host: Host, tp: int) -> tuple[list[tuple[Card, ...]], list[tuple[Card, str]], str | None]:
    """TP groups of ``tp`` equal cards on ``host``: (groups, idle cards with why, refusal)."""
    cards = host.cards()
    if len(cards) < tp:
        return [], [], (
            f"too few cards: TP {tp} needs {tp} cards on one host, {host.name} has {len(cards)}"
        )
    by_kind: dict[tuple[str, int], list[Card]] = {}
    for c in cards:
        by_kind.setdefault(c.kind, []).append(c)
    groups, idle = [], []
    for kind_cards in by_kind.values():
        n = len(kind_cards) // tp * tp
        groups += [tuple(kind_cards[i:i + tp]) for i in range(0, n, tp)]
        idle += [(c, f"no other {c.gpu.short_name} on {host.name} to complete a TP {tp} group") for c in kind_cards[n:]]
    groups.sort(key=lambda g: g[0].gpu.index)
    if not groups:
        kinds = ", ".join(sorted({c.gpu.short_name for c in cards}))
        return [], [], (
            f"mixed TP group: TP {tp} on {host.name} would put {kinds} in one group; vLLM splits every "
            "layer evenly over a TP group, so it would run at the smallest card's memory and the slowest "
            "card's speed; use these cards as pipeline stages or as separate replicas instead"
        )
    return groups, idle, None


def _label(scope: str, tp: int) -> str:
    if tp == 1:
        return {"host": "one pipeline over each host's cards", "group": "one replica per card",
                "fleet": "one pipeline across the hosts"}[scope]
    return {"host": f"TP {tp} groups as pipeline stages, one replica per host",
            "group": f"one replica per TP {tp} group",
            "fleet": f"TP {tp} groups as pipeline stages across the hosts"}[scope]


def enumerate_layouts(fleet: Fleet, tp_sizes=None) -> list[Layout]:
    """Every layout for the given TP sizes (default: 1, and 2/4/8 up to the largest host),
    duplicates merged (a host with one TP group gives the same replica per host and per group)."""
    most = max(len(h.gpus) for h in fleet.hosts)
    sizes = sorted(set(tp_sizes)) if tp_sizes else [t for t in DEFAULT_TP_SIZES if t <= most]
    if any(t < 1 for t in sizes):
        raise BadRequest("TP sizes must be >= 1")
    out: list[Layout] = []
    for tp in sizes:
        per_host = {h.name: group_host(h, tp) for h in fleet.hosts}
        # one replica per host
        reps, idle = [], []
        for h in fleet.hosts:
            groups, left, why = per_host[h.name]
            reps.append(ReplicaLayout(h.name, tuple(groups), why) if not why else ReplicaLayout(h.name, (), why))
            idle += left
            if why:
                idle += [(c, why) for c in h.cards()]
        out.append(Layout(f"host-tp{tp}", _label("host", tp), tp, "host", tuple(reps), tuple(idle)))
        # one replica per group
        reps, idle = [], []
        for h in fleet.hosts:
            groups, left, why = per_host[h.name]
            for g in groups:
                reps.append(ReplicaLayout(f"{h.name}:{','.join(str(c.gpu.index) for c in g)}", (g,)))
            idle += left + ([(c, why) for c in h.cards()] if why else [])
            if why:
                reps.append(ReplicaLayout(h.name, (), why))
        out.append(Layout(f"group-tp{tp}", _label("group", tp), tp, "group", tuple(reps), tuple(idle)))
        # one pipeline across the hosts
        if len(fleet.hosts) > 1:
            stages, idle, why_not = [], [], []
            for h in fleet.hosts:
                groups, left, why = per_host[h.name]
                stages += groups
                idle += left + ([(c, why) for c in h.cards()] if why else [])
                if why:
                    why_not.append(why)
            hosts_used = list(dict.fromkeys(c.host for s in stages for c in s))
            name = "+".join(hosts_used) or "fleet"
            if len(hosts_used) < 2:
                rep = ReplicaLayout(name, (), "; ".join(why_not) or "fewer than two hosts can form stages")
            else:
                rep = ReplicaLayout(name, tuple(stages))
            out.append(Layout(f"fleet-tp{tp}", _label("fleet", tp), tp, "fleet", (rep,), tuple(idle)))
    merged: list[Layout] = []
    for lay in out:
        twin = next((m for m in merged if lay.key() and m.key() == lay.key()), None)
        if twin is not None:
            merged[merged.index(twin)] = replace(twin, aliases=twin.aliases + (lay.id,))
        else:
            merged.append(lay)
    return merged


# --------------------------------------------------------------------------------------------
# planned replicas and topologies


@dataclass
class ReplicaPlan:
    name: str
    layout: ReplicaLayout
    tp: int
    fits: bool
    reason: str = ""
    plan: Plan | None = None
    stage_of_rank: list[tuple[Card, ...]] = field(default_factory=list)
    network_hops: int = 0
    speeds: list[StageSpeed] = field(default_factory=list)
    hops: list[bool] = field(default_factory=list)
    decode_ms: float | None = None
    batch: int = 0
    decode_context_tokens: int = 0
    tokens_per_s: float | None = None
    largest_fitting_max_model_len: int | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def pp(self) -> int:
        return len(self.layout.stages)

    def shape(self, cards: bool = False) -> str:
        """``TP2 x PP2``, ``PP2``, ``TP2`` or ``1 card``; with ``cards`` the stages' cards too."""
        if not self.layout.stages:
            return "-"
        if self.tp > 1:
            par = f"TP{self.tp}" + (f" x PP{self.pp}" if self.pp > 1 else "")
        else:
            par = f"PP{self.pp}" if self.pp > 1 else "1 card"
        if not cards:
            return par
        kinds = [f"{len(s)}x {s[0].gpu.short_name}" if len(s) > 1 else s[0].gpu.short_name
                 for s in (self.stage_of_rank or self.layout.stages)]
        return f"{par} [{' | '.join(kinds)}]"

    def serve_today(self) -> tuple[bool, str]:
        """(runs with this package or stock vLLM today, how)."""
        hosts = self.layout.hosts
        mml = f" --max-model-len {self.plan.max_model_len}" if self.plan is not None else ""
        if len(hosts) > 1 and self.tp == 1:
            return False, (f"stages across hosts: vllm serve MODEL --pipeline-parallel-size {self.pp} "
                           f"--distributed-executor-backend dualgpu-ray{mml} on a Ray cluster (docs/multi-node.md; "
                           "CPU-tested, not yet run on GPUs)")
        if len(hosts) > 1:
            return False, ("TP groups as stages across hosts: not yet with the dualgpu-ray executor (it plans "
                           "TP 1); stock vLLM on Ray runs it with an even split")
        if self.pp == 1:
            tp = f" --tensor-parallel-size {self.tp}" if self.tp > 1 else ""
            return True, f"stock vLLM: vllm serve MODEL{tp}{mml}"
        tp = f" --tensor-parallel-size {self.tp}" if self.tp > 1 else ""
        return True, f"vllm serve MODEL --pipeline-parallel-size {self.pp}{tp} --distributed-executor-backend dualgpu{mml}"

    def status(self) -> str:
        """``yes`` (runs today), ``CPU-tested`` (stages across hosts on dualgpu-ray: not yet run on
        GPUs) or ``not yet`` (needs executor work)."""
        if self.serve_today()[0]:
            return "yes"
        return "CPU-tested" if len(self.layout.hosts) > 1 and self.tp == 1 else "not yet"

    def to_dict(self) -> dict:
        ok, how = self.serve_today()
        p = self.plan
        return {
            "name": self.name,
            "fits": self.fits,
            "reason": self.reason,
            "hosts": self.layout.hosts,
            "tp": self.tp,
            "pp": self.pp,
            "shape": self.shape(cards=True),
            "stages": [[c.label for c in s] for s in (self.stage_of_rank or self.layout.stages)],
            "max_model_len": p.max_model_len if p else None,
            "max_context_tokens": p.max_context_tokens if p else None,
            "largest_fitting_max_model_len": self.largest_fitting_max_model_len,
            "num_blocks": p.num_blocks if p else None,
            "block_size": p.block_size if p else None,
            "pool_tokens": p.pool_tokens if p else None,
            "kv_cache_bytes_per_card": [r.kv_cache_bytes for r in p.ranks] if p else None,
            "partition": list(p.partition) if p else None,
            "decode_ms_per_step": None if self.decode_ms is None else round(self.decode_ms, 3),
            "decode_context_tokens": self.decode_context_tokens,
            "batch": self.batch,
            "tokens_per_s": None if self.tokens_per_s is None else round(self.tokens_per_s, 1),
            "network_hops": self.network_hops,
            "runs_today": ok,
            "serve": how,
            "notes": list(self.notes),
        }


@dataclass
class TopologyPlan:
    layout: Layout
    replicas: list[ReplicaPlan]

    @property
    def id(self) -> str:
        return self.layout.id

    @property
    def fitting(self) -> list[ReplicaPlan]:
        return [r for r in self.replicas if r.fits]

    @property
    def fits(self) -> bool:
        return bool(self.fitting)

    @property
    def idle(self) -> list[tuple[Card, str]]:
        out = list(self.layout.idle)
        for r in self.replicas:
            if not r.fits and r.layout.stages:
                out += [(c, f"replica {r.name} does not fit") for c in r.layout.cards]
        seen, uniq = set(), []
        for c, why in out:
            if (c.host, c.gpu.index) not in seen:
                seen.add((c.host, c.gpu.index))
                uniq.append((c, why))
        return uniq

    @property
    def tokens_per_s(self) -> float | None:
        vals = [r.tokens_per_s for r in self.fitting]
        return None if not vals or any(v is None for v in vals) else sum(vals)  # type: ignore[arg-type]

    @property
    def decode_ms(self) -> float | None:
        vals = [r.decode_ms for r in self.fitting if r.decode_ms is not None]
        return min(vals) if vals else None

    @property
    def max_context_tokens(self) -> int:
        vals = [r.plan.max_context_tokens for r in self.fitting if r.plan]
        return min(vals) if vals else 0

    @property
    def runs_today(self) -> bool:
        return self.fits and all(r.serve_today()[0] for r in self.fitting)

    @property
    def status(self) -> str:
        """The least ready of its replicas' :meth:`ReplicaPlan.status` words."""
        words = [r.status() for r in self.fitting] or ["not yet"]
        return max(words, key=STATUS_ORDER.index)

    @property
    def network_hops(self) -> int:
        return sum(r.network_hops for r in self.fitting)

    def to_dict(self) -> dict:
        tps = self.tokens_per_s
        return {
            "id": self.id,
            "label": self.layout.label,
            "aliases": list(self.layout.aliases),
            "tp": self.layout.tp,
            "scope": self.layout.scope,
            "fits": self.fits,
            "replicas": [r.to_dict() for r in self.replicas],
            "max_context_tokens": self.max_context_tokens,
            "decode_ms_per_step": None if self.decode_ms is None else round(self.decode_ms, 3),
            "tokens_per_s": None if tps is None else round(tps, 1),
            "idle_cards": [{"card": c.label, "why": why} for c, why in self.idle],
            "runs_today": self.runs_today,
            "status": self.status,
        }


def stage_cards(full: ModelSpec, shard: ModelSpec, stages, tp: int,
                request: PlanRequest) -> tuple[list[GpuFacts], list[str], int]:
    """One card standing for each TP group of ``stages`` (index: the stage's position), charged
    what a TP rank needs beyond its shard config (:func:`tp_extra_reserve`); the notes; that
    charge."""
    from vllm_dualgpu.planner.memory import default_batch_limits

    first = stages[0][0].gpu
    tokens, seqs = default_batch_limits(first.total_bytes, first.name)
    seqs = request.max_num_seqs or seqs
    extra = tp_extra_reserve(full, shard, tp, seqs, request.memory,
                             max_num_batched_tokens=request.max_num_batched_tokens or tokens,
                             dtype=request.model_dtype)
    cards = [_stage_card(s, j, extra) for j, s in enumerate(stages)]
    notes = []
    if any(len({c.gpu.budget_bytes for c in s}) > 1 for s in stages):
        notes.append("TP groups planned as equals at the smaller card's free memory")
    return cards, notes, extra


def _stage_card(stage: tuple[Card, ...], index: int, extra_reserve: int) -> GpuFacts:
    """One card standing for a TP group: the smallest budget and the slowest bandwidth of it."""
    small = min(stage, key=lambda c: (c.gpu.budget_bytes, c.gpu.index))
    bws = [c.gpu.bandwidth_gbps for c in stage]
    bw = None if any(b is None for b in bws) else min(bws)  # type: ignore[type-var]
    g = small.gpu
    return replace(g, index=index, bandwidth_gbps=bw, reserve_bytes=g.reserve_bytes + extra_reserve,
                   nvlink=all(c.gpu.nvlink for c in stage) if len(stage) > 1 else g.nvlink)


def _one_fit(model: ModelSpec, gpus: list[GpuFacts], req: PlanRequest) -> Fit:
    """``fit()``, with the single-stage case (which ``plan()`` passes through to stock vLLM
    without checking) held to the same fit rules."""
    if len(gpus) > 1:
        return fit(model, gpus, req)
    p = plan(model, gpus, replace(req, pp_size=1))
    if not p.ranks:
        raise ModelDoesNotFit(0, gpus[0].name, 1, what="; ".join(p.notes), kv_cache_dtype=req.kv_cache_dtype)
    r = p.ranks[0]
    need = (p.kv.blocks_per_request(1) + 1) * r.kv_bytes_per_block
    if r.kv_budget_bytes < need:
        raise ModelDoesNotFit(0, gpus[0].short_name, need - r.kv_budget_bytes, kv_cache_dtype=req.kv_cache_dtype)
    largest = min(p.kv_max_context_tokens, model.max_position_embeddings)
    if req.max_model_len == -1:
        return Fit(plan(model, gpus, replace(req, pp_size=1, max_model_len=largest)), True, None, largest)
    if largest < p.max_model_len:
        at_largest = plan(model, gpus, replace(req, pp_size=1, max_model_len=largest))
        return Fit(at_largest, False, p.max_model_len, largest)
    return Fit(p, True, p.max_model_len, largest)


def _stage_speeds(p: Plan, tp: int, context: int) -> list[StageSpeed]:
    """Each rank's decode reads split into the part read once per step and the part per sequence
    (K/V at ``context`` tokens plus twice the recurrent state, as the planner counts it)."""
    out = []
    n = len(p.ranks)
    for i, r in enumerate(p.ranks):
        per_tok, state = p.kv.bytes_per_token_read(r.layers.start, r.layers.stop, i == n - 1)
        weights = r.decode_read_bytes - (p.decode_context_tokens * per_tok + 2 * state)
        ar = (2 * r.num_layers + (i == 0) + (i == n - 1)) if tp > 1 else 0
        out.append(StageSpeed(weights, context * per_tok + 2 * state, r.gpu.bandwidth_gbps or 0.0, tp, ar,
                              bool(r.gpu.nvlink) and tp > 1))
    return out


def plan_replica(
    full: ModelSpec,
    shard: ModelSpec | None,
    layout: ReplicaLayout,
    tp: int,
    request: PlanRequest,
    link: LinkModel,
    shard_error: str | None = None,
) -> ReplicaPlan:
    rp = ReplicaPlan(layout.name, layout, tp, fits=False)
    if layout.refusal:
        rp.reason = layout.refusal
        return rp
    if shard is None:
        rp.reason = shard_error or "cannot shard the model"
        return rp
    cards, notes, _ = stage_cards(full, shard, layout.stages, tp, request)
    rp.notes += notes
    hosts = layout.hosts
    orders: list[list[int] | None] = [None]
    if len(hosts) > 1:  # keep each host's stages together; try every order of the hosts
        by_host = {h: [j for j, s in enumerate(layout.stages) if s[0].host == h] for h in hosts}
        for h in by_host:
            by_host[h].sort(key=lambda j: (cards[j].budget_bytes, cards[j].total_bytes, j))
        orders = [[j for h in perm for j in by_host[h]] for perm in itertools.permutations(hosts)]
    base = replace(request, pp_size=len(cards), layer_partition=None, gpu_order=None)
    plans: list[Plan] = []
    short: list[Fit | PlanError] = []  # in order tried: falls short (a Fit) or does not fit at all
    for order in orders:
        try:
            f = _one_fit(shard, cards, replace(base, gpu_order=order))
        except PlanError as e:
            short.append(e)
            continue
        if f.fits:
            plans.append(f.plan)
        else:
            short.append(f)
    if not plans:
        closest = max(short, key=lambda o: o.largest_max_model_len if isinstance(o, Fit) else -1)
        if isinstance(closest, Fit):
            rp.reason = str(closest.error)
            rp.largest_fitting_max_model_len = closest.largest_max_model_len
            rp.plan = closest.plan
            rp.stage_of_rank = [layout.stages[i] for i in closest.plan.order]
        else:
            rp.reason = str(closest)
        return rp

    def hops_of(p: Plan) -> list[bool]:
        hs = [layout.stages[i][0].host for i in p.order]
        return [a != b for a, b in zip(hs, hs[1:])]

    chosen = best_plan(plans, lambda p: sum(hops_of(p)))
    rp.plan = chosen
    rp.fits = True
    rp.stage_of_rank = [layout.stages[i] for i in chosen.order]
    rp.hops = hops_of(chosen)
    rp.network_hops = sum(rp.hops)
    ctx = min(request.decode_context_tokens or chosen.max_model_len, chosen.max_model_len)
    rp.decode_context_tokens = ctx
    per_req = chosen.kv.blocks_per_request(ctx)
    rp.batch = max(0, min(chosen.max_num_seqs, (chosen.num_blocks - 1) // per_req)) if per_req else 0
    rp.speeds = _stage_speeds(chosen, tp, ctx)
    if all(s.bandwidth_gbps for s in rp.speeds):
        rp.decode_ms = step_ms(rp.speeds, rp.hops, 1, full.hidden_size, link)
        rp.tokens_per_s = throughput(rp.speeds, rp.hops, rp.batch, full.hidden_size, link)
    return rp


@dataclass
class FleetPlan:
    fleet: Fleet
    model: ModelSpec
    request: PlanRequest
    link: LinkModel
    topologies: list[TopologyPlan]
    prefer: str = "throughput"
    recommended: TopologyPlan | None = None
    reason: str = ""

    @property
    def fitting(self) -> list[TopologyPlan]:
        return [t for t in self.topologies if t.fits]

    def get(self, topology_id: str) -> TopologyPlan:
        for t in self.topologies:
            if t.id == topology_id or topology_id in t.layout.aliases:
                return t
        raise BadRequest(f"no topology {topology_id!r}; the topologies are {', '.join(t.id for t in self.topologies)}")

    def what_fits(self) -> str:
        """For 'nothing fits': the largest --max-model-len each replica could hold."""
        best = []
        for t in self.topologies:
            for r in t.replicas:
                if r.largest_fitting_max_model_len:
                    best.append((r.largest_fitting_max_model_len, t.id, r.name))
        if not best:
            return "no topology fits even one request; use a smaller weight format or more memory"
        best.sort(reverse=True)
        top = ", ".join(f"{n:,} on {tid} ({name})" for n, tid, name in best[:3])
        return f"the largest --max-model-len that fits: {top}"

    def to_dict(self) -> dict:
        return {
            "fleet": self.fleet.to_dict(),
            "model": self.model.to_dict(),
            "request": self.request.to_dict(),
            "link": self.link.to_dict(),
            "prefer": self.prefer,
            "topologies": [t.to_dict() for t in self.topologies],
            "recommended": self.recommended.id if self.recommended else None,
            "reason": self.reason,
        }


def recommend(topologies: list[TopologyPlan], prefer: str = "throughput") -> tuple[TopologyPlan | None, str]:
    """The topology to pick and why. ``throughput`` (default): the highest predicted aggregate
    decode rate; ``latency``: the fastest single stream; ``context``: the longest context. Within
    3% of the best, a topology that runs today wins, then the longer context, fewer idle cards,
    fewer network hops."""
    if prefer not in PREFERENCES:
        raise BadRequest(f"prefer {prefer!r}: use one of {', '.join(PREFERENCES)}")
    fit = [t for t in topologies if t.fits]
    if not fit:
        return None, "no topology fits"

    def metric(t: TopologyPlan) -> float:
        if prefer == "latency":
            return -(t.decode_ms or float("inf"))
        if prefer == "context":
            return float(t.max_context_tokens)
        return t.tokens_per_s or 0.0

    ready = min((STATUS_ORDER.index(t.status) for t in fit))
    everything, fit = fit, [t for t in fit if STATUS_ORDER.index(t.status) == ready]
    top = max(metric(t) for t in fit)
    near = [t for t in fit if (metric(t) >= top * TIE if top >= 0 else metric(t) >= top / TIE)]
    tie_key = lambda t: (not t.runs_today, -t.max_context_tokens, len(t.idle), t.network_hops, -(t.tokens_per_s or 0))  # noqa: E731
    best = min(near, key=tie_key)
    rest = sorted((t for t in fit if t is not best), key=lambda t: -metric(t))
    what = {
        "throughput": f"the highest predicted aggregate decode throughput, {best.tokens_per_s or 0:,.0f} tokens/s",
        "latency": f"the fastest predicted single stream, {best.decode_ms or 0:.1f} ms per step",
        "context": f"the longest context, {best.max_context_tokens:,} tokens",
    }[prefer]
    among = (f"among {len(fit)} topologies that fit and run today" if ready == 0 else
             f"among {len(fit)} topologies that fit; none that fits runs today" if len(fit) == len(everything) else
             f"among {len(fit)} topologies that fit and are CPU-tested; none that fits runs today")
    parts = [f"{best.id} ({best.layout.label}): {what}, {among}"]
    if rest:
        r = rest[0]
        if prefer == "throughput" and r.tokens_per_s and best.tokens_per_s:
            parts.append(f"next {r.id} at {r.tokens_per_s:,.0f} tokens/s ({(1 - r.tokens_per_s / best.tokens_per_s) * 100:.0f}% less)"
                         if r.tokens_per_s <= best.tokens_per_s else
                         f"{r.id} predicts {r.tokens_per_s:,.0f} tokens/s, within 3%, but loses the tie-break")
        elif prefer == "latency" and r.decode_ms and best.decode_ms:
            parts.append(f"next {r.id} at {r.decode_ms:.1f} ms per step")
        elif prefer == "context":
            parts.append(f"next {r.id} at {r.max_context_tokens:,} tokens")
    if best.decode_ms is not None:
        parts.append(f"single stream {best.decode_ms:.1f} ms per step on its fastest replica")
    idle = best.idle
    parts.append(f"{len(idle)} card(s) idle" if idle else "no card idle")
    parts.append({"yes": "runs today",
                  "CPU-tested": "dualgpu-ray across the hosts: CPU-tested, not yet run on GPUs",
                  "not yet": "needs executor work that is not done yet (see each replica's serve line)"}[best.status])
    better = [t for t in everything if t not in fit and metric(t) > metric(best)]
    if better:
        alt = max(better, key=metric)
        gain = {"throughput": f"{alt.tokens_per_s or 0:,.0f} tokens/s", "latency": f"{alt.decode_ms or 0:.1f} ms per step",
                "context": f"{alt.max_context_tokens:,} tokens"}[prefer]
        ready_word = "is CPU-tested only" if alt.status == "CPU-tested" else "does not run yet"
        parts.append(f"{alt.id} predicts more ({gain}) but {ready_word}")
    return best, "; ".join(parts)


def plan_fleet(
    cfg: dict,
    fleet: Fleet,
    request: PlanRequest | None = None,
    *,
    weight_format: str = "auto",
    quantization: str | None = None,
    tp_sizes=None,
    link: LinkModel | None = None,
    prefer: str = "throughput",
) -> FleetPlan:
    """Plan every topology of ``fleet`` for the model of ``cfg`` (its ``config.json`` contents)."""
    request = request or PlanRequest()
    link = link or LinkModel()
    if prefer not in PREFERENCES:
        raise BadRequest(f"prefer {prefer!r}: use one of {', '.join(PREFERENCES)}")
    full = ModelSpec.from_hf_config(cfg, weight_format=weight_format, quantization=quantization)
    layouts = enumerate_layouts(fleet, tp_sizes)
    shards: dict[int, tuple[ModelSpec | None, str | None]] = {}
    for tp in {lay.tp for lay in layouts}:
        try:
            shards[tp] = (full if tp == 1 else ModelSpec.from_hf_config(
                shard_config(cfg, tp), weight_format=weight_format, quantization=quantization), None)
        except BadRequest as e:
            shards[tp] = (None, str(e))
    tops = []
    for lay in layouts:
        shard, err = shards[lay.tp]
        tops.append(TopologyPlan(lay, [plan_replica(full, shard, r, lay.tp, request, link, err) for r in lay.replicas]))
    fp = FleetPlan(fleet, full, request, link, tops, prefer)
    fp.recommended, fp.reason = recommend(tops, prefer)
    return fp
