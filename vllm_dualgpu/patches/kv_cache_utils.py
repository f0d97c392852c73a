"""Patches of ``vllm.v1.core.kv_cache_utils``: KV cache groups of a hybrid model with a drafter
under PP, without padding.

vLLM 0.30 groups layers with equal page sizes by ``_get_kv_cache_groups_uniform_page_size``:
every spec bucket is cut into groups of one size, the smallest bucket (the "1" of an n:1 layer
pattern). A drafter with its own attention spec is such a bucket: a 5-layer DFlash drafter next
to a Qwen3.5 target (16 attention, 48 Gated DeltaNet layers) makes the group size 5, the 16
attention layers become 4 groups of 4 padded to 5 (20 layer slots), and the last PP rank, which
holds the drafter, pays 5 token-scaling groups x 5 pages per block for 13 layers. The grouping
also ignores which PP rank holds which layer, though every rank allocates one block per group.

Under the dualgpu executor with PP > 1, ``get_kv_cache_configs`` (which knows every rank's
layers and memory) records them for the duration of the call, and the grouping then picks,
among vLLM's own grouping and groupings that cap the layers any group holds on any one rank
(1, 2, ... per rank, layers interleaved across ranks as vLLM does), the one whose longest
request (``max_model_len``) needs the smallest share of the tightest rank's KV memory,
measured with vLLM's own ``_max_memory_usage_bytes_from_groups`` on each rank's projection.
Candidates with more groups than vLLM's own grouping are not considered (every group costs
scheduler and attention-metadata work each step); on a tie vLLM's grouping wins, then fewer
groups. A model whose buckets already divide evenly (e.g. Qwen3.5 with MTP, whose drafter layer
shares the target's attention spec) keeps vLLM's grouping, since nothing beats it.

Before the grouping, ``unify_kv_cache_spec_page_size`` gives every layer one page size; under
the same condition a drafter's attention block is resized to the hybrid model's page (see the
section at the end of this file).

vLLM 0.33 moved KV planning to ``vllm.v1.core.kv_cache_planning``: EngineCore groups the whole
model (``get_global_kv_cache_groups``) BEFORE it measures memory, passes the groups to
``get_kv_cache_configs`` as a 4th argument, and the estimators take the platform's
``KVCacheConfigBuilder`` first. The 0.33 entries therefore regroup inside
``get_kv_cache_configs``, once every rank's memory is known, with vLLM's own
``get_global_kv_cache_groups`` (so the drafter tagging and checks stay vLLM's), and the helpers
below call each release's estimators. 0.33's experimental pluggable builder
(``Platform.get_kv_cache_config_builder_cls``, vLLM PR #53558) is not used: its grouping hook
runs before memory is measured and sees neither ranks nor memory, a plugin can only select a
builder by patching the platform's classmethod, and overriding ``get_kv_cache_groups`` would mean
mirroring vLLM's private grouping code (HiSparse, packed groups, hidden-state layers) instead of
wrapping two functions.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
from collections import defaultdict
from collections.abc import Callable

from vllm_dualgpu.engine.vllm_kv import (  # noqa: F401  (the patches' and their tests' helpers)
    _WORKERS,
    _Workers,
    estimate_max_model_len,
    max_memory_usage_bytes,
    model_kv_cache_groups,
    planning_module,
    pool_bytes_per_block,
    project_groups,
)
from vllm_dualgpu.log import logger
from vllm_dualgpu.patches.spec_common import is_dualgpu_pp




def kv_cache_configs(vllm_config, kv_cache_specs: list, available_memory: list) -> list:
    """vLLM's per-rank KV cache configs, called as EngineCore calls them in this release (0.33
    forms the model's groups first and passes them in)."""
    module = planning_module()
    if hasattr(module, "get_global_kv_cache_groups"):
        groups = module.get_global_kv_cache_groups(vllm_config, kv_cache_specs)
        return module.get_kv_cache_configs(vllm_config, kv_cache_specs, available_memory, groups)
    return module.get_kv_cache_configs(vllm_config, kv_cache_specs, available_memory)


