"""The executor prices the plan's KV cache with vLLM's own functions, patched as the run will be.

The pure planner (planner/kv.py) mirrors vLLM's KV arithmetic, and the grouping the registry's
KV patches choose under the dualgpu executor (kv-groups-without-padding, kv-groups-know-ranks,
kv-drafter-pages-promoted: a DFlash drafter next to a hybrid model is grouped without padding),
so that ``vllm-dualgpu plan`` works without vLLM. Here, where vLLM is loaded, the plan is
checked with vLLM's own functions: the layers the planner sized become vLLM's spec objects
(``FullAttentionSpec`` or, for a drafter's sliding-window layers, ``SlidingWindowSpec`` with
vLLM's dtype and quantization mode for the cache dtype, ``MambaSpec`` with the model class's
own state shapes and dtypes), vLLM's grouping forms the
groups from the plan's split, every rank's layers and planned KV memory (as
``get_kv_cache_configs`` does at run time). The planner prices every split with the grouping
that split gets (``planner/kv_grouping.per_rank_grouping``); where vLLM's grouping of the plan's split is
another, the planner searches again with vLLM's (``KVLayout.regrouped``, the same interface as
the mirror) for that split and its own for every other, until vLLM agrees with the split it
chose. The plan's pool is then checked against vLLM's per-rank bytes per block and longest
request (``engine/vllm_kv.py``).

What stays the mirror's: the hybrid block size (vLLM's workers align it when they build the
model, after this runs; the hybrid-block-size patches make every stage use one) and the
per-token reads of the decode-time prediction.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass

from vllm_dualgpu.log import logger

#: Rounds of "vLLM groups the chosen split otherwise: search again with its grouping for that split".
MAX_ROUNDS = 3


class NotPriceable(RuntimeError):
    """The planner's layers cannot be written as vLLM's specs (the plan keeps the mirror)."""


@dataclass(frozen=True)
class VllmPool:
    """The pool vLLM's functions give the plan's split and per-rank KV memory."""

    num_blocks: int
    bytes_per_block: tuple[int, ...]
    max_model_len: int
    """vLLM's longest request on every rank's pool, searched up to the configured length."""
    num_groups: int


def layer_specs(vllm_config, layout) -> dict:
    """vLLM's spec for every layer the planner sized (``layout.raw_slots``, before unification)."""
    from vllm.utils.torch_utils import kv_cache_dtype_str_to_dtype
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec, get_kv_quant_mode

    from vllm_dualgpu.planner.kv import dtype_bytes

    mc = vllm_config.model_config
    cache_dtype = str(vllm_config.cache_config.cache_dtype)
    torch_dtype = kv_cache_dtype_str_to_dtype(cache_dtype, mc)
    quant_mode = get_kv_quant_mode(cache_dtype)
    element = dtype_bytes(cache_dtype, str(mc.dtype).removeprefix("torch."))
    mamba = None
    specs = {}
    for s in layout.raw_slots:
        if s.kind == "mamba":
            mamba = mamba or _mamba_spec(vllm_config, layout)
            specs[s.name] = mamba
            continue
        _, heads, head_dim, kvb, block, pad = s.spec_key
        if kvb != element or pad is not None:
            raise NotPriceable(f"{s.name}: a KV dtype ({kvb} bytes) other than the cache's ({element})")
        if s.sliding_window:  # a DFlash drafter's sliding-window layer
            spec = SlidingWindowSpec(block_size=block, num_kv_heads=heads, head_size=head_dim,
                                     dtype=torch_dtype, kv_quant_mode=quant_mode,
                                     sliding_window=s.sliding_window)
        else:
            spec = FullAttentionSpec(block_size=block, num_kv_heads=heads, head_size=head_dim,
                                     dtype=torch_dtype, kv_quant_mode=quant_mode)
        if spec.page_size_bytes != s.page_bytes:
            raise NotPriceable(f"{s.name}: vLLM's page is {spec.page_size_bytes:,} bytes, the "
                               f"planner's {s.page_bytes:,}")
        specs[s.name] = spec
    return specs


