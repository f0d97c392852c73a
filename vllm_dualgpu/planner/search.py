"""The split search: GPU order, layers per rank, and what each rank ends up with.

For every candidate (GPU order, layer partition) each rank's KV budget is

    budget (free - reserve) - fixed (CUDA context + embedding/vision or head/drafter)
        - weights (its decoder layers) - runtime reserve (activations, sampler, CUDA graphs)

and it holds ``budget // bytes_per_block`` blocks, paying only its own layers' pages per block.
vLLM gives every rank the minimum block count, so that minimum is the shared pool. Which of the
splits that hold the requested ``--max-model-len`` is taken is the objective's
(planner/objective.py): by default (``"speed"``) the fastest predicted decode step among those
whose pool also holds ``--max-num-seqs`` such requests (when any does), then the largest pool;
``"pool"`` the largest pool, then the fastest step. Compositions
are enumerated exhaustively with prefix sums (fine for 2-3 ranks up to ~128 layers).
"""

from __future__ import annotations

import bisect
import functools
import itertools
import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from vllm_dualgpu.planner.errors import BadRequest, ContextTooLong, ModelDoesNotFit, PlanError, gib
from vllm_dualgpu.planner.gpus import GpuFacts
from vllm_dualgpu.planner.kv import DEFAULT_KERNEL_BLOCK_ALIGNMENT, KVLayout
from vllm_dualgpu.planner.kv_grouping import SplitGrouping
from vllm_dualgpu.planner.memory import (
    FLASHINFER_MAX_SMS,
    MIB,
    MemoryModel,
    attention_uses_flashinfer,
    configured_flashinfer_workspace,
    default_batch_limits,
    drafter_attention_backend,
    flashinfer_workspace_size,
    received_tensor_bytes,
    runtime_reserve,
    xqa_decode,
)
from vllm_dualgpu.planner.model import DrafterSpec, ModelSpec
from vllm_dualgpu.planner.objective import (
    DEFAULT_OBJECTIVE,
    OBJECTIVES,
    PoolAlternative,
    holds,
    pool_size,
    rule,
    select,
    trade_line,
)

GIB = 1 << 30


@dataclass(frozen=True)
class PlanRequest:
    """The serving settings to plan for; names follow ``vllm serve``'s arguments.

    ``max_model_len``: None = the model's own maximum (as vLLM derives it), -1 = the largest
    that fits (vLLM's auto-fit). ``layer_partition`` (VLLM_PP_LAYER_PARTITION), ``gpu_order``
    (CUDA indices, rank 0 first), ``num_gpu_blocks_override`` and ``kv_cache_memory_bytes`` are
    user overrides: they win over the search. ``speculative`` is vLLM's
    ``--speculative-config`` dict (plus ``draft_config``, the drafter's config.json contents,
    for drafters with their own checkpoint).
    """

    max_model_len: int | None = None
    kv_cache_dtype: str = "auto"
    block_size: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    speculative: dict | None = None
    pp_size: int = 2
    layer_partition: list[int] | None = None
    num_gpu_blocks_override: int | None = None
    kv_cache_memory_bytes: int | None = None
    model_dtype: str = "bfloat16"
    gpu_order: list[int] | None = None
    objective: str = DEFAULT_OBJECTIVE
    """"speed" (default; "auto" is the same), "pool": see planner/objective.py."""
    enable_prefix_caching: bool = True
    mamba_cache_mode: str | None = None
    mamba_cache_dtype: str = "auto"
    mamba_ssm_cache_dtype: str = "auto"
    enforce_eager: bool = False
    language_model_only: bool = False
    vision_on_every_rank: bool = False
    drafter_shares_embedding: bool = False
    kv_grouping: str = "stock"
    """"dualgpu": the KV cache is grouped as the package's KV patches group it under the dualgpu
    executor with PP > 1, for each split (planner/kv_grouping.py); "stock": as stock vLLM groups it."""
    decode_context_tokens: int | None = None
    kernel_block_alignment: int = DEFAULT_KERNEL_BLOCK_ALIGNMENT
    allow_long_max_model_len: bool = False
    """vLLM's ``VLLM_ALLOW_LONG_MAX_MODEL_LEN`` as the caller read it: a --max-model-len above
    the model's maximum is then accepted (the planner reads no environment)."""
    xqa: bool = True
    """FlashInfer may decode through XQA on an SM 9.0 / 12.x rank (memory.xqa_decode), which then
    holds a second workspace; False: ``--attention-config '{"use_trtllm_attention": false}'``."""
    memory: MemoryModel = field(default_factory=MemoryModel)

    def to_dict(self) -> dict:
        d = {k: getattr(self, k) for k in self.__dataclass_fields__ if k not in ("memory", "speculative")}
        if self.speculative:
            d["speculative"] = {
                k: v for k, v in self.speculative.items() if k not in ("draft_config", "draft_hf_config")
            }
        d["memory"] = self.memory.to_dict()
        return d


@dataclass
class RankPlan:
    """One pipeline rank: its GPU, its layers and its memory."""

    rank: int
    gpu: GpuFacts
    layers: range
    weights_bytes: int
    fixed_bytes: int
    reserve_bytes: int
    kv_bytes_per_block: int
    blocks: int
    max_context_tokens: int
    predicted_free_after_bytes: int
    predicted_decode_ms: float | None
    budget_bytes: int = 0
    kv_budget_bytes: int = 0
    kv_cache_bytes: int = 0
    fixed_detail: dict = field(default_factory=dict)
    reserve_detail: dict = field(default_factory=dict)
    decode_read_bytes: int = 0

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def to_dict(self) -> dict:
        return {
            "rank": self.rank,
            "gpu": self.gpu.to_dict(),
            "layers": [self.layers.start, self.layers.stop],
            "num_layers": self.num_layers,
            "budget_bytes": self.budget_bytes,
            "weights_bytes": self.weights_bytes,
            "fixed_bytes": self.fixed_bytes,
            "fixed_detail": dict(self.fixed_detail),
            "reserve_bytes": self.reserve_bytes,
            "reserve_detail": dict(self.reserve_detail),
            "kv_budget_bytes": self.kv_budget_bytes,
            "kv_bytes_per_block": self.kv_bytes_per_block,
            "blocks": self.blocks,
            "max_context_tokens": self.max_context_tokens,
            "kv_cache_bytes": self.kv_cache_bytes,
            "predicted_free_after_bytes": self.predicted_free_after_bytes,
            "decode_read_bytes": self.decode_read_bytes,
            "predicted_decode_ms": self.predicted_decode_ms,
        }


