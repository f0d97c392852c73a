"""Speculative decoding under PP (issue #6): each patch on real vLLM objects, stock vs patched.

Every test shows the stock behaviour (vLLM's original, reached through ``__wrapped__`` or by
reverting the patch) and the patched one, so each fails without its patch.
"""


from __future__ import annotations
import functools
import pickle
import shutil
import sys
import types
import pytest
import torch
from torch import nn
from conftest import apply_registry_patch, registry_patch
from vllm_dualgpu.patching.core import ALREADY, APPLIED, SENTINEL, Patch, apply_patch, revert_patch
from pathlib import Path
from spec_pp import applied, kv_layout, mamba_spec, pp_configs  # noqa: F401  (shared fixtures and helpers)


def hybrid_rank_specs(drafter_layers: int, drafter_same_spec: bool):
    """Per-rank KV specs shaped like the reference 27B (64 layers, every 4th full attention,
    GDN elsewhere, split 32/32) plus drafter layers on the last rank. Pages are equal, as
    vLLM's platform makes them for hybrid models (Mamba page padded to the attention page)."""
    import dataclasses

    from vllm.v1.kv_cache_interface import FullAttentionSpec

    bs = 64
    attn = FullAttentionSpec(block_size=bs, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    gdn = dataclasses.replace(mamba_spec(bs), page_size_padded=attn.page_size_bytes)
    # A drafter spec that differs from the target's but has the same page (e.g. DFlash).
    draft = attn if drafter_same_spec else FullAttentionSpec(
        block_size=bs, num_kv_heads=4, head_size=32, dtype=torch.bfloat16
    )
    assert draft.page_size_bytes == attn.page_size_bytes == gdn.page_size_bytes
    ranks: list[dict] = [{}, {}]
    for i in range(64):
        kind = attn if (i + 1) % 4 == 0 else gdn
        ranks[i // 32][f"model.layers.{i}.{'attn' if kind is attn else 'gdn'}"] = kind
    for j in range(drafter_layers):
        ranks[1][f"draft.layers.{j}.attn"] = draft
    return ranks, attn.page_size_bytes


def kv_plan(cfg, ranks, memory):
    from vllm_dualgpu.patches import kv_cache_utils as kvp

    configs = kvp.kv_cache_configs(cfg, [dict(r) for r in ranks], [memory, memory])
    # The global groups: each rank's config holds the same groups projected onto its layers.
    groups = [
        (sorted(a.layer_names + b.layer_names), a.kv_cache_spec)
        for a, b in zip(configs[0].kv_cache_groups, configs[1].kv_cache_groups)
    ]
    per_rank_bytes = [kvp.pool_bytes_per_block(cfg, c.kv_cache_groups) for c in configs]
    need = max(kvp.max_memory_usage_bytes(cfg, c.kv_cache_groups) for c in configs)
    return groups, per_rank_bytes, configs[0].num_blocks, need


def test_kv_groups_without_padding_for_a_drafter_bucket(applied, kv_layout, vllm_version):
    from vllm.v1.kv_cache_interface import MambaSpec

    applied("kv-groups-know-ranks")
    patch = applied("kv-groups-without-padding")
    cfg = kv_layout["dualgpu"]
    ranks, page = hybrid_rank_specs(drafter_layers=5, drafter_same_spec=False)
    memory = 4 * 2**30

    patched, patched_bpb, patched_blocks, patched_need = kv_plan(cfg, ranks, memory)
    assert revert_patch(patch)
    try:
        stock, stock_bpb, stock_blocks, stock_need = kv_plan(cfg, ranks, memory)
    finally:
        assert apply_patch(patch, vllm_version).status == APPLIED

    def attention_sizes(groups):
        return sorted(len(names) for names, spec in groups if not isinstance(spec, MambaSpec))

    # vLLM 0.30: group size 5 (the drafter bucket): 16 attention layers in 4 groups of 4, each
    # block sized for 5 layers; the drafter's rank pays 5 pages per block.
    assert attention_sizes(stock) == [4, 4, 4, 4, 5]
    assert stock_bpb[1] == 5 * page
    # Patched: every layer in exactly one group, no more groups than vLLM, less memory for a
    # max_model_len request on the tightest rank, more blocks for the same memory.
    names = [n for group, _ in patched for n in group]
    assert sorted(names) == sorted(n for r in ranks for n in r)
    assert len(patched) <= len(stock)
    assert patched_need < stock_need
    assert patched_blocks > stock_blocks
    assert max(patched_bpb) < max(stock_bpb)


def test_kv_groups_unchanged_when_vllm_has_no_padding(applied, kv_layout):
    """Qwen3.5 + MTP: the MTP layer shares the target's attention spec; vLLM's grouping is
    already exact (one attention group of 17, GDN groups of 16), so the patch keeps it."""
    from vllm_dualgpu.patches.kv_cache_utils import planning_module

    ku = planning_module()
    applied("kv-groups-know-ranks")
    applied("kv-groups-without-padding")
    ranks, page = hybrid_rank_specs(drafter_layers=1, drafter_same_spec=True)
    patched, bpb, _, _ = kv_plan(kv_layout["dualgpu"], ranks, 2**30)
    stock = ku._get_kv_cache_groups_uniform_page_size.__wrapped__(
        {n: s for r in ranks for n, s in r.items()}
    )
    assert [names for names, _ in patched] == [sorted(g.layer_names) for g in stock]
    assert sorted(len(names) for names, _ in patched) == [16, 16, 16, 17]
    assert bpb == [8 * page, 9 * page]  # exactly the attention layers each rank holds


def test_kv_groups_stock_for_other_executors(applied, kv_layout):
    from vllm_dualgpu.patches.kv_cache_utils import planning_module

    ku = planning_module()
    applied("kv-groups-know-ranks")
    applied("kv-groups-without-padding")
    ranks, _ = hybrid_rank_specs(drafter_layers=5, drafter_same_spec=False)
    groups, _, _, _ = kv_plan(kv_layout["mp"], ranks, 2**30)
    stock = ku._get_kv_cache_groups_uniform_page_size.__wrapped__(
        {n: s for r in ranks for n, s in r.items()}
    )
    assert [names for names, _ in groups] == [sorted(g.layer_names) for g in stock]