def wrap_get_kv_cache_configs(original: Callable) -> Callable:
    @functools.wraps(original)
    def get_kv_cache_configs(vllm_config, kv_cache_specs, available_memory):
        if not is_dualgpu_pp(vllm_config) or len(kv_cache_specs) < 2:
            return original(vllm_config, kv_cache_specs, available_memory)
        token = _WORKERS.set(
            _Workers(vllm_config, tuple(dict(s) for s in kv_cache_specs), tuple(available_memory))
        )
        try:
            return original(vllm_config, kv_cache_specs, available_memory)
        finally:
            _WORKERS.reset(token)

    return get_kv_cache_configs


def wrap_get_kv_cache_configs_global_groups(original: Callable) -> Callable:
    """vLLM 0.33+: the groups come in, formed before memory was measured; under dualgpu with
    PP > 1 they are formed again by vLLM's get_global_kv_cache_groups with every rank's layers
    and memory known (the grouping patches below act then), and vLLM plans with those."""

    @functools.wraps(original)
    def get_kv_cache_configs(vllm_config, kv_cache_specs, available_memory, global_kv_cache_groups):
        if not is_dualgpu_pp(vllm_config) or len(kv_cache_specs) < 2:
            return original(vllm_config, kv_cache_specs, available_memory, global_kv_cache_groups)
        from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups

        token = _WORKERS.set(
            _Workers(vllm_config, tuple(dict(s) for s in kv_cache_specs), tuple(available_memory))
        )
        try:
            groups = get_global_kv_cache_groups(vllm_config, kv_cache_specs)
        finally:
            _WORKERS.reset(token)
        return original(vllm_config, kv_cache_specs, available_memory, groups)

    return get_kv_cache_configs


def spec_buckets(kv_cache_spec: dict) -> list[list[str]]:
    """Layers grouped by mergeable spec, exactly as vLLM 0.30's uniform-page-size grouping."""
    same_type_layers: dict = defaultdict(list)
    for layer_name, layer_spec in kv_cache_spec.items():
        same_type_layers[layer_spec].append(layer_name)
    layer_buckets: list[list[str]] = []
    spec_buckets_: list[list] = []
    for layer_spec, layer_names in same_type_layers.items():
        for names, specs in zip(layer_buckets, spec_buckets_):
            try:
                type(specs[0]).merge([*specs, layer_spec])
            except (AssertionError, ValueError):
                continue
            names.extend(layer_names)
            specs.append(layer_spec)
            break
        else:
            layer_buckets.append(list(layer_names))
            spec_buckets_.append([layer_spec])
    return layer_buckets


def capped_grouping(buckets: list[list[str]], worker_layers: list[set], cap: int) -> list[list[str]]:
    """Cut each bucket into the fewest groups holding at most ``cap`` layers on any one rank.

    A bucket's layers come rank by rank (the merged spec is built worker by worker), so the
    interleave ``layers[i::n]`` that vLLM uses puts at most ceil(count_on_rank / n) layers of
    each rank into each group.
    """
    grouped: list[list[str]] = []
    for layers in buckets:
        per_rank = [sum(1 for name in layers if name in w) for w in worker_layers]
        n = max(1, max(math.ceil(c / cap) for c in per_rank))
        n = min(n, len(layers))
        grouped.extend(layers[i::n] for i in range(n))
    return grouped


def grouping_cost(kv_cache_groups: list, workers: _Workers) -> float:
    """Share of the tightest rank's KV memory one max_model_len request needs (vLLM's measure)."""
    worst = 0.0
    for spec, memory in zip(workers.specs, workers.memory):
        projected = project_groups(kv_cache_groups, spec)
        if not any(g.layer_names for g in projected):
            continue
        need = max_memory_usage_bytes(workers.vllm_config, projected)
        worst = max(worst, need / max(memory, 1))
    return worst