def _mamba_spec(vllm_config, layout):
    """The Gated DeltaNet layers' spec as vLLM's layer builds it, state from the model class."""
    import dataclasses

    from vllm.model_executor.models import ModelRegistry
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
    from vllm.v1.kv_cache_interface import MambaSpec

    mc, cc = vllm_config.model_config, vllm_config.cache_config
    if cc.mamba_cache_mode not in (None, layout.mamba_cache_mode):
        raise NotPriceable(f"mamba cache mode {cc.mamba_cache_mode!r}, the planner's {layout.mamba_cache_mode!r}")
    model_cls, _ = ModelRegistry.resolve_model_cls(mc.architecture, model_config=mc)
    align = layout.mamba_cache_mode == "align"
    spec = MambaSpec(
        shapes=tuple(model_cls.get_mamba_state_shape_from_config(vllm_config)),
        dtypes=tuple(model_cls.get_mamba_state_dtype_from_config(vllm_config)),
        block_size=layout.block_size if align else (cc.mamba_block_size or mc.max_model_len),
        page_size_padded=layout.mamba_page_padded,
        mamba_type=MambaAttentionBackendEnum.GDN_ATTN,
        mamba_cache_mode=layout.mamba_cache_mode,
        num_speculative_blocks=layout.num_speculative_tokens,
    )
    state = dataclasses.replace(spec, page_size_padded=None).page_size_bytes
    if state != layout.mamba_page_bytes:
        raise NotPriceable(f"vLLM's Gated DeltaNet state is {state:,} bytes, the planner's "
                           f"{layout.mamba_page_bytes:,}")
    return spec


def rank_specs(specs: dict, layout, partition) -> list[dict]:
    """Each pipeline rank's layers (target layers by the split, the drafter's on the last)."""
    bounds, start = [], 0
    for n in partition:
        bounds.append((start, start + n))
        start += n
    ranks: list[dict] = [{} for _ in partition]
    for s in layout.raw_slots:
        if s.layer_index is None:
            ranks[-1][s.name] = specs[s.name]
        else:
            r = next(i for i, (a, b) in enumerate(bounds) if a <= s.layer_index < b)
            ranks[r][s.name] = specs[s.name]
    return ranks


def priced_groups(vllm_config, groups) -> list:
    """vLLM's KV cache groups as the planner's plain :class:`PricedGroup` data."""
    from vllm.v1.kv_cache_interface import MambaSpec, SlidingWindowSpec, UniformTypeKVCacheSpecs

    from vllm_dualgpu.planner import PricedGroup

    out = []
    for g in groups:
        spec, names = g.kv_cache_spec, tuple(g.layer_names)
        if isinstance(spec, UniformTypeKVCacheSpecs):
            pages = {n: spec.kv_cache_specs[n].page_size_bytes for n in names}
        else:
            pages = {n: spec.page_size_bytes for n in names}
        if isinstance(spec, MambaSpec):
            const = spec.max_memory_usage_bytes(vllm_config) // spec.page_size_bytes
            out.append(PricedGroup("mamba", names, pages, 0, const))
        elif isinstance(spec, SlidingWindowSpec):  # keeps window - 1 + the tokens in flight
            keep = spec.sliding_window - 1 + spec.extra_retained_tokens + vllm_config.max_in_flight_tokens
            out.append(PricedGroup("attention", names, pages, spec.block_size, 0, keep))
        else:
            out.append(PricedGroup("attention", names, pages, spec.block_size, 0))
    return out


