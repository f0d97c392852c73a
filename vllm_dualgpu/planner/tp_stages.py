"""Pipeline stages that are tensor-parallel groups on one host: which cards form each stage, the
card that stands for each stage when the split is planned, and vLLM's rank of every card.

The rule (the executor and ``vllm-dualgpu plan -tp N`` both apply it, docs/topologies.md):

* the first ``pp x tp`` cards given (the executor: the visible ones, in PCI bus order) are used;
* a stage is ``tp`` cards of one kind (same name and memory, :func:`topology.group_host`), taken
  in card order; cards of different kinds in one stage are refused (vLLM splits every layer
  evenly over a TP group, so the group would run at its smallest card's memory and speed);
* each stage is planned as one card at its smallest card's budget (equal cards with different
  free memory: "planned as equals at the smaller card's free memory"), on the model as one TP
  rank sees it (:mod:`topology_shard`: attention, KV and MLP sharded 1/tp, vocabulary-parallel
  embedding and head, norms whole, KV heads replicated when fewer than ``tp``), charged what a
  TP rank needs beyond that (:func:`topology_shard.tp_extra_reserve`); a drafter with a
  checkpoint of its own is sharded the same way (vLLM runs it at the target's TP size);
* the planner orders the stages as it orders single cards (the stage with the most memory last:
  it holds the output head), and vLLM numbers the cards ``rank = stage x tp + tp_rank``
  (:func:`rank_cards`).

With ``tp == 1`` every card is its own stage and nothing changes from a plain pipeline.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from vllm_dualgpu.planner.errors import BadRequest
from vllm_dualgpu.planner.gpus import GpuFacts
from vllm_dualgpu.planner.model import ModelSpec
from vllm_dualgpu.planner.search import PlanRequest
from vllm_dualgpu.planner.topology import Card, Host, group_host, stage_cards
from vllm_dualgpu.planner.topology_shard import shard_config


@dataclass(frozen=True)
class TpStages:
    tp: int
    stages: tuple[tuple[GpuFacts, ...], ...]
    """Each stage's cards (the given facts), in the order of their first cards."""
    cards: tuple[GpuFacts, ...]
    """One card per stage, what the planner is given; its ``index`` is the stage's first card's,
    so a plan's ``order`` names each stage by its first card."""
    model: ModelSpec
    """The model as one TP rank sees it (the full model when ``tp == 1``)."""
    extra_reserve_bytes: int
    """What each TP rank is charged beyond its shard config (0 when ``tp == 1``)."""
    request: PlanRequest
    """The request to plan the stages with: the given one, its drafter's config sharded."""
    notes: tuple[str, ...] = ()

    def rank_cards(self, order: list[int]) -> list[tuple[int, int, GpuFacts]]:
        """(stage, tp_rank, card) for vLLM's global ranks 0, 1, ... given the plan's stage order.

        vLLM lays its ranks out as ``arange(world).reshape(-1, dp, pp, pcp, tp)``
        (distributed/parallel_state.py:2052 in 0.30.0, :2158 in 0.33.0): with dp = pcp = 1,
        ``rank = pipeline_rank x tp + tp_rank``, and TP groups are consecutive ranks.
        """
        by_first = {s[0].index: s for s in self.stages}
        return [(p, t, by_first[i][t]) for p, i in enumerate(order) for t in range(self.tp)]


def too_few_cards(pp: int, tp: int, names: list[str]) -> str | None:
    """The refusal when ``pp x tp`` cards are not there, else None."""
    need = pp * tp
    if len(names) >= need:
        return None
    sizes = f"--pipeline-parallel-size {pp}" + (f" x --tensor-parallel-size {tp}" if tp > 1 else "")
    return (
        f"{sizes} needs {need} GPUs, but only {len(names)} {'is' if len(names) == 1 else 'are'} "
        f"visible ({', '.join(names) or 'none'}). Lower the sizes or check CUDA_VISIBLE_DEVICES."
    )


def group_stages(gpus: list[GpuFacts], pp: int, tp: int) -> list[tuple[GpuFacts, ...]]:
    """The ``pp`` stages of ``tp`` cards each, from the first ``pp x tp`` of ``gpus``."""
    if tp < 1 or pp < 1:
        raise BadRequest("--pipeline-parallel-size and --tensor-parallel-size must be >= 1")
    why = too_few_cards(pp, tp, [g.name for g in gpus])
    if why:
        raise BadRequest(why)
    used = gpus[: pp * tp]
    groups, idle, refusal = group_host(Host("this host", tuple(used)), tp)
    if idle or refusal:
        odd = [c.gpu for c, _ in idle] if idle else used
        left = ", ".join(f"GPU {g.index} ({g.short_name}, {g.total_bytes / 1024**3:.0f} GiB)" for g in odd)
        raise BadRequest(
            f"mixed TP group: --tensor-parallel-size {tp} x --pipeline-parallel-size {pp} needs "
            f"stages of {tp} cards of one kind; of GPUs {', '.join(f'{g.index}:{g.short_name}' for g in used)}, "
            f"{left} would share a stage with a card of another kind. vLLM splits every layer "
            "evenly over a TP group, so it would run at the smallest card's memory and the slowest "
            f"card's speed. Choose {tp} cards of one kind per stage with CUDA_VISIBLE_DEVICES, or "
            "use -tp 1 (one pipeline stage per card)."
        )
    return [tuple(c.gpu for c in g) for g in groups]


def plan_stages(cfg: dict, gpus: list[GpuFacts], pp: int, tp: int, request: PlanRequest,
                **model_kw) -> TpStages:
    """Group ``gpus`` into stages and build what the planner is asked with (see the module).

    ``cfg``: the model's ``config.json`` contents; ``model_kw``: ``ModelSpec.from_hf_config``'s
    keywords (weight format, quantization). Raises :class:`BadRequest` for too few cards, a
    mixed TP group, or a ``tp`` the model's heads or sizes do not divide.
    """
    stages = group_stages(gpus, pp, tp)
    full = ModelSpec.from_hf_config(cfg, **model_kw)
    if tp == 1:
        return TpStages(1, tuple(stages), tuple(s[0] for s in stages), full, 0, request)
    shard = ModelSpec.from_hf_config(shard_config(cfg, tp), **model_kw)
    wrapped = [tuple(Card("this host", g) for g in s) for s in stages]
    cards, notes, extra = stage_cards(full, shard, wrapped, tp, request)
    cards = [replace(c, index=s[0].index) for c, s in zip(cards, stages)]
    return TpStages(tp, tuple(stages), tuple(cards), shard, extra, _shard_drafter(request, tp), tuple(notes))


def _shard_drafter(request: PlanRequest, tp: int) -> PlanRequest:
    """The request with its drafter's own config (EAGLE3, DFlash, a draft model) as one rank of
    the drafter's TP group holds it: vLLM runs the drafter at the target's TP size unless
    ``draft_tensor_parallel_size`` is 1 (``SpeculativeConfig._verify_and_get_draft_tp``)."""
    spec = request.speculative or {}
    key = next((k for k in ("draft_config", "draft_hf_config") if spec.get(k)), None)
    draft_tp = int(spec.get("draft_tensor_parallel_size") or tp)
    if key is None or draft_tp == 1:
        return request
    try:
        sharded = shard_config(spec[key], draft_tp)
    except BadRequest as e:
        raise BadRequest(f"the drafter: {e}") from None
    return replace(request, speculative={**spec, key: sharded})