def choose_grouping(stock: list, kv_cache_spec: dict, workers: _Workers) -> list:
    create_kv_cache_group_specs = planning_module().create_kv_cache_group_specs
    buckets = spec_buckets(kv_cache_spec)
    worker_layers = [set(s) for s in workers.specs]
    if any(not any(name in w for w in worker_layers) for b in buckets for name in b):
        return stock  # a layer no rank reports: do not guess
    most = max(max(sum(1 for n in b if n in w) for w in worker_layers) for b in buckets)
    candidates = [(grouping_cost(stock, workers), 0, len(stock), stock)]
    for cap in range(1, most + 1):
        grouped = capped_grouping(buckets, worker_layers, cap)
        if len(grouped) > len(stock):
            continue
        groups = create_kv_cache_group_specs(kv_cache_spec, grouped)
        candidates.append((grouping_cost(groups, workers), 1, len(groups), groups))
    cost, _, _, best = min(candidates, key=lambda c: (round(c[0], 12), c[1], c[2]))
    if best is not stock:
        stock_cost = candidates[0][0]
        sizes = [len(g.layer_names) for g in stock]
        padded = max(sizes) * len(sizes) - sum(sizes)  # vLLM pads every group to one size
        logger.info(
            "vllm-dualgpu: KV cache groups %s instead of vLLM's %s (layers per group); a "
            "max_model_len request needs %.1f%% instead of %.1f%% of the tightest rank's KV memory%s",
            [len(g.layer_names) for g in best],
            sizes,
            100 * cost,
            100 * stock_cost,
            (f"; vLLM's warning of {padded} padding layers, if given before, was about its grouping, "
             "which is not used" if padded else ""),
        )
    return best


class _HeldRecords(logging.Filter):
    """Holds back a logger's records while vLLM forms its own grouping: its "Add N padding
    layers, may waste at most X% KV cache memory" warning is about that grouping, and misleads
    where the package's replaces it. :meth:`release` lets them through after all."""

    def __init__(self, logger: logging.Logger):
        super().__init__()
        self.logger, self.records = logger, []

    def filter(self, record: logging.LogRecord) -> bool:
        self.records.append(record)
        return False

    def release(self) -> None:
        for record in self.records:
            self.logger.handle(record)
        self.records = []


def wrap_get_kv_cache_groups_uniform_page_size(original: Callable) -> Callable:
    @functools.wraps(original)
    def _get_kv_cache_groups_uniform_page_size(kv_cache_spec):
        workers = _WORKERS.get()
        if workers is None:
            return original(kv_cache_spec)
        vllm_logger = logging.getLogger(original.__module__)
        held = _HeldRecords(vllm_logger)
        vllm_logger.addFilter(held)
        try:
            stock = original(kv_cache_spec)
        finally:
            vllm_logger.removeFilter(held)
        best = stock if len(stock) < 2 else choose_grouping(stock, kv_cache_spec, workers)
        if best is stock:
            held.release()  # vLLM's grouping stands, and so does what vLLM said of it
        return best

    return _get_kv_cache_groups_uniform_page_size


# --- drafter pages promoted to the target's page (second half of item 7) ----------------------
#
# vLLM's platform sizes a hybrid model's attention block so that its page covers a Mamba/GDN
# state and pads the Mamba page to it: one common page C. A drafter with its own attention spec
# (another head count or size) has another per-token page q. ``unify_kv_cache_spec_page_size``
# then only multiplies block sizes by whole ratios of pages: a drafter page that does not divide
# C is padded to C, and a drafter page larger than C becomes the common page, so every Mamba page
# is padded to it and the target's attention blocks grow (or are padded). Under dualgpu with
# PP > 1 the drafter's block size becomes C / q when that is a whole multiple of the block's
# kernel alignment, so every page is exactly C; when it is not, the block size that would allow
# it is logged.


def kernel_alignment(block_size: int) -> int:
    """What a re-blocked attention layer's block size must be a multiple of. The kernel block
    sizes of vLLM's FlashAttention, FlashInfer and Triton backends are multiples of 16 (FlashInfer:
    16/32/64); FA4 with head size 256 takes only 128, and vLLM then makes the block a multiple of
    128. A block that is a multiple of 128 therefore keeps 128; any other keeps gcd(block, 16)."""
    return 128 if block_size % 128 == 0 else math.gcd(block_size, 16)


