"""The context-fit check after profiling agrees with the allocation on an uneven hybrid split.

The headline's fp8-mtp arm (Qwen3.5 shape, split 15/49, the MTP layer on the last rank, vLLM
0.33 on the virtual pair) was refused by this check: "rank 0 has room for 112,000 tokens" in
4.60 GiB, about 17 pages a block, where the plan prices 4 pages on rank 0 and 14 on rank 1.
On the CPU the same shape's specs give the allocation's 4 and 14 pages and the check agrees
with vLLM's run-time ``get_kv_cache_configs`` both ways (these tests), so the GPU workers'
specs differ from these; the refusal now names each rank's block size to find out where.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from spec_pp import applied, kv_layout, mamba_spec, pp_configs  # noqa: F401  (shared fixtures)


def uneven_hybrid(first: int):
    """The reference 27B's 64 layers (every 4th full attention, GDN elsewhere) split first/rest,
    plus one MTP attention layer on the last rank; equal pages as vLLM's platform makes them."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    bs = 64
    attn = FullAttentionSpec(block_size=bs, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    gdn = dataclasses.replace(mamba_spec(bs), page_size_padded=attn.page_size_bytes)
    ranks: list[dict] = [{}, {}]
    for i in range(64):
        kind = attn if (i + 1) % 4 == 0 else gdn
        ranks[0 if i < first else 1][f"model.layers.{i}.{'attn' if kind is attn else 'gdn'}"] = kind
    ranks[1]["mtp.layers.0.attn"] = attn
    return ranks, bs


def allocation(cfg, ranks, memory):
    """What vLLM's run-time planning does with this memory (patched, as EngineCore calls it)."""
    from vllm_dualgpu.patches.kv_cache_utils import kv_cache_configs

    return kv_cache_configs(cfg, [dict(r) for r in ranks], list(memory))


@pytest.fixture
def split_15_49(applied, kv_layout):  # noqa: F811
    """(config, rank specs, block size, each rank's bytes a block as the allocation prices it)."""
    from vllm_dualgpu.patches.kv_cache_utils import pool_bytes_per_block

    applied("kv-groups-know-ranks")
    applied("kv-groups-without-padding")
    cfg = kv_layout["dualgpu"]
    ranks, bs = uneven_hybrid(15)
    probe = allocation(cfg, ranks, [2**34, 2**34])
    return cfg, ranks, bs, [pool_bytes_per_block(cfg, c.kv_cache_groups) for c in probe]


def test_the_check_passes_what_the_allocation_holds(split_15_49):
    from vllm_dualgpu.engine.context_fit import check_context_fits

    cfg, ranks, bs, per_block = split_15_49
    # Size each rank for the allocation's own blocks: enough for max_model_len and a few more.
    need_blocks = -(-cfg.model_config.max_model_len // bs) + 8
    memory = [need_blocks * b for b in per_block]
    configs = allocation(cfg, ranks, memory)  # vLLM accepts max_model_len with this memory
    assert min(c.num_blocks for c in configs) * bs >= cfg.model_config.max_model_len
    check_context_fits(cfg, [dict(r) for r in ranks], memory)


def test_the_largest_length_it_reports_is_what_the_allocation_accepts(split_15_49):
    from vllm_dualgpu.engine.context_fit import ContextDoesNotFit, check_context_fits

    cfg, ranks, bs, per_block = split_15_49
    memory = [per_block[0] * 400, per_block[1] * 40]  # rank 1 limits, far below max_model_len
    with pytest.raises(ValueError, match="estimated maximum model length is"):
        allocation(cfg, ranks, memory)
    with pytest.raises(ContextDoesNotFit) as err:
        check_context_fits(cfg, [dict(r) for r in ranks], memory)
    assert "rank 1" in str(err.value).split(" has room")[0]
    keep = cfg.model_config.max_model_len
    cfg.model_config.max_model_len = err.value.largest
    try:
        allocation(cfg, ranks, memory)  # accepted at the length reported
        cfg.model_config.max_model_len = err.value.largest + bs
        with pytest.raises(ValueError, match="estimated maximum model length is"):
            allocation(cfg, ranks, memory)  # and not one block more
    finally:
        cfg.model_config.max_model_len = keep


def test_attention_layers_of_two_backends_do_not_group(applied, kv_layout):  # noqa: F811
    """The headline's refusal, reproduced: rank 0's attention layers carry FlashInfer's block
    alignment (a multiple of 64), rank 1's FlashAttention's (none). vLLM keeps them in separate
    buckets, groups the 65 layers in threes (vLLM's grouping), and the same memory holds a fraction
    of the tokens.
    Hence one backend on every rank (engine/attention_backend.py)."""
    from vllm.v1.kv_cache_interface import AttentionSpec

    if "block_stride_alignment" not in AttentionSpec.__dataclass_fields__:
        pytest.skip("this vLLM's KV specs carry no block alignment")
    from vllm.v1.attention.backend import MultipleOf

    from vllm_dualgpu.engine.context_fit import per_rank_max_len
    from vllm_dualgpu.engine import vllm_kv as kv

    applied("kv-groups-know-ranks")
    applied("kv-groups-without-padding")
    cfg = kv_layout["dualgpu"]
    ranks, bs = uneven_hybrid(15)
    flashinfer = [{n: (dataclasses.replace(s, block_stride_alignment=MultipleOf(64))
                       if isinstance(s, AttentionSpec) else s) for n, s in r.items()} for r in ranks]
    mixed = [flashinfer[0], ranks[1]]
    memory = [6 * 2**20, 2**30]  # rank 0, the small card, limits: below max_model_len (4,096)
    one_backend = per_rank_max_len(cfg, flashinfer, memory)
    two_backends = per_rank_max_len(cfg, mixed, memory)
    assert len(kv.model_kv_cache_groups(cfg, flashinfer)) == 4
    assert len(kv.model_kv_cache_groups(cfg, mixed)) > 4
    # Rank 0 (3 attention + 12 GDN layers) holds at most half the tokens with two backends, under
    # the groups the allocation uses (the package's grouping: the check prices those)
    assert one_backend[0] < 4096
    assert two_backends[0] * 2 <= one_backend[0], (one_backend, two_backends)


def uneven_hybrid_dflash(first: int):
    """The same 64 layers with a DFlash-like drafter in place of the MTP layer: 5 sliding-window
    attention layers on the last rank (a spec of their own, the target's page). vLLM's own
    grouping then cuts every bucket into groups of 5 (the drafter's bucket) and pads the 16
    attention layers to 20; the package's grouping (kv-groups-without-padding) does not."""
    from vllm.v1.kv_cache_interface import SlidingWindowSpec

    ranks, bs = uneven_hybrid(first)
    del ranks[1]["mtp.layers.0.attn"]
    window = SlidingWindowSpec(block_size=bs, num_kv_heads=2, head_size=64, dtype=torch.bfloat16,
                               sliding_window=512)
    for i in range(5):
        ranks[1][f"drafter.layers.{i}.attn"] = window
    return ranks, bs


def test_with_a_dflash_drafter_the_check_prices_the_allocations_groups(applied, kv_layout):  # noqa: F811
    """Seen on the virtual pair (W8A16 + DFlash2 at 19/45, vLLM 0.33): the check refused 241,664
    tokens, "rank 1 has room for 143,376 tokens ... 16.1 MiB a block", pricing vLLM's own grouping
    (groups of 5, 15 groups), while the allocation, under the package's grouping, held the plan's
    pool. The check must price the groups the allocation uses."""
    from vllm_dualgpu.engine.context_fit import check_context_fits, per_rank_max_len
    from vllm_dualgpu.engine import vllm_kv as kv
    from vllm_dualgpu.patches.kv_cache_utils import pool_bytes_per_block

    applied("kv-groups-know-ranks")
    applied("kv-groups-without-padding")
    cfg = kv_layout["dualgpu"]
    ranks, bs = uneven_hybrid_dflash(19)
    probe = allocation(cfg, ranks, [2**34, 2**34])
    stock = kv.model_kv_cache_groups(cfg, [dict(r) for r in ranks])
    assert len(probe[0].kv_cache_groups) != len(stock)  # the package's grouping is not vLLM's here
    per_block = [pool_bytes_per_block(cfg, c.kv_cache_groups) for c in probe]

    def accepted(blocks: int) -> bool:
        try:
            allocation(cfg, ranks, [blocks * b for b in per_block])
        except ValueError:
            return False
        return True

    lo, hi = 1, 4096  # the fewest blocks a rank at which vLLM's allocation accepts max_model_len
    assert accepted(hi) and not accepted(lo)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if accepted(mid) else (mid, hi)
    memory = [hi * b for b in per_block]
    check_context_fits(cfg, [dict(r) for r in ranks], memory)
    assert min(per_rank_max_len(cfg, [dict(r) for r in ranks], memory)) >= cfg.model_config.max_model_len


def _padding_warnings(caplog) -> list[str]:
    return [m for m in (r.getMessage() for r in caplog.records) if m.startswith("Add ") and "padding layers" in m]


def test_vllms_padding_warning_is_said_only_for_a_grouping_that_pads(applied, kv_layout, caplog):  # noqa: F811
    """vLLM warns "Add 4 padding layers, may waste at most 25.00% KV cache memory" while forming
    its own grouping. Where the package's grouping replaces it once every rank's memory is known (a
    DFlash-like drafter on the hybrid), nothing is padded: forming the groups then says no such
    thing, and the package's line says that vLLM's earlier warning was about the grouping it
    replaced. Where vLLM's grouping stays (the MTP case, which pads its GDN layers), so does the
    warning."""
    import logging

    from vllm_dualgpu.engine.vllm_kv import groups_for_ranks

    applied("kv-groups-know-ranks")
    applied("kv-groups-without-padding")
    cfg = kv_layout["dualgpu"]
    caplog.set_level(logging.INFO)
    for name in ("vllm", "vllm.dualgpu"):
        logging.getLogger(name).propagate = True
    ranks, _ = uneven_hybrid_dflash(19)
    groups = groups_for_ranks(cfg, [dict(r) for r in ranks], [2**34, 2**34])
    said = [r.getMessage() for r in caplog.records if "instead of vLLM's" in r.getMessage()]
    assert said and "padding" in said[0], said  # replaced, and it says what of vLLM's warning
    assert not _padding_warnings(caplog), _padding_warnings(caplog)
    assert len({len(g.layer_names) for g in groups}) > 1  # groups of their own sizes: nothing padded

    caplog.clear()
    ranks, _ = uneven_hybrid(15)
    groups = groups_for_ranks(cfg, [dict(r) for r in ranks], [2**34, 2**34])
    assert not any("instead of vLLM's" in r.getMessage() for r in caplog.records)  # vLLM's kept
    sizes = [len(g.layer_names) for g in groups]
    assert max(sizes) * len(sizes) > sum(sizes)  # and it pads (every group is sized for the largest)
    assert _padding_warnings(caplog)


def test_the_check_and_the_allocation_say_the_grouping_once(applied, kv_layout):  # noqa: F811
    """Seen on the virtual pair (W8A16 + DFlash2 at 19/45, vLLM 0.33): the engine logged "KV cache
    groups [16, 16, 16, 16, 5] instead of vLLM's ..." twice at the same second, once from the
    context-fit check (which forms the allocation's groups to price them) and once from the
    allocation. The allocation says it; the check, which runs just before, does not."""
    import logging

    from vllm_dualgpu.engine.context_fit import check_context_fits

    class Said(logging.Handler):  # what the package's logger emits, counted once each
        def __init__(self):
            super().__init__(logging.DEBUG)
            self.lines = []

        def emit(self, record):
            self.lines.append(record.getMessage())

    applied("kv-groups-know-ranks")
    applied("kv-groups-without-padding")
    cfg = kv_layout["dualgpu"]
    ours, said = logging.getLogger("vllm.dualgpu"), Said()
    level = ours.level
    ours.addHandler(said)
    ours.setLevel(logging.INFO)
    try:
        ranks, _ = uneven_hybrid_dflash(19)
        memory = [2**34, 2**34]
        check_context_fits(cfg, [dict(r) for r in ranks], memory)
        assert not [m for m in said.lines if "instead of vLLM's" in m]
        allocation(cfg, ranks, memory)
    finally:
        ours.removeHandler(said)
        ours.setLevel(level)
    assert len([m for m in said.lines if "instead of vLLM's" in m]) == 1, said.lines
