"""The split objectives: which of the splits that hold the asked context the search takes.

``speed`` (the default): among the splits whose pool holds ``--max-num-seqs`` requests of
``--max-model-len`` tokens at once (when no split does, those that hold one request), with
:data:`HOLD_MARGIN` to spare where a split can, the fastest predicted decode step; splits
within :data:`SPEED_TOLERANCE` of the fastest count as equally fast and the one with the
largest KV pool wins among them. ``pool``: the largest KV
pool; among the splits within :data:`POOL_TOLERANCE` of it, the fastest predicted decode step.
``auto`` is ``speed`` (as it was before; kept for existing settings). ``--max-model-len auto``
asks for the longest context, so it is planned by ``pool`` whatever the objective.

Candidates are the search's (planner/search.py): anything with ``num_blocks``, ``per_request``
(the blocks one request of the asked length takes from that pool: each split is priced with its
own KV grouping, so blocks of two splits can differ in size and pools are compared in requests),
``decode_ms`` (None where a card's bandwidth is unknown), ``order`` and ``partition``.
"""

from __future__ import annotations

from dataclasses import dataclass

OBJECTIVES = ("speed", "pool", "auto")
DEFAULT_OBJECTIVE = "speed"
#: "pool": splits within this share of the largest pool count as equal; the faster one wins.
POOL_TOLERANCE = 0.99
#: "speed": splits predicted within 0.5% of the fastest decode step count as equally fast (on the
#: reference pair one layer moved between the cards changes the step by 1-1.5%); the larger pool wins.
SPEED_TOLERANCE = 0.005
#: "speed": a split must hold what it must hold (the requests asked) with this much to spare, when
#: any split does: the plan predicts vLLM's pool within a few percent (issue #28 asks 3%), and a
#: pool short of --max-model-len refuses the context at boot. The pool objective keeps its margin
#: by choosing the largest pool.
HOLD_MARGIN = 0.03
#: The environment variable that selects the objective (read by the executor and ``plan``).
OBJECTIVE_ENV = "VLLM_DUALGPU_OBJECTIVE"


def rule(objective: str, auto_fit: bool) -> str:
    """The rule a request's objective applies: "speed" or "pool"."""
    return "pool" if objective == "pool" or auto_fit else "speed"


def pool_size(c) -> float:
    """A candidate's pool in requests of the asked length (vLLM's concurrency figure)."""
    return c.num_blocks / c.per_request


def holds(c, requests: int, margin: float = 0.0) -> bool:
    """Whether a candidate's pool holds ``requests`` requests of the asked length at once (with
    the null block), with ``margin`` to spare."""
    return c.num_blocks >= (requests * c.per_request + 1) * (1 + margin)


def select(cands: list, rule_: str, seqs: int = 0):
    """The candidate the rule takes. ``seqs``: how many requests of the full length
    (``--max-num-seqs``) "speed" asks a pool to hold at once: it keeps the candidates that hold
    them when any does, and of those the ones that hold what they must (those requests, or one)
    with :data:`HOLD_MARGIN` to spare, when any does (0: nothing asked, no margin)."""
    if rule_ == "pool":
        best = max(pool_size(c) for c in cands)
        tied = [c for c in cands if pool_size(c) >= best * POOL_TOLERANCE]
        return min(tied, key=lambda c: (c.decode_ms or 0.0, -c.partition[-1], c.partition))
    holds_seqs = seqs > 0 and any(holds(c, seqs) for c in cands)
    held = [c for c in cands if holds(c, seqs)] if holds_seqs else list(cands)
    if seqs > 0:
        need = seqs if holds_seqs else 1
        held = [c for c in held if holds(c, need, HOLD_MARGIN)] or held
    fastest = min(c.decode_ms for c in held)
    near = [c for c in held if c.decode_ms <= fastest * (1 + SPEED_TOLERANCE) + 1e-9]
    return min(near, key=lambda c: (-pool_size(c), c.decode_ms, -c.partition[-1], c.partition))


@dataclass(frozen=True)
class PoolAlternative:
    """What the ``pool`` objective gives for the same request, where it differs from the plan."""

    order: list[int]
    partition: list[int]
    num_blocks: int
    pool_tokens: int
    predicted_decode_ms: float | None

    @classmethod
    def of(cls, plan) -> "PoolAlternative":
        return cls(list(plan.order), list(plan.partition), plan.num_blocks, plan.pool_tokens,
                   plan.predicted_decode_ms)

    def to_dict(self) -> dict:
        ms = self.predicted_decode_ms
        return {"order": list(self.order), "partition": list(self.partition), "num_blocks": self.num_blocks,
                "pool_tokens": self.pool_tokens, "predicted_decode_ms": None if ms is None else round(ms, 3)}


def _split(order, partition, other_order) -> str:
    text = "/".join(map(str, partition))
    return f"GPUs {','.join(map(str, order))} split {text}" if list(order) != list(other_order) else f"split {text}"


def trade_line(plan) -> str | None:
    """One line when the plan's split is not the pool objective's: the chosen split with its
    predicted step and pool, what ``pool`` would give instead and how to ask for it; None when
    they agree (or the plan was not chosen by ``speed``)."""
    alt = plan.pool_alternative
    if alt is None:
        return None
    ms, alt_ms = plan.predicted_decode_ms, alt.predicted_decode_ms
    return (
        f"vllm-dualgpu plan: {_split(plan.order, plan.partition, alt.order)} for the fastest predicted "
        f"decode, {ms:.1f} ms per step with a KV pool of {plan.pool_tokens:,} tokens; the pool "
        f"objective gives {_split(alt.order, alt.partition, plan.order)}, {alt.pool_tokens:,} tokens at "
        f"{alt_ms:.1f} ms per step (set {OBJECTIVE_ENV}=pool for it)"
    )