def per_token_page(spec) -> int:
    return dataclasses.replace(spec, block_size=1, page_size_padded=None).unpadded_page_size_bytes


def promotable(spec) -> bool:
    from vllm.v1.kv_cache_interface import AttentionSpec, MLAAttentionSpec

    return (
        isinstance(spec, AttentionSpec)
        and not isinstance(spec, MLAAttentionSpec)
        and spec.tokens_per_state == 1
    )


def promoted_block_size(common_page: int, spec) -> int | None:
    """The drafter block size whose page is exactly ``common_page``, if the kernels take it."""
    q = per_token_page(spec)
    if common_page % q:
        return None
    block = common_page // q
    return block if block % kernel_alignment(spec.block_size) == 0 else None


def working_block_size(target, drafter, limit: int = 64) -> int | None:
    """The smallest --block-size at least the target's (same alignment) with which the drafter's
    block could be promoted; both layers take the block size vLLM gives every attention layer."""
    step = math.gcd(target.block_size, 16)
    for candidate in range(target.block_size, target.block_size * limit + 1, step):
        common = candidate * per_token_page(target)
        if promoted_block_size(common, dataclasses.replace(drafter, block_size=candidate)):
            return candidate
    return None


def promote_drafter_pages(kv_cache_spec: dict, workers: _Workers) -> dict:
    """``kv_cache_spec`` with attention layers whose page differs from the Mamba page re-blocked
    to that page where the kernels allow it; the rest is left to vLLM and reported."""
    from vllm.v1.kv_cache_interface import MambaSpec

    mamba_pages = {s.page_size_bytes for s in kv_cache_spec.values() if isinstance(s, MambaSpec)}
    if len(mamba_pages) != 1:
        return kv_cache_spec
    common = mamba_pages.pop()
    promoted = dict(kv_cache_spec)
    blocked: dict = {}
    for name, spec in kv_cache_spec.items():
        if isinstance(spec, MambaSpec) or spec.page_size_bytes == common or not promotable(spec):
            continue
        block = promoted_block_size(common, spec)
        if block is None:
            blocked.setdefault(spec, []).append(name)
        else:
            promoted[name] = dataclasses.replace(spec, block_size=block, page_size_padded=None)
    changed = {
        (spec.block_size, promoted[name].block_size)
        for name, spec in kv_cache_spec.items()
        if promoted[name] is not spec
    }
    if changed:
        logger.info(
            "vllm-dualgpu: drafter KV block size %s, so its pages equal the model's %d-byte page "
            "without padding",
            ", ".join(f"{a} -> {b} tokens" for a, b in sorted(changed)),
            common,
        )
    if blocked:
        target = next(
            (s for s in kv_cache_spec.values()
             if promotable(s) and s.page_size_padded is None and s.page_size_bytes == common),
            None,
        )
        cache_config = workers.vllm_config.cache_config  # type: ignore[attr-defined]
        for spec, names in blocked.items():
            report_blocked(spec, names, common, target, cache_config.user_specified_block_size)
    return promoted


def report_blocked(spec, names: list[str], common: int, target, user_set: bool) -> str:
    better = working_block_size(target, spec) if target is not None else None
    advice = (
        f"--block-size {better} would let the drafter's pages match exactly"
        if better
        else "no block size up to 64 times the current one would let them match"
    )
    message = (
        f"vllm-dualgpu: {'--block-size' if user_set else 'the block size vLLM chose,'} "
        f"{spec.block_size}, leaves the KV pages of {len(names)} drafter layer(s) ({names[0]}, "
        f"{per_token_page(spec)} bytes per token) off the model's {common}-byte page, so vLLM "
        f"pads pages; {advice}."
    )
    logger.warning(message)
    return message


def wrap_unify_kv_cache_spec_page_size(original: Callable) -> Callable:
    @functools.wraps(original)
    def unify_kv_cache_spec_page_size(kv_cache_spec):
        workers = _WORKERS.get()
        if workers is None:
            return original(kv_cache_spec)
        return original(promote_drafter_pages(kv_cache_spec, workers))

    return unify_kv_cache_spec_page_size