@dataclass
class Plan:
    """The chosen GPU order, split and per-rank memory. See :func:`plan`."""

    model: ModelSpec
    request: PlanRequest
    order: list[int]
    partition: list[int]
    ranks: list[RankPlan]
    num_blocks: int
    block_size: int
    max_model_len: int
    max_context_tokens: int
    kv_max_context_tokens: int
    pool_tokens: int
    kv: KVLayout
    overrides: dict = field(default_factory=dict)
    passthrough: bool = False
    objective: str = "pool"
    """The rule that chose the split: "speed" or "pool" (planner/objective.py)."""
    notes: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    """What the user set that the plan expects to fail or run tight (a hand-set pool past the
    plan's estimates): printed by `plan`, logged as WARNING by the executor."""
    candidates: int = 0
    drafter: DrafterSpec | None = None
    max_num_batched_tokens: int = 0
    max_num_seqs: int = 0
    decode_context_tokens: int = 0
    held_requests: int = 1
    """How many requests of ``max_model_len`` the "speed" rule required the pool to hold at once:
    ``max_num_seqs`` where some split holds them, else 1."""
    pool_alternative: PoolAlternative | None = None
    """What the "pool" objective gives instead, when the "speed" rule chose another split."""
    flashinfer_workspace_bytes: int = 0
    """VLLM_FLASHINFER_WORKSPACE_BUFFER_SIZE as the dualgpu executor sets it where the user did not
    (memory.plugin_flashinfer_workspace); 0: the executor leaves it alone (no rank runs FlashInfer,
    or the user set it)."""

    @property
    def predicted_decode_ms(self) -> float | None:
        vals = [r.predicted_decode_ms for r in self.ranks]
        return None if any(v is None for v in vals) else sum(vals)  # type: ignore[arg-type]

    @property
    def max_concurrency(self) -> float:
        per = self.kv.blocks_per_request(self.max_model_len) if self.max_model_len > 0 else 0
        return self.num_blocks / per if per else 0.0

    def grouping_budgets(self) -> list[int]:
        """Each rank's KV memory as vLLM's grouping sees it (the package's KV patches group for
        the tightest rank): ``--kv-cache-memory-bytes`` on every rank where set (vLLM then skips
        its profile), else the plan's KV budget."""
        fixed = self.overrides.get("kv_cache_memory_bytes")
        return [int(fixed) if fixed is not None else r.kv_budget_bytes for r in self.ranks]

    def partition_env(self) -> str | None:
        """The ``VLLM_PP_LAYER_PARTITION`` value, or None when vLLM runs as stock (PP=1)."""
        if self.passthrough or len(self.partition) < 2:
            return None
        return ",".join(str(n) for n in self.partition)

    def cuda_visible_devices(self) -> str:
        return ",".join(str(i) for i in self.order)

    def info_line(self) -> str:
        """One line for the log: what the plan is and which user overrides it honoured."""
        if self.passthrough:
            return "vllm-dualgpu plan: " + "; ".join(self.notes or ["running as stock vLLM"])
        ov = ", ".join(f"{k}={v}" for k, v in self.overrides.items()) or "none"
        return (
            f"vllm-dualgpu plan: GPUs {self.cuda_visible_devices()} split {self.partition_env()}, "
            f"{self.num_blocks:,} blocks x {self.block_size} tokens, max context "
            f"{self.max_context_tokens:,}; overrides honoured: {ov}"
        )

    def trade_line(self) -> str | None:
        """One line for the log when "speed" chose another split than "pool" would: both, and
        how to get the other (None when they agree)."""
        return trade_line(self)

    def to_dict(self) -> dict:
        d = {
            "model": self.model.to_dict(),
            "request": self.request.to_dict(),
            "passthrough": self.passthrough,
            "objective": self.objective,
            "order": list(self.order),
            "cuda_visible_devices": self.cuda_visible_devices(),
            "partition": list(self.partition),
            "partition_env": self.partition_env(),
            "num_blocks": self.num_blocks,
            "block_size": self.block_size,
            "max_model_len": self.max_model_len,
            "max_context_tokens": self.max_context_tokens,
            "kv_max_context_tokens": self.kv_max_context_tokens,
            "pool_tokens": self.pool_tokens,
            "max_concurrency": round(self.max_concurrency, 3),
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "max_num_seqs": self.max_num_seqs,
            "decode_context_tokens": self.decode_context_tokens,
            "predicted_decode_ms": None if self.predicted_decode_ms is None else round(self.predicted_decode_ms, 3),
            "kv_cache": self.kv.describe(),
            "drafter": self.drafter.to_dict() if self.drafter else None,
            "held_requests": self.held_requests,
            "pool_alternative": self.pool_alternative.to_dict() if self.pool_alternative else None,
            "overrides": dict(self.overrides),
            "notes": list(self.notes),
            "warnings": list(self.warnings),
            "candidates": self.candidates,
            "ranks": [r.to_dict() for r in self.ranks],
        }
        return d

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    def table(self) -> str:
        from vllm_dualgpu.planner.report import plan_table

        return plan_table(self)


@dataclass(frozen=True)
class Fit:
    """Whether the requested ``--max-model-len`` fits, and the largest that does.

    ``plan`` is the plan at the requested length when it fits, else the plan at the largest
    length that fits (on the split that reaches it). ``requested_max_model_len`` is the length
    asked for (the model's maximum when none was given; ``None`` for ``-1``/auto, which always
    fits); ``largest_max_model_len`` is the largest any split holds, capped at the model's
    maximum unless the request allows longer (``allow_long_max_model_len``; for a pass-through plan, the first
    GPU's informative estimate, and ``fits`` is True: vLLM runs as stock and decides).
    """

    plan: Plan
    fits: bool
    requested_max_model_len: int | None
    largest_max_model_len: int
    _reserves: Callable[[], list[int] | None] | None = field(default=None, repr=False, compare=False)

    @functools.cached_property
    def reserves_to_fit(self) -> list[int] | None:
        """Where it falls short and :func:`fit` was asked for it (``reserve_hint``): what each
        given GPU (in CUDA order) keeps free such that the requested length fits, the tight card
        keeping as much as allows it (whole 16 MiB), the others what they keep now; None where
        nothing kept free on the tight card would make it fit. Worked out when first read (the
        refusal's message), not for every fit that falls short."""
        return self._reserves() if self._reserves is not None else None

    @property
    def error(self) -> ContextTooLong | None:
        """The :class:`ContextTooLong` to raise when it falls short; ``None`` when it fits."""
        if self.fits:
            return None
        assert self.requested_max_model_len is not None
        return ContextTooLong(self.largest_max_model_len, self.requested_max_model_len, partition=self.plan.partition,
                              kv_cache_dtype=self.plan.request.kv_cache_dtype,
                              hint=_tightest_rank(self.plan, self.requested_max_model_len, self.reserves_to_fit))


def _tightest_rank(plan: "Plan", requested: int | None = None, reserves: list[int] | None = None) -> str:
    """The rank whose KV room holds the fewest tokens, and what its card keeps free for others
    (the knob left once the split is the best one), with the VLLM_DUALGPU_RESERVE value that lets
    ``requested`` fit where there is one: "" when nothing is kept free there."""
    r = _tight(plan)
    if not r.gpu.reserve_bytes:
        return ""
    why = {True: "a display is active on it", False: "no display on it"}.get(r.gpu.display, "its display is unknown")
    text = (f"rank {r.rank}, the {r.gpu.name}, holds the fewest tokens and keeps {gib(r.gpu.reserve_bytes)} free "
            f"for others: {why}; VLLM_DUALGPU_RESERVE sets that")
    if reserves is not None and requested is not None:
        text += f"; {requested:,} fits with VLLM_DUALGPU_RESERVE={','.join(f'{b // _MIB}MiB' for b in reserves)}"
    return text


def _tight(plan: "Plan") -> "RankPlan":
    """The rank whose KV room holds the fewest tokens."""
    return min(plan.ranks, key=lambda x: x.max_context_tokens)


_MIB = 1 << 20
_RESERVE_STEP = 16 * _MIB


