"""`plan` (the pure mirror) and the executor (vLLM's own, patched KV functions) give the same
split and pool on the headline case: the Qwen3.8-27B-class hybrid reference (48 Gated DeltaNet +
16 attention layers) with a DFlash drafter whose 5 attention layers have their own KV spec, with
the reference launchers' serving flags (fp8 KV, prefix caching, 7 draft tokens, 2 sequences,
1,024 batched tokens). Real VllmConfig on the CPU platform, the engine-side patches applied as
the executor applies them.

Before the mirror priced the package's grouping (planner/kv_grouping.per_rank_grouping) it priced stock
vLLM's 15 groups and `plan` printed a smaller pool and another split than the run.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from vllm_dualgpu.engine import kv_pricing, planning
from vllm_dualgpu.planner import ModelSpec, fit, parse_gpus, reference_config

ROOT = Path(__file__).resolve().parents[3]
DRAFTER = ROOT / "tests" / "fixtures" / "dflash2_drafter_standin.json"
GPUS = "RTX 4070 Ti SUPER:16GiB,RTX 5090:32GiB"


@pytest.fixture(scope="module", autouse=True)
def engine_patches():
    import vllm.platforms
    from vllm.platforms.cpu import CpuPlatform

    vllm.platforms._current_platform = CpuPlatform()
    from vllm_dualgpu import plugin
    from vllm_dualgpu.process import ENGINE

    plugin.ensure(frozenset({ENGINE}))


@pytest.fixture(scope="module")
def headline_config(engine_config, tmp_path_factory):
    d = tmp_path_factory.mktemp("headline")
    cfg = {k: v for k, v in reference_config().items() if k != "_vllm_dualgpu"}
    (d / "target").mkdir()
    (d / "drafter").mkdir()
    (d / "target" / "config.json").write_text(json.dumps(cfg))
    (d / "drafter" / "config.json").write_text(DRAFTER.read_text())
    return engine_config(
        model=str(d / "target"), load_format="dummy", skip_tokenizer_init=True,
        pipeline_parallel_size=2, distributed_executor_backend="dualgpu", max_model_len=262144,
        kv_cache_dtype="fp8", enable_prefix_caching=True, max_num_seqs=2, max_num_batched_tokens=1024,
        mamba_ssm_cache_dtype="float32",  # what a CUDA run resolves "auto" to for Qwen3.5 (the CPU platform would too)
        speculative_config={"method": "dflash", "model": str(d / "drafter"), "num_speculative_tokens": 7})


def test_dflash_on_the_hybrid_plan_and_executor_agree(headline_config, caplog):
    vc = headline_config
    model = ModelSpec.from_hf_config(vc.model_config.hf_config.to_dict(), weight_format="int8")
    request = planning.plan_request(vc, None)
    assert request.kv_grouping == "dualgpu" and request.speculative["num_speculative_tokens"] == 7
    gpus = parse_gpus(GPUS)
    mirror = fit(model, gpus, request).plan  # the plan at 262,144, or at the largest that fits
    caplog.set_level(logging.INFO, logger="vllm.dualgpu")
    logging.getLogger("vllm.dualgpu").propagate = True
    plan, pool = kv_pricing.reprice(vc, mirror,
                                    lambda groupings: fit(model, gpus, request, kv_groupings=groupings).plan)
    # vLLM's patched grouping of this split and memory is the mirror's: nothing is searched again
    assert plan is mirror, (plan.partition, mirror.partition, len(plan.kv.groups), len(mirror.kv.groups))
    assert not any("priced with vLLM's grouping" in r.getMessage() for r in caplog.records)
    assert pool.num_blocks == mirror.num_blocks
    assert list(pool.bytes_per_block) == [r.kv_bytes_per_block for r in mirror.ranks]
    assert pool.num_groups == len(mirror.kv.groups)
    assert pool.max_model_len == min(mirror.kv_max_context_tokens, vc.model_config.max_model_len)
    # vLLM's stock grouping cuts every bucket to the drafter's 5 layers (15 groups); the
    # package's patches group with fewer groups and the pool holds a longer request.
    stock = fit(model, gpus, dataclasses.replace(request, kv_grouping="stock")).plan
    assert len(stock.kv.groups) == 15
    assert len(mirror.kv.groups) < 15
    assert mirror.kv_max_context_tokens > stock.kv_max_context_tokens


def test_the_run_time_planning_gives_the_plans_blocks(headline_config):
    """What EngineCore's (patched) get_kv_cache_configs gives the plan's split and KV memory, and
    the executor's context-fit check agrees."""
    from vllm_dualgpu.engine.context_fit import check_context_fits, per_rank_max_len
    from vllm_dualgpu.engine.vllm_kv import pool_bytes_per_block
    from vllm_dualgpu.patches.kv_cache_utils import kv_cache_configs

    vc = headline_config
    model = ModelSpec.from_hf_config(vc.model_config.hf_config.to_dict(), weight_format="int8")
    plan = fit(model, parse_gpus(GPUS), planning.plan_request(vc, None)).plan
    specs = kv_pricing.rank_specs(kv_pricing.layer_specs(vc, plan.kv), plan.kv, plan.partition)
    memory = [r.kv_budget_bytes for r in plan.ranks]
    mc = vc.model_config
    with kv_pricing._layout_resolved(vc):
        if plan.max_model_len < mc.max_model_len:  # these cards hold less: vLLM says how much
            with pytest.raises(ValueError, match=f"estimated maximum model length is {plan.max_model_len}\\."):
                kv_cache_configs(vc, specs, memory)
        saved = mc.max_model_len
        mc.max_model_len = plan.max_model_len
        try:
            configs = kv_cache_configs(vc, specs, memory)
            # and the executor's context-fit check after profiling passes what the allocation holds
            # (seen on the virtual pair: it priced vLLM's 15 groups and refused the plan's length)
            check_context_fits(vc, specs, memory)
            assert min(per_rank_max_len(vc, specs, memory)) >= plan.max_model_len
        finally:
            mc.max_model_len = saved
        bpb = [pool_bytes_per_block(vc, c.kv_cache_groups) for c in configs]
    assert configs[0].num_blocks == plan.num_blocks
    assert bpb == [r.kv_bytes_per_block for r in plan.ranks]
    assert len(configs[0].kv_cache_groups) == len(plan.kv.groups)


