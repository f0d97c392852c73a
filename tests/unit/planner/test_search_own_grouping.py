"""The split search prices every split with the KV grouping that split gets (planner/kv_grouping.py,
planner/kv_grouping.per_rank_grouping): the bundled reference (16 attention + 48 Gated DeltaNet layers) with
the DFlash2 stand-in drafter on the reference pair, fp8 KV, prefix caching, 7 draft tokens, 1,024
batched tokens. Each split's own pricing is what `fit` gives with that split forced."""

from __future__ import annotations

import dataclasses

from test_kv_per_rank_grouping import DRAFTER  # the DFlash2 stand-in drafter's config

from vllm_dualgpu.planner import ModelSpec, PlanError, PlanRequest, fit, fit_stock, parse_gpus, plan, reference_config

GPUS = "RTX 4070 Ti SUPER:16GiB,RTX 5090:32GiB"


def request(**kw) -> PlanRequest:
    return PlanRequest(kv_cache_dtype="fp8", max_num_batched_tokens=1024, kv_grouping="dualgpu",
                       drafter_shares_embedding=True,
                       speculative={"method": "dflash", "num_speculative_tokens": 7, "draft_config": DRAFTER}, **kw)


def forced(model, gpus, req, split, order, **kw):
    return fit(model, gpus, dataclasses.replace(req, layer_partition=list(split), gpu_order=list(order)), **kw).plan


def test_the_fastest_split_that_holds_the_requests_in_its_own_grouping_is_taken():
    """65,536 tokens, 2 sequences: when the search priced every split with the grouping formed
    for 16/48 it took 16/48 (24.7 ms); 15/49, in its own grouping, holds both requests faster."""
    model, gpus = ModelSpec.from_hf_config(reference_config()), parse_gpus(GPUS)
    req = request(max_model_len=65536, max_num_seqs=2)
    p = plan(model, gpus, req)
    assert p.held_requests == 2
    roomy = []
    for n in range(1, model.num_layers):
        try:
            q = forced(model, gpus, req, [n, model.num_layers - n], p.order)
        except PlanError:  # not even one token fits on this split
            continue
        # two requests in the split's own blocks, the null block, and the rule's 3% to spare
        if q.num_blocks >= (2 * q.kv.blocks_per_request(65536) + 1) * 1.03:
            roomy.append(q.predicted_decode_ms)
    assert len(roomy) > 1 and p.predicted_decode_ms <= min(roomy) * 1.005
    # the plan's split is priced as it is alone: its own grouping and pool, and one note says it
    alone = forced(model, gpus, req, p.partition, p.order)
    assert alone.kv.same_grouping(p.kv) and alone.num_blocks == p.num_blocks
    [note] = [n for n in p.notes if "the dualgpu executor groups" in n]
    assert f"into {len(p.kv.groups)} groups" in note


def test_a_grouping_given_for_a_split_prices_that_split_and_no_other():
    """The executor's groupings by vLLM's functions (engine/kv_pricing.reprice): a layout given
    for one GPU order and split prices that split; every other keeps its own grouping."""
    model, gpus = ModelSpec.from_hf_config(reference_config()), parse_gpus(GPUS)
    req = request(max_model_len=262144, max_num_seqs=2)
    order = plan(model, gpus, req).order
    stock = forced(model, gpus, dataclasses.replace(req, kv_grouping="stock"), [16, 48], order)
    assert len(stock.kv.groups) == 15  # stock vLLM cuts every bucket to the drafter's five layers
    given = {(tuple(order), (16, 48)): stock.kv}
    at = forced(model, gpus, req, [16, 48], order, kv_groupings=given)
    assert at.kv is stock.kv and at.num_blocks == stock.num_blocks
    own = forced(model, gpus, req, [16, 48], order)
    assert len(own.kv.groups) < 15 and own.num_blocks != stock.num_blocks
    other = forced(model, gpus, req, [15, 49], order, kv_groupings=given)
    assert other.kv.same_grouping(forced(model, gpus, req, [15, 49], order).kv)


def test_one_stage_keeps_vllms_grouping():
    """With PP = 1 the package's grouping patches stand aside (one rank's specs): vLLM's 15
    groups price the stock run."""
    model = ModelSpec.from_hf_config(reference_config())
    f = fit_stock(model, parse_gpus("H200:141GiB"), request(max_model_len=65536, pp_size=1))
    assert f.plan.passthrough and len(f.plan.kv.groups) == 15