def _reserves_to_fit(model: ModelSpec, gpus: list[GpuFacts], request: PlanRequest, f: Fit, **kw) -> list[int] | None:
    """:attr:`Fit.reserves_to_fit`: the most the tight card (the rank of ``f.plan`` that holds the
    fewest tokens) can keep free, in whole 16 MiB, with ``request`` still fitting, found by
    bisection (a card keeping less never holds fewer tokens); the other cards unchanged."""
    tight = _tight(f.plan).gpu
    at = next((i for i, g in enumerate(gpus) if g.index == tight.index), None)
    if at is None or tight.reserve_bytes < _RESERVE_STEP:
        return None

    def keeping(steps: int) -> list[GpuFacts]:
        return [replace(g, reserve_bytes=steps * _RESERVE_STEP) if i == at else g for i, g in enumerate(gpus)]

    def fits(steps: int) -> bool:
        try:
            return _fit_once(model, keeping(steps), request, pool_too=False, **kw)[0].fits
        except PlanError:
            return False

    lo, hi = 0, tight.reserve_bytes // _RESERVE_STEP  # fits at lo, not at hi (the request as given)
    if not fits(lo):
        return None
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return [g.reserve_bytes for g in sorted(keeping(lo), key=lambda g: g.index)]


@dataclass
class StockEstimate:
    """What stock vLLM 0.30 would do: CUDA order, even split, one ``--gpu-memory-utilization``."""

    gpu_memory_utilization: float
    boots: bool
    reason: str
    order: list[int]
    partition: list[int]
    num_blocks: int
    max_context_tokens: int
    pool_tokens: int
    best_utilization: float | None
    best_num_blocks: int
    best_pool_tokens: int
    best_max_context_tokens: int
    best_boots: bool
    best_reason: str

    def to_dict(self) -> dict:
        return dict(self.__dict__)


# --------------------------------------------------------------------------------------------
# helpers


