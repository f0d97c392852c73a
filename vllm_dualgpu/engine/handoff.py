"""What the executor tells each worker, carried in the config the workers receive.

The executor plans in the EngineCore process; the workers are separate processes that receive
the ``VllmConfig`` (pickled or forked). The plan's per-rank facts travel in
``vllm_config.additional_config["dualgpu"]["plan"]`` as one typed record, written once by
:func:`store` and read once per worker by :func:`load`. Nothing here goes through environment
variables except ``VLLM_PP_LAYER_PARTITION``, which is vLLM's own interface for the split (see
:mod:`vllm_dualgpu.engine.partition`).

vLLM hashes ``additional_config`` into its compile-cache key, so the record holds only what is
the same from one boot of the same command to the next on the same cards: reserves, caps, the
split and the planner's prediction of what vLLM charges besides the KV cache (weights,
activations, buffers), never free memory or a KV budget, which move with what else runs.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from vllm_dualgpu.virtual_gpus import VirtualCard
from vllm_dualgpu.process import HANDOFF_KEY as KEY
from vllm_dualgpu.process import PLAN_KEY as PLAN


@dataclass(frozen=True)
class RankRecord:
    """One vLLM rank's share of the plan (a pipeline stage, or one TP rank of a stage's group)."""

    rank: int
    """vLLM's global rank: ``stage x tp_size + tp_rank`` (planner/tp_stages.py)."""
    physical_gpu_id: int
    gpu_name: str
    reserve_bytes: int
    cap_bytes: int | None
    """An explicit --gpu-memory-utilization times this card's total, else None."""
    num_layers: int
    predicted_non_kv_bytes: int | None
    """What the planner expects vLLM's profile to charge besides the KV cache (no CUDA context)."""
    stage: int | None = None
    """Its pipeline rank (None: ``rank``, a pipeline without TP)."""
    tp_rank: int = 0
    node_id: str | None = None
    """The Ray node of this rank (the dualgpu-ray executor); None on one host."""
    virtual_card: VirtualCard | None = None
    """The emulated card this rank presents as (VLLM_DUALGPU_VIRTUAL_GPUS); None: a real card."""
    after_profile_bytes: int = 0
    """What vLLM allocates after its profile sized the KV cache, which it never charges: FlashInfer's
    workspace buffers (vLLM 0.33 builds the attention backends with the KV cache). The worker
    leaves it out of the budget it hands vLLM."""
    reserve_reason: str | None = None
    """Why ``reserve_bytes`` (``envs.Reserve.why``: the card's display state, or
    VLLM_DUALGPU_RESERVE); None: not recorded."""

    @classmethod
    def from_dict(cls, data: dict) -> RankRecord:
        d = dict(data)
        if d.get("virtual_card") is not None:
            d["virtual_card"] = VirtualCard.from_dict(d["virtual_card"])
        return cls(**d)


@dataclass(frozen=True)
class Handoff:
    ranks: tuple[RankRecord, ...]
    partition: tuple[int, ...] | None
    partition_source: str
    """"plan" (the planner's split), "user" (VLLM_PP_LAYER_PARTITION) or "even" (vLLM's own)."""
    tp_size: int = 1

    def rank(self, rank: int) -> RankRecord | None:
        """The record of vLLM's global rank ``rank`` (a worker's ``self.rank``)."""
        found = [r for r in self.ranks if r.rank == rank]
        return found[0] if found else None

    def to_dict(self) -> dict:
        return {
            "ranks": [asdict(r) for r in self.ranks],
            "partition": list(self.partition) if self.partition else None,
            "partition_source": self.partition_source,
            "tp_size": self.tp_size,
        }

    @classmethod
    def from_dict(cls, data: dict) -> Handoff:
        part = data.get("partition")
        return cls(
            ranks=tuple(RankRecord.from_dict(r) for r in data["ranks"]),
            partition=tuple(part) if part else None,
            partition_source=data["partition_source"],
            tp_size=data.get("tp_size", 1),
        )


def frontend_settings(vllm_config) -> dict:
    """The ``dualgpu`` section the front end filled (explicit utilization, parsed reserves)."""
    extra = vllm_config.additional_config
    return dict(extra.get(KEY, {})) if isinstance(extra, dict) else {}


def update_settings(vllm_config, **values) -> None:
    """Add values to ``additional_config["dualgpu"]`` (a new dict: configs may share theirs)."""
    extra = vllm_config.additional_config
    extra = dict(extra) if isinstance(extra, dict) else {}
    extra[KEY] = {**extra.get(KEY, {}), **values}
    vllm_config.additional_config = extra


def store(vllm_config, handoff: Handoff) -> None:
    update_settings(vllm_config, **{PLAN: handoff.to_dict()})


def load(vllm_config) -> Handoff | None:
    """The record the executor stored, or None (another executor, or PP=1)."""
    data = frontend_settings(vllm_config).get(PLAN)
    return Handoff.from_dict(data) if data else None
