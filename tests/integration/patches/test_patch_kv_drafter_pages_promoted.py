"""Issue #6 item 7, second half: drafter KV pages promoted to a hybrid model's page under PP.

Real ``KVCacheSpec`` objects (GDN ``MambaSpec`` padded to the attention page as vLLM's platform
does, target and drafter ``FullAttentionSpec`` with different head sizes) through vLLM's own
``get_kv_cache_configs``, stock (the patch reverted) vs patched.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from conftest import registry_patch
from vllm_dualgpu.patching.registry import for_version
from spec_pp import (  # noqa: F401  (fixtures and helpers of the item-7 tests)
    applied,
    kv_layout,
    mamba_spec,
    pp_configs,
)

from vllm_dualgpu.patches import kv_cache_utils as kvp
from vllm_dualgpu.patching.core import APPLIED, apply_patch, revert_patch

PATCH = "kv-drafter-pages-promoted"


def rank_specs(block_size: int, drafter_head: int = 128):
    """16 target layers (every 4th full attention, GDN elsewhere) split 8/8 and 2 drafter
    attention layers on the last rank whose per-token page is drafter_head / 64 times the
    target's."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    attn = FullAttentionSpec(
        block_size=block_size, num_kv_heads=2, head_size=64, dtype=torch.bfloat16
    )
    gdn = dataclasses.replace(mamba_spec(block_size), page_size_padded=attn.page_size_bytes)
    draft = FullAttentionSpec(
        block_size=block_size, num_kv_heads=2, head_size=drafter_head, dtype=torch.bfloat16
    )
    ranks: list[dict] = [{}, {}]
    for i in range(16):
        ranks[i // 8][f"model.layers.{i}.{'attn' if (i + 1) % 4 == 0 else 'gdn'}"] = (
            attn if (i + 1) % 4 == 0 else gdn
        )
    for j in range(2):
        ranks[1][f"draft.layers.{j}.attn"] = draft
    return ranks, attn.page_size_bytes


def plan(cfg, ranks):
    configs = kvp.kv_cache_configs(cfg, [dict(r) for r in ranks], [2**30, 2**30])
    specs = {}
    for c in configs:
        for g in c.kv_cache_groups:
            for name in g.layer_names:
                specs[name] = g.kv_cache_spec
    per_rank_bytes = [kvp.pool_bytes_per_block(cfg, c.kv_cache_groups) for c in configs]
    return specs, configs[0].num_blocks, per_rank_bytes


def stock_and_patched(cfg, ranks, vllm_version):
    patched = plan(cfg, ranks)
    patch = for_version(PATCH, vllm_version)
    assert revert_patch(patch)
    try:
        stock = plan(cfg, ranks)
    finally:
        assert apply_patch(patch, vllm_version).status == APPLIED
    return stock, patched


@pytest.fixture
def promoting(applied):
    for name in ("kv-groups-know-ranks", "kv-groups-without-padding", PATCH):
        applied(name)


def test_drafter_page_promoted_instead_of_padding_mamba(promoting, kv_layout, vllm_version):
    from vllm.v1.kv_cache_interface import MambaSpec

    ranks, page = rank_specs(64)  # drafter: 1024 bytes per token, target: 512
    (stock, stock_blocks, stock_bpb), (patched, blocks, bpb) = stock_and_patched(
        kv_layout["dualgpu"], ranks, vllm_version
    )
    draft, gdn, attn = "draft.layers.0.attn", "model.layers.0.gdn", "model.layers.3.attn"
    # vLLM 0.30: the drafter's 64 KiB page becomes the common page; every GDN page is padded
    # to it and the target's attention blocks double.
    assert isinstance(stock[gdn], MambaSpec) and stock[gdn].page_size_bytes == 2 * page
    assert stock[attn].block_size == 128 and stock[draft].block_size == 64
    # Patched: the drafter takes 32-token blocks; every page is the model's own.
    assert patched[draft].block_size == 32 and patched[draft].page_size_padded is None
    assert patched[draft].page_size_bytes == patched[gdn].page_size_bytes == page
    assert patched[attn].block_size == 64
    assert blocks > stock_blocks and max(bpb) < max(stock_bpb)


def test_drafter_page_that_divides_the_page_is_left_to_vllm(promoting, kv_layout, vllm_version):
    ranks, page = rank_specs(64, drafter_head=32)  # a quarter of the page: vLLM promotes it
    (stock, *_), (patched, *_) = stock_and_patched(kv_layout["dualgpu"], ranks, vllm_version)
    assert stock == patched
    assert patched["draft.layers.0.attn"].block_size == 128


def test_blocking_block_size_is_reported(promoting, kv_layout, vllm_version, monkeypatch):
    warnings: list[str] = []
    monkeypatch.setattr(kvp.logger, "warning", lambda msg, *a: warnings.append(msg % a))
    cfg = kv_layout["dualgpu"]
    monkeypatch.setattr(cfg.cache_config, "user_specified_block_size", True)
    ranks, page = rank_specs(48)  # the drafter would need 24-token blocks: not a kernel size
    (stock, *_), (patched, *_) = stock_and_patched(cfg, ranks, vllm_version)
    assert stock == patched  # left to vLLM
    assert len(warnings) == 1
    assert "--block-size 48, leaves the KV pages of 2 drafter layer(s)" in warnings[0]
    assert "--block-size 64 would let the drafter's pages match exactly" in warnings[0]
    # ... and 64 does: the drafter then takes 32-token blocks.
    ranks64, _ = rank_specs(64)
    promoted = kvp.promote_drafter_pages({n: s for r in ranks64 for n, s in r.items()}, None)
    assert promoted["draft.layers.1.attn"].block_size == 32


def test_stock_for_other_executors(promoting, kv_layout):
    ku = kvp.planning_module()

    ranks, _ = rank_specs(64)
    specs, _, _ = plan(kv_layout["mp"], ranks)
    merged = {n: s for r in ranks for n, s in r.items()}
    stock = ku.unify_kv_cache_spec_page_size.__wrapped__(merged)
    assert specs["draft.layers.0.attn"] == stock["draft.layers.0.attn"]
    assert specs["model.layers.3.attn"].block_size == 128


@pytest.mark.parametrize(
    ("block", "head", "expected"),
    [(64, 128, 32), (528, 128, None), (256, 128, 128), (128, 128, None),
     (48, 96, 32)],
)
def test_promoted_block_sizes(block, head, expected):
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    def spec(head_size):
        return FullAttentionSpec(
            block_size=block, num_kv_heads=2, head_size=head_size, dtype=torch.bfloat16
        )

    target, draft = spec(64), spec(head)
    assert kvp.promoted_block_size(target.page_size_bytes, draft) == expected