def even_partition(num_layers: int, pp_size: int) -> list[int]:
    """vLLM's default split (``get_pp_indices``): remainder to the ranks before the last."""
    parts = [num_layers // pp_size] * pp_size
    rem = num_layers % pp_size
    for i in range(2, rem + 2):
        parts[-i] += 1
    return parts


def compositions(n: int, k: int):
    """All ways to write n as k positive parts, in lexicographic order."""
    for cuts in itertools.combinations(range(1, n), k - 1):
        prev = 0
        parts = []
        for c in cuts:
            parts.append(c - prev)
            prev = c
        parts.append(n - prev)
        yield parts


class _Context:
    """Everything that does not depend on the candidate split, precomputed once."""

    def __init__(self, model: ModelSpec, request: PlanRequest, pp: int, gpus_by_index: dict[int, GpuFacts],
                 kv_layout: KVLayout | None = None):
        self.model = model
        self.request = request
        self.pp = pp
        self.warnings: list[str] = []
        self.gpus = gpus_by_index
        mm = request.memory
        self.mm = mm
        # NCCL sizes the pipeline's buffers by the link: NVLink only when every card has one.
        self.nvlink = all(g.nvlink for g in gpus_by_index.values())
        self.drafter = DrafterSpec.from_speculative(request.speculative, model)
        num_spec = self.drafter.num_speculative_tokens if self.drafter else 0
        self.decode_query_len = 1 + num_spec
        mode = request.mamba_cache_mode or ("align" if request.enable_prefix_caching else "none")
        dev0 = gpus_by_index[min(gpus_by_index)]
        d_tok, d_seq = default_batch_limits(dev0.total_bytes, dev0.name)
        self.max_num_batched_tokens = request.max_num_batched_tokens or d_tok
        self.max_num_seqs = request.max_num_seqs or d_seq
        self.kv = kv_layout or KVLayout.build(
            model,
            kv_cache_dtype=request.kv_cache_dtype,
            block_size=request.block_size,
            drafter=self.drafter,
            num_speculative_tokens=num_spec,
            model_dtype=request.model_dtype,
            mamba_cache_dtype=request.mamba_cache_dtype,
            mamba_ssm_cache_dtype=request.mamba_ssm_cache_dtype,
            mamba_cache_mode=mode,
            kernel_block_alignment=request.kernel_block_alignment,
            # VllmConfig.max_in_flight_tokens: one batch per stage in flight (max_concurrent_batches
            # is the PP size under the dualgpu executor, patch pp-inflight-batches)
            max_in_flight_tokens=pp * self.max_num_batched_tokens,
        )
        self.vision = model.has_vision and not request.language_model_only
        # FlashInfer's workspace buffers: the target's on every rank, the drafter's own on the last
        self.flashinfer = attention_uses_flashinfer(request.kv_cache_dtype,
                                                    [g.capability for g in gpus_by_index.values()])
        # the executor's rule applies to dualgpu runs (PP > 1); a stock run keeps vLLM's choice
        self.drafter_backend = drafter_attention_backend(request.speculative, self.flashinfer and pp > 1)
        self.drafter_flashinfer = bool(self.flashinfer and self.drafter is not None and self.drafter.kv_layers
                                       and self.drafter_backend in (None, "FLASHINFER"))
        # vLLM's second FlashInfer buffer on a rank that decodes through XQA (memory.xqa_decode): the
        # configured workspace size, one per process (the drafter's attention shares it); none where
        # the user turned XQA off
        self.xqa_workspace = configured_flashinfer_workspace(
            model, max_num_seqs=self.max_num_seqs, decode_query_len=self.decode_query_len, mm=mm) \
            if self.flashinfer and request.xqa else 0

        # Prefix sums over the decoder layers: layers [start, end) cost x[end] - x[start].
        L = model.num_layers
        self.weight_prefix = [0] * (L + 1)  # weight bytes
        self.read_prefix = [0] * (L + 1)  # bytes one decode step reads (weights, no KV)
        for i, layer in enumerate(model.layers):
            self.weight_prefix[i + 1] = self.weight_prefix[i] + layer.weight_bytes
            self.read_prefix[i + 1] = self.read_prefix[i] + layer.decode_read_bytes

        # role costs, by (first, last)
        self.fixed: dict[tuple[bool, bool], dict[str, int]] = {}
        self.reserve: dict[tuple[bool, bool], dict[str, int]] = {}
        for first in (True, False):
            for last in (True, False):
                f = {"cuda_context": mm.context_bytes(self.nvlink)}
                embedded = first or model.embedding_on_every_rank
                if embedded:
                    f["embedding"] = model.embed_bytes
                if self.vision and (first or request.vision_on_every_rank):
                    f["vision"] = model.vision_bytes
                if last:
                    if not (embedded and model.tie_word_embeddings):
                        f["lm_head"] = model.lm_head_bytes
                    f["final_norm"] = model.final_norm_bytes
                    d = self.drafter
                    if d is not None and (d.weight_bytes or d.lm_head_bytes):
                        f["drafter"] = d.weight_bytes + d.lm_head_bytes
                        if not request.drafter_shares_embedding and not first and d.embed_bytes:
                            f["drafter_embedding"] = d.embed_bytes
                self.fixed[(first, last)] = f
                self.reserve[(first, last)] = runtime_reserve(
                    model,
                    first=first,
                    last=last,
                    max_num_batched_tokens=self.max_num_batched_tokens,
                    max_num_seqs=self.max_num_seqs,
                    enforce_eager=request.enforce_eager,
                    vision=self.vision,
                    mm=mm,
                    nvlink=self.nvlink,
                    decode_query_len=1 + num_spec,
                    flashinfer=self.flashinfer,
                    drafter_flashinfer=self.drafter_flashinfer,
                    dtype=request.model_dtype,
                )
        self.fixed_sum = {k: sum(v.values()) for k, v in self.fixed.items()}
        self.reserve_sum = {k: sum(v.values()) for k, v in self.reserve.items()}
        # a drafter's relayed hidden states (EAGLE3, DFlash): one more received tensor a layer of
        # its ``aux_layers`` before a stage's first layer (vLLM's ``_aux_slot_base_cached``)
        # (none where the memory model charges no received tensors)
        self.aux_layers = self.drafter.aux_layers if self.drafter is not None and pp > 1 else ()
        self.aux_tensor_bytes = (received_tensor_bytes(model, self.max_num_batched_tokens, request.model_dtype)
                                 if self.aux_layers and mm.pp_receive_tensors else 0)

        # decode: K+V bytes per context token and mamba state bytes, prefix over layers
        self.kv_token_prefix = [0] * (L + 1)
        self.state_prefix = [0] * (L + 1)
        per_layer_tok = [0] * L
        per_layer_state = [0] * L
        d_tok_bytes = 0
        self.drafter_window_read: list[tuple[int, int]] = []  # (window, bytes per token) of sliding layers
        for s in self.kv.slots:
            if s.layer_index is None and s.sliding_window:  # reads its window, not the context
                self.drafter_window_read.append((s.sliding_window, s.real_bytes_per_token))
            elif s.layer_index is None:
                d_tok_bytes += s.real_bytes_per_token
            else:
                per_layer_tok[s.layer_index] += s.real_bytes_per_token
                per_layer_state[s.layer_index] += s.state_bytes
        for i in range(L):
            self.kv_token_prefix[i + 1] = self.kv_token_prefix[i] + per_layer_tok[i]
            self.state_prefix[i + 1] = self.state_prefix[i] + per_layer_state[i]
        self.drafter_kv_tok = d_tok_bytes
        self.min_blocks = self.kv.blocks_per_request(1) + 1  # one token + the null block
        self.length = 0  # the request length each split's KV grouping is formed for
        self.grouping: SplitGrouping | None = None
        self.known: dict = {}
        self._blocks: dict[int, tuple[KVLayout, int, int]] = {}

    def group_per_split(self, length: int, known: dict | None) -> None:
        """Price every split with the KV grouping it gets (the package's KV patches group for a
        split's layers and KV budgets: planner/kv_grouping.per_rank_grouping), for requests of
        ``length``; ``known``: {(GPU order, split): layout} priced instead, the executor's
        groupings by vLLM's own functions."""
        self.length = length
        self.grouping = SplitGrouping(self.kv, length)
        self.known = dict(known or {})

    def layout_for(self, order: tuple[int, ...], partition: tuple[int, ...], memory: list[int]) -> KVLayout:
        """The KV layout a split is priced with: its own grouping for ``memory`` (each rank's KV
        bytes as the grouping sees them), or the one layout every split is priced with."""
        if self.grouping is None:
            return self.kv
        known = self.known.get((tuple(order), tuple(partition)))
        return known if known is not None else self.grouping.for_split(partition, memory)

    def request_blocks(self, kv: KVLayout) -> tuple[int, int]:
        """(the fewest blocks a pool priced with ``kv`` holds: one token and the null block, the
        blocks one request of the length the groupings are formed for takes), once per layout."""
        if id(kv) not in self._blocks:
            length = self.length or self.model.max_position_embeddings
            self._blocks[id(kv)] = (kv, kv.blocks_per_request(1) + 1, kv.blocks_per_request(length))
        return self._blocks[id(kv)][1:]

    def last_extra_read(self) -> int:
        m = self.model
        b = m.lm_head_bytes + m.final_norm_bytes
        if self.drafter is not None:
            b += self.drafter.decode_read_bytes * self.drafter.passes
        return b

    def aux_receive_bytes(self, start: int, first: bool) -> int:
        """The relayed hidden states a stage starting at layer ``start`` receives beside the batch
        (``reserve_aux_intermediate_tensor_slots`` in vLLM 0.33: one tensor for each aux layer up to
        ``start``, ``bisect_right``); 0 on the first stage."""
        if first or not self.aux_tensor_bytes:
            return 0
        return bisect.bisect_right(self.aux_layers, start) * self.aux_tensor_bytes

    def xqa_bytes(self, gpu) -> int:
        """The XQA workspace the rank on ``gpu`` holds (0 where it does not decode through XQA)."""
        if not self.xqa_workspace or not xqa_decode(self.request.kv_cache_dtype, gpu.capability, self.model):
            return 0
        return self.xqa_workspace

    def rank_cost(self, start: int, end: int, first: bool, last: bool, decode_tokens: int,
                  kv: KVLayout | None = None, gpu=None) -> RankCost:
        """What the rank holding decoder layers [start, end) pays, in its pipeline role, on ``gpu``
        (its XQA workspace; None: none), its KV cache priced with ``kv`` (the context's layout when
        None)."""
        role = (first, last)
        read = (self.read_prefix[end] - self.read_prefix[start]
                + decode_tokens * (self.kv_token_prefix[end] - self.kv_token_prefix[start])
                + 2 * (self.state_prefix[end] - self.state_prefix[start]))
        if last:
            read += self.last_extra_read() + decode_tokens * self.drafter_kv_tok
            read += sum(min(w, decode_tokens) * b for w, b in self.drafter_window_read)
        return RankCost(
            weights_bytes=self.weight_prefix[end] - self.weight_prefix[start],
            fixed_bytes=self.fixed_sum[role],
            runtime_reserve_bytes=(self.reserve_sum[role] + self.aux_receive_bytes(start, first)
                                   + (self.xqa_bytes(gpu) if gpu is not None else 0)),
            kv_bytes_per_block=(kv or self.kv).bytes_per_block(start, end, last),
            decode_read_bytes=read,
        )


@dataclass(frozen=True)
class RankCost:
    """One rank's costs for a span of layers: the planner's per-rank arithmetic, in one place."""

    weights_bytes: int
    """The decoder layers' weights."""
    fixed_bytes: int
    """CUDA context and NCCL, the embedding and vision tower (first rank), the head and the
    drafter (last rank)."""
    runtime_reserve_bytes: int
    """What vLLM's profile charges at run time: activations, sampler, CUDA graphs, buffers."""
    kv_bytes_per_block: int
    decode_read_bytes: int
    """Bytes one decode step reads on this rank at the planned context."""

    def kv_budget(self, budget_bytes: int) -> int:
        """What is left for the KV cache out of the rank's budget."""
        return budget_bytes - self.fixed_bytes - self.weights_bytes - self.runtime_reserve_bytes

    def decode_ms(self, bandwidth_gbps: float | None) -> float | None:
        return self.decode_read_bytes / (bandwidth_gbps * 1e9) * 1e3 if bandwidth_gbps else None


@dataclass
class _Candidate:
    order: tuple[int, ...]
    partition: tuple[int, ...]
    bpb: list[int]
    kv_budget: list[int]
    avail: list[int]
    blocks: list[int]
    num_blocks: int
    max_ctx: int
    decode_ms: float | None
    shortfall: list[int]  # bytes each rank is short of weights+fixed+reserve+minimal KV (<=0: fits)
    kv: KVLayout  # the layout this split is priced with (its own grouping, planner/kv_grouping.py)
    min_blocks: int  # the fewest its pool holds: one token and the null block
    per_request: int  # blocks one request of the length chosen for takes from its pool
    # the same without the runtime reserve and the memory kept free: what a user-set pool may use
    hard_shortfall: list[int] | None = None

    @property
    def fits(self) -> bool:
        return all(s <= 0 for s in self.shortfall)

    @property
    def fits_hard(self) -> bool:
        return self.hard_shortfall is not None and all(s <= 0 for s in self.hard_shortfall)


def _evaluate(ctx: _Context, order: tuple[int, ...], partition: tuple[int, ...], decode_tokens: int) -> _Candidate:
    req = ctx.request
    pp = len(partition)
    bounds, start = [], 0
    for n in partition:
        bounds.append((start, start + n))
        start += n
    gpus = [ctx.gpus[i] for i in order]
    # the KV budget (and decode reads) of each rank do not depend on the KV grouping; its grouping
    # depends on them (on --kv-cache-memory-bytes instead where set: vLLM then skips its profile)
    costs = [ctx.rank_cost(a, b, r == 0, r == pp - 1, decode_tokens, gpu=g)
             for r, ((a, b), g) in enumerate(zip(bounds, gpus))]
    budgets = [cost.kv_budget(g.budget_bytes) for cost, g in zip(costs, gpus)]
    kv = ctx.layout_for(order, partition, budgets if req.kv_cache_memory_bytes is None
                        else [req.kv_cache_memory_bytes] * pp)
    min_blocks, per_request = ctx.request_blocks(kv)
    bpbs, avails, blocks, shorts, hard = [], [], [], [], []
    decode_ms: float | None = 0.0
    for r, ((a, b), cost, gpu, kv_budget) in enumerate(zip(bounds, costs, gpus, budgets)):
        bpb = kv.bytes_per_block(a, b, r == pp - 1)
        if req.num_gpu_blocks_override is not None:
            avail = req.num_gpu_blocks_override * bpb
            short = avail - kv_budget
            hard.append(short - cost.runtime_reserve_bytes - gpu.reserve_bytes)
        elif req.kv_cache_memory_bytes is not None:
            avail = req.kv_cache_memory_bytes
            short = max(avail, min_blocks * bpb) - kv_budget
        else:
            avail = kv_budget
            short = min_blocks * bpb - kv_budget
        bpbs.append(bpb)
        avails.append(avail)
        blocks.append(avail // bpb if avail > 0 and bpb > 0 else 0)
        shorts.append(short)
        if decode_ms is not None:
            ms = cost.decode_ms(gpu.bandwidth_gbps)
            decode_ms = None if ms is None else decode_ms + ms
    num_blocks = req.num_gpu_blocks_override if req.num_gpu_blocks_override is not None else min(blocks)
    max_ctx = kv.max_len_for_blocks(num_blocks) if num_blocks > 0 else 0
    return _Candidate(order, tuple(partition), bpbs, budgets, avails, blocks, num_blocks, max_ctx, decode_ms, shorts,
                      kv, min_blocks, per_request,
                      hard if req.num_gpu_blocks_override is not None else None)


def _rank_plans(ctx: _Context, c: _Candidate, decode_tokens: int) -> list[RankPlan]:
    out = []
    start = 0
    pp = len(c.partition)
    for r, n in enumerate(c.partition):
        end = start + n
        first, last = r == 0, r == pp - 1
        gpu = ctx.gpus[c.order[r]]
        cost = ctx.rank_cost(start, end, first, last, decode_tokens, c.kv, gpu=gpu)
        weights, fixed, reserve = cost.weights_bytes, cost.fixed_bytes, cost.runtime_reserve_bytes
        aux = ctx.aux_receive_bytes(start, first)  # in ``reserve``; itemised below
        xqa = ctx.xqa_bytes(gpu)  # likewise
        kv_alloc = c.num_blocks * c.bpb[r]
        read, ms = cost.decode_read_bytes, cost.decode_ms(gpu.bandwidth_gbps)
        out.append(
            RankPlan(
                rank=r,
                gpu=gpu,
                layers=range(start, end),
                weights_bytes=weights,
                fixed_bytes=fixed,
                reserve_bytes=reserve,
                kv_bytes_per_block=c.bpb[r],
                blocks=c.blocks[r],
                max_context_tokens=c.kv.max_len_for_blocks(c.blocks[r]) if c.blocks[r] > 0 else 0,
                predicted_free_after_bytes=gpu.free_bytes - fixed - weights - reserve - kv_alloc,
                predicted_decode_ms=ms,
                budget_bytes=gpu.budget_bytes,
                kv_budget_bytes=c.kv_budget[r],
                kv_cache_bytes=kv_alloc,
                fixed_detail=dict(ctx.fixed[(first, last)]),
                reserve_detail={**ctx.reserve[(first, last)], **({"pp_receive_aux": aux} if aux else {}),
                                **({"xqa_workspace": xqa} if xqa else {})},
                decode_read_bytes=read,
            )
        )
        start = end
    return out


# --------------------------------------------------------------------------------------------
# public entry points


def _resolve_gpus(gpus: list[GpuFacts], request: PlanRequest, notes: list[str]) -> list[GpuFacts]:
    pp = request.pp_size
    if request.gpu_order is not None:
        idx = {g.index: g for g in gpus}
        if len(request.gpu_order) != pp or len(set(request.gpu_order)) != pp:
            raise BadRequest(f"gpu_order {request.gpu_order} must name {pp} different GPUs (one per rank)")
        missing = [i for i in request.gpu_order if i not in idx]
        if missing:
            raise BadRequest(f"gpu_order names GPU(s) {missing} that are not among {sorted(idx)}")
        return [idx[i] for i in request.gpu_order]
    if len(gpus) > pp:
        chosen = sorted(gpus, key=lambda g: (-g.budget_bytes, -(g.bandwidth_gbps or 0), g.index))[:pp]
        chosen = sorted(chosen, key=lambda g: g.index)
        notes.append(
            f"{len(gpus)} GPUs given for {pp} ranks: planning on the {pp} with the most free memory "
            f"({', '.join(str(g.index) for g in chosen)})"
        )
        return chosen
    return list(gpus)


def _orders(gpus: list[GpuFacts], fixed: bool) -> list[tuple[int, ...]]:
    if fixed:
        return [tuple(g.index for g in gpus)]
    # The card with the most memory to spend goes last (output head, sampler, drafter); ties keep
    # CUDA order (the higher index last).
    last = max(gpus, key=lambda g: (g.budget_bytes, g.total_bytes, g.bandwidth_gbps or 0, g.index))
    rest = [g for g in gpus if g is not last]
    rest.sort(key=lambda g: (g.budget_bytes, g.total_bytes, g.index))
    if len(rest) <= 2:
        perms = [tuple(p) for p in itertools.permutations(rest)]
    else:
        perms = [tuple(rest)]
    return [tuple(g.index for g in p) + (last.index,) for p in perms]


def plan(model: ModelSpec, gpus: list[GpuFacts], request: PlanRequest | None = None) -> Plan:
    """Plan GPU order, layer split and KV pool for ``model`` on ``gpus``.

    Raises :class:`ContextTooLong` (with the largest ``--max-model-len`` that fits),
    :class:`ModelDoesNotFit` (which rank is short, by how much) or :class:`BadRequest`. With one
    GPU or ``pp_size=1`` it returns a pass-through plan (``passthrough=True``,
    ``partition_env() is None``) and raises nothing: vLLM then runs as stock. :func:`fit` is the
    same search answering "falls short" with the plan at the largest that fits instead.
    """
    return _fit_or_raise(fit(model, gpus, request))


def _fit_or_raise(f: Fit) -> Plan:
    error = f.error
    if error is not None:
        raise error
    return f.plan


def fit(
    model: ModelSpec, gpus: list[GpuFacts], request: PlanRequest | None = None, *,
    kv_layout: KVLayout | None = None, kv_groupings: dict | None = None, _check_stock: bool = False,
    reserve_hint: bool = False,
) -> Fit:
    """See :func:`_fit_once`. A plan the "speed" rule chose carries what the "pool" objective
    gives for the same request (``Plan.pool_alternative``, planned as ``vllm-dualgpu plan`` plans
    it, without ``kv_layout`` or ``kv_groupings``) where that is another split. ``reserve_hint``:
    ``gpus`` are the visible GPUs, each keeping what VLLM_DUALGPU_RESERVE (or its default) says,
    so a shortfall's message may name the VLLM_DUALGPU_RESERVE value that fits
    (:attr:`Fit.reserves_to_fit`); not for TP stage cards or other stand-ins."""
    request = request or PlanRequest()
    alone = kv_layout is None and not kv_groupings  # then the same candidates answer the pool objective
    f, alt = _fit_once(model, gpus, request, kv_layout=kv_layout, kv_groupings=kv_groupings,
                       _check_stock=_check_stock, pool_too=alone)
    p = f.plan
    if reserve_hint and not f.fits and f.requested_max_model_len is not None and not p.passthrough:
        f = replace(f, _reserves=functools.partial(_reserves_to_fit, model, gpus, request, f, kv_layout=kv_layout,
                                                   kv_groupings=kv_groupings, _check_stock=_check_stock))
    if f.fits and p.objective == "speed" and not p.passthrough and len(p.partition) > 1:
        if alt is None:
            alt, _ = _fit_once(model, gpus, replace(request, objective="pool"), _check_stock=_check_stock)
        # a trade only where the pool objective's split holds more (its 1% tolerance can take a
        # faster split with a smaller pool than the speed rule's, on cards of equal speed)
        if alt.fits and (alt.plan.order, alt.plan.partition) != (p.order, p.partition) \
                and alt.plan.pool_tokens > p.pool_tokens:  # (blocks of two groupings differ in size)
            p.pool_alternative = PoolAlternative.of(alt.plan)
    return f


def _fit_once(
    model: ModelSpec, gpus: list[GpuFacts], request: PlanRequest | None = None, *,
    kv_layout: KVLayout | None = None, kv_groupings: dict | None = None, _check_stock: bool = False,
    pool_too: bool = False
) -> tuple[Fit, Fit | None]:
    """:func:`plan`, with a requested ``--max-model-len`` that no split holds answered, not
    raised: ``Fit(fits=False)`` with the plan at the largest length that fits. Raises
    :class:`ModelDoesNotFit` (not even one request fits) and :class:`BadRequest` as :func:`plan`
    does, never :class:`ContextTooLong`. With ``pool_too``, where the "speed" rule chose the
    plan that fits, the same candidates also answer the "pool" objective (the second of the
    pair; else None).

    With ``request.kv_grouping == "dualgpu"`` and PP > 1 every split is priced with the KV
    grouping the package's KV patches give it (for its layers, its ranks' KV budgets and the
    requested length: planner/kv_grouping.per_rank_grouping on the pure mirror,
    ``KVLayout.build`` from the request); ``kv_groupings`` ({(GPU order, split): layout})
    prices those splits with the layout given instead: the executor's, regrouped by vLLM's own
    functions (engine/kv_pricing.py). ``kv_layout`` prices every split with that one layout."""
    request = request or PlanRequest()
    if not gpus:
        raise BadRequest("no GPUs to plan for")
    if request.objective not in OBJECTIVES:
        raise BadRequest(f"objective {request.objective!r}: use one of {', '.join(OBJECTIVES)}")
    if request.pp_size < 1:
        raise BadRequest("pipeline_parallel_size must be >= 1")
    gpus = [g.with_known_defaults() for g in gpus]
    if len({g.index for g in gpus}) != len(gpus):
        raise BadRequest("two GPUs share one index")
    notes: list[str] = []
    L = model.num_layers

    if (request.pp_size == 1 or len(gpus) == 1) and not _check_stock:
        p = _passthrough(model, gpus, request)
        return Fit(p, True, None if request.max_model_len == -1 else p.max_model_len, p.max_context_tokens), None
    if request.pp_size > len(gpus):
        raise BadRequest(
            f"--pipeline-parallel-size {request.pp_size} needs {request.pp_size} GPUs; {len(gpus)} given"
        )
    pp = request.pp_size
    if pp > L:
        raise BadRequest(f"{pp} pipeline ranks for {L} layers: every rank needs at least one layer")

    max_len = request.max_model_len
    auto_fit = max_len == -1
    if max_len is not None and max_len != -1:
        if max_len < 1:
            raise BadRequest("--max-model-len must be positive (or -1 / auto)")
        if max_len > model.max_position_embeddings and not request.allow_long_max_model_len:
            raise BadRequest(
                f"--max-model-len {max_len:,} is larger than the model's maximum "
                f"({model.max_position_embeddings:,}); vLLM refuses it unless VLLM_ALLOW_LONG_MAX_MODEL_LEN=1"
            )
    target = None if auto_fit else (max_len if max_len is not None else model.max_position_embeddings)

    overrides: dict = {}
    used = _resolve_gpus(gpus, request, notes)
    if request.gpu_order is not None:
        overrides["gpu_order"] = ",".join(map(str, request.gpu_order))
    ctx = _Context(model, request, pp, {g.index: g for g in used}, kv_layout)
    if kv_layout is None and request.kv_grouping == "dualgpu" and pp > 1:  # the patches group under PP only
        ctx.group_per_split(target if target is not None else model.max_position_embeddings, kv_groupings)
    decode_tokens = request.decode_context_tokens
    if decode_tokens is None:
        decode_tokens = target if target is not None else model.max_position_embeddings

    if request.layer_partition is not None:
        part = [int(x) for x in request.layer_partition]
        if len(part) != pp:
            raise BadRequest(f"layer partition {part} has {len(part)} entries for {pp} ranks")
        if sum(part) != L:
            raise BadRequest(f"layer partition {part} sums to {sum(part)}, the model has {L} layers")
        if any(n < 1 for n in part):
            raise BadRequest(f"layer partition {part}: every rank needs at least one layer")
        partitions = [part]
        overrides["layer_partition"] = ",".join(map(str, part))
    else:
        partitions = list(compositions(L, pp))
    if request.num_gpu_blocks_override is not None:
        if request.num_gpu_blocks_override < ctx.min_blocks:
            raise BadRequest(
                f"--num-gpu-blocks-override {request.num_gpu_blocks_override} is below the minimum "
                f"of {ctx.min_blocks} blocks (one request plus the null block)"
            )
        overrides["num_gpu_blocks_override"] = request.num_gpu_blocks_override
    if request.kv_cache_memory_bytes is not None:
        if request.kv_cache_memory_bytes < 1:
            raise BadRequest("--kv-cache-memory-bytes must be positive")
        overrides["kv_cache_memory_bytes"] = request.kv_cache_memory_bytes
    if request.block_size is not None:
        overrides["block_size"] = request.block_size

    orders = _orders(used, request.gpu_order is not None)
    cands = [_evaluate(ctx, o, tuple(p), decode_tokens) for o in orders for p in partitions]
    fitting = [c for c in cands if c.fits and c.num_blocks >= c.min_blocks]
    if not fitting and request.num_gpu_blocks_override is not None:
        # The user owns the pool (vLLM does not check the override against memory): a pool the
        # plan's estimates call tight runs as set, with a warning; one past the card is refused.
        tight = [c for c in cands if c.fits_hard]
        if tight:
            fitting = [_least_short(tight)]
            ctx.warnings.append(_tight_note(ctx, fitting[0], request.num_gpu_blocks_override))
    if not fitting:
        worst = _least_short(cands)
        r = max(range(pp), key=lambda i: worst.shortfall[i])
        what = "the weights, fixed costs and one request's KV cache"
        if request.num_gpu_blocks_override is not None:
            what = f"--num-gpu-blocks-override {request.num_gpu_blocks_override}"
        elif request.kv_cache_memory_bytes is not None:
            what = f"--kv-cache-memory-bytes {request.kv_cache_memory_bytes}"
        shorts = [(i, ctx.gpus[worst.order[i]].name, s) for i, s in enumerate(worst.shortfall) if s > 0]
        raise ModelDoesNotFit(
            r,
            ctx.gpus[worst.order[r]].name,
            max(worst.shortfall[r], 1),
            partition=list(worst.partition),
            what=what,
            shortfalls=shorts,
            kv_cache_dtype=request.kv_cache_dtype,
        )
    # vLLM caps --max-model-len at the model's maximum unless VLLM_ALLOW_LONG_MAX_MODEL_LEN is set
    cap = model.max_position_embeddings if not request.allow_long_max_model_len else max(c.max_ctx for c in fitting)
    best = max(fitting, key=lambda c: (min(c.max_ctx, cap), pool_size(c)))
    largest = min(best.max_ctx, cap)
    feasible = fitting if target is None else [c for c in fitting if c.max_ctx >= target]

    def decide(objective: str) -> Fit:
        said = list(notes)  # what the rule notes is this answer's
        if not feasible:
            # the plan at the largest length that fits: the split the objective takes at that length
            # (the serve line printed with it plans it again)
            at = [c for c in fitting if min(c.max_ctx, cap) >= largest]
            short, rule_, held = _choose(ctx, at, largest, objective, False, used, said, best)
            dt = decode_tokens if request.decode_context_tokens is not None else min(decode_tokens, largest)
            at_largest = _make_plan(ctx, short, largest, dt, overrides, said, len(cands), auto_fit=False,
                                    rule_=rule_, held=held)
            return Fit(at_largest, False, target, largest)
        chosen, rule_, held = _choose(ctx, feasible, target, objective, auto_fit, used, said)
        final_len = target if target is not None else min(chosen.max_ctx, cap)
        dt = decode_tokens
        if auto_fit and request.decode_context_tokens is None:
            dt = final_len  # predict decode at the context it fitted, not the model's maximum
        chosen_plan = _make_plan(ctx, chosen, final_len, dt, overrides, said, len(cands), auto_fit,
                                 rule_=rule_, held=held)
        return Fit(chosen_plan, True, target, largest)

    f = decide(request.objective)
    return f, (decide("pool") if pool_too and f.fits and f.plan.objective == "speed" else None)


def _least_short(cands: list[_Candidate]) -> _Candidate:
    """The candidate that comes closest to fitting: the smallest worst shortfall, then total."""
    return min(cands, key=lambda c: (max(c.shortfall), sum(max(s, 0) for s in c.shortfall)))


def _tight_note(ctx: _Context, c: _Candidate, override: int) -> str:
    shorts = [f"rank {r} ({ctx.gpus[c.order[r]].name}) is predicted short by {s / MIB:.2f} MiB"
              for r, s in enumerate(c.shortfall) if s > 0]
    return (f"--num-gpu-blocks-override {override}: {', '.join(shorts)} of the memory the plan keeps for "
            "vLLM's profile and the reserve; vLLM does not check the override against memory, so it runs "
            "as you set it: if a rank runs out of memory, lower the override")


def _choose(ctx: _Context, cands: list[_Candidate], length: int | None, objective: str, auto_fit: bool,
            used: list[GpuFacts], notes: list[str], pool_choice: _Candidate | None = None):
    """(the candidate the objective takes among ``cands``, the rule it applied, how many requests
    of ``length`` its pool was required to hold). ``pool_choice``: the pool rule's answer when the
    caller has it (the longest context's split). Notes a fall-back to the pool rule."""
    rule_ = rule(objective, auto_fit)
    if rule_ == "speed" and any(c.decode_ms is None for c in cands):
        rule_ = "pool"
        unknown = ", ".join(f"GPU {g.index} ({g.name})" for g in used if not g.bandwidth_gbps)
        notes.append(f"no memory bandwidth known for {unknown}: the split is chosen for the largest KV pool, "
                     "not the fastest predicted decode (plan takes a card's bandwidth as --gpus 'NAME:bw=GB/s')")
    if length is not None and length != (ctx.length or ctx.model.max_position_embeddings):
        cands = [replace(c, per_request=c.kv.blocks_per_request(length)) for c in cands]
    if rule_ == "pool":
        return (pool_choice or select(cands, rule_)), rule_, 1
    assert length is not None  # auto_fit is planned by the pool rule
    # a pool for --max-num-seqs requests of the full length at once, where a split holds one
    held = ctx.max_num_seqs if any(holds(c, ctx.max_num_seqs) for c in cands) else 1
    return select(cands, rule_, ctx.max_num_seqs), rule_, held


def check_stock(model: ModelSpec, gpus: list[GpuFacts], request: PlanRequest | None = None) -> Plan:
    """The plan for a stock run (one GPU, or ``pp_size=1``: vLLM uses the first GPU), checked
    as :func:`plan` checks a split: raises :class:`ModelDoesNotFit` or :class:`ContextTooLong`
    (with the largest ``--max-model-len`` that fits) where :func:`plan` would only report
    informative numbers. ``vllm-dualgpu plan`` uses it; the executor does not (a stock run is
    never refused by this package)."""
    return _fit_or_raise(fit_stock(model, gpus, request))


def fit_stock(model: ModelSpec, gpus: list[GpuFacts], request: PlanRequest | None = None) -> Fit:
    """:func:`check_stock` as a :class:`Fit`: falling short is answered with the first GPU's
    plan at the largest ``--max-model-len`` it holds (as the search makes it), not raised."""
    request = request or PlanRequest()
    if not gpus:
        raise BadRequest("no GPUs to plan for")
    gpu = min(gpus, key=lambda g: g.index)
    req1 = replace(request, pp_size=1, layer_partition=None, gpu_order=None)
    f = fit(model, [gpu], req1, _check_stock=True)
    if not f.fits:
        return f
    p = f.plan
    why = "pipeline_parallel_size=1" if request.pp_size == 1 else "one GPU"
    p.notes.insert(0, f"{why}: vLLM runs as stock (no GPU order, split or memory changes)")
    p.passthrough = True
    p.request = request
    return f


def _make_plan(ctx: _Context, c: _Candidate, max_model_len: int, decode_tokens: int, overrides, notes, n, auto_fit,
               rule_: str = "pool", held: int = 1) -> Plan:
    model = ctx.model
    ranks = _rank_plans(ctx, c, decode_tokens)
    notes = list(notes) + list(c.kv.notes)
    if ctx.request.num_gpu_blocks_override is not None:
        notes.append("--num-gpu-blocks-override: vLLM does not check this against free memory; the plan refuses "
                     "a pool past a card and warns of one past its estimates")
    if ctx.drafter is not None and ctx.drafter.embed_bytes and not ctx.request.drafter_shares_embedding:
        notes.append(
            "the drafter loads its own copy of the embedding on the last rank under PP "
            "(vLLM 0.30 maybe_share_target_embed)"
        )
    workspace = flashinfer_workspace_size(model, max_num_batched_tokens=ctx.max_num_batched_tokens,
                                          max_num_seqs=ctx.max_num_seqs, decode_query_len=ctx.decode_query_len,
                                          mm=ctx.mm)
    if ctx.drafter_backend and not (ctx.request.speculative or {}).get("attention_backend"):
        notes.append(f"the drafter's attention runs on {ctx.drafter_backend} (its window layers are a KV group of "
                     f"their own; on FlashInfer the last rank would hold a second "
                     f"{workspace / MIB:.0f} MiB workspace)")
    exported = 0
    if ctx.flashinfer and ctx.mm.flashinfer_workspace_sized:
        exported = configured_flashinfer_workspace(model, max_num_seqs=ctx.max_num_seqs,
                                                   decode_query_len=ctx.decode_query_len, mm=ctx.mm)
        notes.append(f"FlashInfer workspace: the executor sets VLLM_FLASHINFER_WORKSPACE_BUFFER_SIZE to "
                     f"{exported / MIB:.0f} MiB, twice what FlashInfer's split-KV plans can take on a card of up "
                     f"to {FLASHINFER_MAX_SMS} SMs (vLLM's default 394 MiB; vLLM grows it to "
                     f"{workspace / MIB:.0f} MiB for {ctx.max_num_batched_tokens:,} batched tokens)")
    if auto_fit:
        notes.append(f"--max-model-len auto: {max_model_len:,} is the largest that fits")
    kv_max = c.max_ctx
    return Plan(
        model=model,
        request=ctx.request,
        order=list(c.order),
        partition=list(c.partition),
        ranks=ranks,
        num_blocks=c.num_blocks,
        block_size=c.kv.block_size,
        max_model_len=max_model_len,
        max_context_tokens=min(kv_max, model.max_position_embeddings),
        kv_max_context_tokens=kv_max,
        pool_tokens=c.kv.pool_tokens(c.num_blocks, max_model_len) if max_model_len > 0 else 0,
        kv=c.kv,
        overrides=dict(overrides),
        passthrough=False,
        objective=rule_,
        notes=notes,
        warnings=list(ctx.warnings),
        candidates=n,
        drafter=ctx.drafter,
        max_num_batched_tokens=ctx.max_num_batched_tokens,
        max_num_seqs=ctx.max_num_seqs,
        decode_context_tokens=decode_tokens,
        held_requests=held,
        flashinfer_workspace_bytes=exported,
    )


def _passthrough(model: ModelSpec, gpus: list[GpuFacts], request: PlanRequest) -> Plan:
    """PP=1 or one GPU: vLLM runs as stock. Numbers are informative only; nothing is raised."""
    gpu = min(gpus, key=lambda g: g.index)
    why = "pipeline_parallel_size=1" if request.pp_size == 1 else "one GPU"
    req1 = replace(request, pp_size=1, layer_partition=None, gpu_order=None)
    notes = [f"{why}: vLLM runs as stock (no GPU order, split or memory changes)"]
    try:
        ctx = _Context(model, req1, 1, {gpu.index: gpu})
        max_len = request.max_model_len
        target = model.max_position_embeddings if max_len in (None, -1) else max_len
        c = _evaluate(ctx, (gpu.index,), (model.num_layers,), target)
        p = _make_plan(ctx, c, target, target, {}, notes, 1, auto_fit=False)
    except PlanError as e:  # informative numbers only; never fail a stock run
        from vllm_dualgpu.planner.kv import KVLayout as _KV

        kv = _KV.build(model)
        return Plan(
            model=model,
            request=request,
            order=[gpu.index],
            partition=[model.num_layers],
            ranks=[],
            num_blocks=0,
            block_size=kv.block_size,
            max_model_len=request.max_model_len or model.max_position_embeddings,
            max_context_tokens=0,
            kv_max_context_tokens=0,
            pool_tokens=0,
            kv=kv,
            passthrough=True,
            notes=notes + [f"(no estimate: {e})"],
        )
    p.passthrough = True
    p.request = request
    return p


def stock_estimate(
    model: ModelSpec,
    gpus: list[GpuFacts],
    request: PlanRequest | None = None,
    gpu_memory_utilization: float = 0.9,
) -> StockEstimate:
    """Predict stock vLLM 0.30: GPUs in CUDA order, even split, one utilization for every rank.

    A rank boots when the free memory its worker sees (NVML free minus its CUDA context) is at
    least ``total x utilization``; its KV cache gets ``total x utilization`` minus weights and
    runtime memory. Also finds the highest utilization (in steps of 0.01) that boots.
    """
    request = request or PlanRequest()
    pp = max(1, min(request.pp_size, len(gpus)))
    used = sorted(gpus, key=lambda g: g.index)[:pp]
    used = [g.with_known_defaults() for g in used]
    req = replace(request, pp_size=pp, gpu_order=None, memory=request.memory)
    ctx = _Context(model, req, pp, {g.index: g for g in used})
    part = list(request.layer_partition) if request.layer_partition else even_partition(model.num_layers, pp)
    max_len = request.max_model_len
    target = model.max_position_embeddings if max_len in (None, -1) else max_len
    need = ctx.kv.blocks_per_request(target) + 1

    def at(util: float) -> tuple[str, str, int, int]:
        """(status, reason, blocks, max context); status: boots, free, nokv or short."""
        start = 0
        blocks = []
        for r, n in enumerate(part):
            end = start + n
            first, last = r == 0, r == pp - 1
            g = used[r]
            requested = math.ceil(g.total_bytes * util)
            seen_free = g.free_bytes - ctx.mm.context_bytes(ctx.nvlink)
            if seen_free < requested:
                return "free", (
                    f"rank {r} ({g.short_name}) sees {seen_free / GIB:.2f} GiB free, less than "
                    f"{util:.2f} x {g.total_bytes / GIB:.1f} GiB"
                ), 0, 0
            fixed = ctx.fixed_sum[(first, last)] - ctx.mm.context_bytes(ctx.nvlink)
            # Stock vLLM creates the pipeline's NCCL communicators after sizing the KV cache
            # (this package creates them before profiling), so its sizing does not charge them.
            # Nor FlashInfer's workspaces: vLLM 0.33 builds its attention backends with the KV cache;
            # nor the batch a stage receives, which its profile never holds.
            charged = (ctx.reserve_sum[(first, last)] - ctx.reserve[(first, last)].get("pp_comms", 0)
                       - ctx.reserve[(first, last)].get("flashinfer_workspace", 0)
                       - ctx.reserve[(first, last)].get("pp_receive", 0))
            cost = ctx.rank_cost(start, end, first, last, 0)  # no XQA workspace: vLLM allocates it later too
            avail = requested - fixed - cost.weights_bytes - charged
            bpb = cost.kv_bytes_per_block
            if request.num_gpu_blocks_override is not None:
                blocks.append(request.num_gpu_blocks_override)
            elif request.kv_cache_memory_bytes is not None:
                blocks.append(request.kv_cache_memory_bytes // bpb)
            else:
                blocks.append(max(avail, 0) // bpb)
            start = end
        nb = min(blocks)
        if nb <= 0:
            r = blocks.index(nb)
            return "nokv", f"rank {r} ({used[r].short_name}) has no memory left for the KV cache", 0, 0
        mc = ctx.kv.max_len_for_blocks(nb)
        if nb < need:
            return "short", f"its {nb:,}-block KV pool holds at most {mc:,} tokens, not {target:,}", nb, mc
        return "boots", "boots", nb, mc

    status, why, nb, mc = at(gpu_memory_utilization)
    best_u = None
    best = ("free", "does not boot at any utilization", 0, 0)
    for k in range(99, 0, -1):
        res = at(k / 100)
        if res[0] != "free":
            best_u, best = k / 100, res
            break
    return StockEstimate(
        gpu_memory_utilization=gpu_memory_utilization,
        boots=status == "boots",
        reason=why,
        order=[g.index for g in used],
        partition=part,
        num_blocks=nb,
        max_context_tokens=mc,
        pool_tokens=ctx.kv.pool_tokens(nb, target) if nb else 0,
        best_utilization=best_u,
        best_num_blocks=best[2],
        best_pool_tokens=ctx.kv.pool_tokens(best[2], target) if best[2] else 0,
        best_max_context_tokens=best[3],
        best_boots=best[0] == "boots",
        best_reason=best[1],
    )