def vllm_pool(vllm_config, groups, ranks: list[dict], kv_budgets: list[int]) -> VllmPool:
    """Blocks every rank holds (the smallest rank's count), and the longest request they hold."""
    from vllm_dualgpu.engine import vllm_kv as kv

    projected = [kv.project_groups(groups, specs) for specs in ranks]
    bpb = tuple(kv.pool_bytes_per_block(vllm_config, p) for p in projected)
    num_blocks = min(max(b, 0) // per for b, per in zip(kv_budgets, bpb))
    mc = vllm_config.model_config
    saved = mc.max_model_len
    try:
        longest = min(kv.estimate_max_model_len(vllm_config, p, max(num_blocks - 1, 0) * per)
                      for p, per in zip(projected, bpb))
    finally:
        mc.max_model_len = saved
    return VllmPool(num_blocks, bpb, longest, len(groups))


#: The layout the mirror assumes (planner/kv.py): FlashAttention's and FlashInfer's on CUDA.
ASSUMED_LAYOUT = "LBNHC"


@contextlib.contextmanager
def _layout_resolved(vllm_config):
    """EngineCore resolves the KV cache layout once the workers report their backends, after
    this runs. vLLM's grouping reads it only to pack mixed page sizes block-outermost, which the
    plan does not price; meanwhile the mirror's layout stands in, and is taken back after."""
    cc = vllm_config.cache_config
    unset = getattr(cc, "kv_cache_layout", ASSUMED_LAYOUT) is None
    if unset:
        cc.kv_cache_layout = ASSUMED_LAYOUT
    try:
        yield
    finally:
        if unset:
            cc.kv_cache_layout = None


#: Loggers of the KV planning code run here as a rehearsal: the run logs the same lines again.
REHEARSED = ("vllm.v1.core.kv_cache_utils", "vllm.v1.core.kv_cache_planning")


@contextlib.contextmanager
def quiet_grouping():
    """What the grouping (the patches' INFO lines, vLLM's own warnings) says here, it says again
    at run time on the real specs; the outcome is logged once below."""
    quieted = [(logger, logging.WARNING)] + [(logging.getLogger(n), logging.ERROR) for n in REHEARSED]
    saved = [lg.level for lg, _ in quieted]
    for lg, level in quieted:
        lg.setLevel(level)
    try:
        yield
    finally:
        for (lg, _), level in zip(quieted, saved):
            lg.setLevel(level)


def reprice(vllm_config, plan, search: Callable) -> tuple[object, VllmPool | None]:
    """The plan with its KV cache priced by vLLM's functions: where vLLM groups the plan's split
    otherwise than the planner did, ``search(groupings)`` plans again with vLLM's grouping for the
    splits in ``groupings`` ({(GPU order, split): layout}) and the planner's own for every other
    split, until vLLM groups the chosen split as it was priced. Returns the plan and vLLM's pool
    for it (None, with a WARNING, where the layers cannot be written as vLLM's specs)."""
    from vllm_dualgpu.engine.vllm_kv import groups_for_ranks

    mirror = plan.kv
    groupings: dict[tuple, object] = {}
    with quiet_grouping(), _layout_resolved(vllm_config):
        specs = None
        for round_ in range(MAX_ROUNDS):
            try:
                if specs is None:  # the layers stay; only the split moves between rounds
                    specs = layer_specs(vllm_config, mirror)
                ranks = rank_specs(specs, mirror, plan.partition)
                budgets = plan.grouping_budgets()
                groups = groups_for_ranks(vllm_config, ranks, budgets)
                priced = mirror.regrouped(priced_groups(vllm_config, groups))
                pool = vllm_pool(vllm_config, groups, ranks, budgets)
            except Exception as e:  # never a half-priced plan: the last whole one stands
                why = str(e) if isinstance(e, NotPriceable) else f"{type(e).__name__}: {e}"
                logger.warning("vllm-dualgpu: KV cache priced by the planner's own arithmetic "
                               "only: %s", why)
                return plan, None
            split = (tuple(plan.order), tuple(plan.partition))
            if priced.same_grouping(plan.kv) or round_ == MAX_ROUNDS - 1 or split in groupings:
                break  # the groups and the pool are this plan's
            groupings[split] = priced
            plan = search(dict(groupings))
    if groupings:
        (_, first), vllm_grouping = next(iter(groupings.items()))
        logger.info(
            "vllm-dualgpu: KV cache priced with vLLM's grouping under this package's patches: it groups split "
            "%s into %d groups of %s layers, the planner %d groups of %s; the %d split(s) vLLM grouped are "
            "priced with its grouping, every other with the planner's; split %s",
            "/".join(map(str, first)), len(vllm_grouping.groups), _sizes(vllm_grouping), len(mirror.groups),
            _sizes(mirror), len(groupings), "/".join(map(str, plan.partition)),
        )
    override = plan.request.num_gpu_blocks_override
    if override is not None:  # the pool is the user's; vLLM's count from the budgets is moot
        if pool.num_blocks != override:
            logger.info("vllm-dualgpu: --num-gpu-blocks-override %s sets the pool (vLLM's functions "
                        "would size %s blocks from the budgets)", f"{override:,}", f"{pool.num_blocks:,}")
    elif pool.num_blocks != plan.num_blocks:
        logger.warning(
            "vllm-dualgpu: vLLM's functions give this split %s KV blocks, the plan %s "
            "(bytes per block per rank: vLLM %s, plan %s); vLLM's measurement after profiling decides",
            f"{pool.num_blocks:,}", f"{plan.num_blocks:,}", list(pool.bytes_per_block),
            [r.kv_bytes_per_block for r in plan.ranks],
        )
    return plan, pool


def _sizes(layout) -> str:
    return "/".join(sorted({str(len(g.members)) for g in layout.groups}, key=int))