def test_a_split_vllm_groups_otherwise_is_searched_again_with_its_grouping(headline_config, monkeypatch, caplog):
    """Where vLLM's grouping of the plan's split is not the planner's (made so here: vLLM's first
    grouping is formed without the ranks known, so the patches stand aside and stock vLLM's 15
    groups come back), the search runs again with vLLM's grouping for that split and each other
    split's own, and vLLM's functions then price the split chosen as the plan does."""
    from vllm_dualgpu.engine import vllm_kv

    vc = headline_config
    model = ModelSpec.from_hf_config(vc.model_config.hf_config.to_dict(), weight_format="int8")
    request, gpus = planning.plan_request(vc, None), parse_gpus(GPUS)
    mirror = fit(model, gpus, request).plan
    real, asked = vllm_kv.groups_for_ranks, []

    def stock_first(vllm_config, ranks, memory):
        asked.append(memory)
        if len(asked) == 1:
            return vllm_kv.model_kv_cache_groups(vllm_config, [dict(s) for s in ranks])
        return real(vllm_config, ranks, memory)

    monkeypatch.setattr(vllm_kv, "groups_for_ranks", stock_first)
    searched = []

    def search(groupings):
        searched.append(groupings)
        return fit(model, gpus, request, kv_groupings=groupings).plan

    caplog.set_level(logging.INFO, logger="vllm.dualgpu")
    logging.getLogger("vllm.dualgpu").propagate = True
    plan, pool = kv_pricing.reprice(vc, mirror, search)
    [groupings] = searched  # one search again: vLLM groups the split it then chose as the planner did
    [(split, stock)] = groupings.items()
    assert split == (tuple(mirror.order), tuple(mirror.partition)) and len(stock.groups) == 15
    # the split vLLM grouped is priced with that grouping: it holds a shorter request than the
    # planner's own grouping of it
    again = fit(model, gpus, dataclasses.replace(request, layer_partition=mirror.partition, gpu_order=mirror.order),
                kv_groupings=groupings).plan
    assert again.kv is stock and again.kv_max_context_tokens < mirror.kv_max_context_tokens
    assert plan.partition != mirror.partition and len(asked) == 2
    assert pool.num_blocks == plan.num_blocks
    assert list(pool.bytes_per_block) == [r.kv_bytes_per_block for r in plan.ranks]
    assert any("priced with vLLM's grouping" in r.getMessage() for r in caplog.records)


def test_each_split_gets_the_grouping_vllm_gives_it(headline_config):
    """The search prices every split with the package's grouping for that split (the pure
    mirror, planner/kv_grouping.py): on splits whose groupings differ, vLLM's own (patched)
    grouping of the split's layers and KV budgets is the mirror's."""
    from vllm_dualgpu.engine.vllm_kv import groups_for_ranks

    vc = headline_config
    model = ModelSpec.from_hf_config(vc.model_config.hf_config.to_dict(), weight_format="int8")
    request, gpus = planning.plan_request(vc, None), parse_gpus(GPUS)
    seen = set()
    for split in ([4, 60], [8, 56], [12, 52], [21, 43]):
        p = fit(model, gpus, dataclasses.replace(request, layer_partition=split)).plan
        specs = kv_pricing.layer_specs(vc, p.kv)
        with kv_pricing.quiet_grouping(), kv_pricing._layout_resolved(vc):
            groups = groups_for_ranks(vc, kv_pricing.rank_specs(specs, p.kv, split), p.grouping_budgets())
        assert p.kv.regrouped(kv_pricing.priced_groups(vc, groups)).same_grouping(p.kv), split
        seen.add(len(p.kv.groups))
    assert len(seen) > 1  # the splits were grouped differently
