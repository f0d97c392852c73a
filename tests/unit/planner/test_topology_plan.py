"""Planning topologies: each replica is the existing planner's plan, TP groups as equal shards."""

from __future__ import annotations

from dataclasses import replace

import pytest

from vllm_dualgpu.planner import BadRequest, ModelSpec, PlanRequest, plan, reference_config
from vllm_dualgpu.planner.gpus import GIB, GpuFacts
from vllm_dualgpu.planner.memory import MemoryModel
from vllm_dualgpu.planner.topology import Fleet, Host, parse_fleet, plan_fleet, recommend
from vllm_dualgpu.planner.topology_routes import fleet_routes
from vllm_dualgpu.planner.topology_shard import shard_config, tp_extra_reserve
from vllm_dualgpu.planner.topology_speed import LinkModel, hop_ms

TINY = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 256, "intermediate_size": 512,
    "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 1024,
    "max_position_embeddings": 4096, "torch_dtype": "bfloat16", "tie_word_embeddings": False,
}
REQ = PlanRequest(max_model_len=4096, max_num_seqs=16)


def by_id(fp):
    return {t.id: t for t in fp.topologies}


def test_a_single_card_replica_is_the_planners_stock_plan_and_speed():
    fp = plan_fleet(TINY, parse_fleet("h=A:4GiB:bw=100"), REQ)
    r = by_id(fp)["host-tp1"].replicas[0]
    ref = plan(ModelSpec.from_hf_config(TINY), [GpuFacts(0, "A", 4 * GIB, 4 * GIB, 100.0)], replace(REQ, pp_size=1))
    assert r.fits and r.plan.num_blocks == ref.num_blocks and r.plan.max_model_len == 4096
    assert r.decode_ms == pytest.approx(ref.predicted_decode_ms)  # one card: nothing but its reads
    # the batch: whole requests of 4,096 tokens the pool holds (one block is the null block)
    per = ref.kv.blocks_per_request(4096)
    assert r.batch == min(16, (ref.num_blocks - 1) // per)


def test_a_pipeline_on_one_host_adds_one_pcie_send_per_stage_boundary():
    fp = plan_fleet(TINY, parse_fleet("h=A:4GiB:bw=100,B:6GiB:bw=200"), REQ, tp_sizes=[1])
    r = by_id(fp)["host-tp1"].replicas[0]
    assert r.fits and len(r.plan.partition) == 2 and r.network_hops == 0
    assert r.decode_ms == pytest.approx(r.plan.predicted_decode_ms + hop_ms(1, 256, LinkModel(), network=False))
    assert r.serve_today() == (True, "vllm serve MODEL --pipeline-parallel-size 2 --distributed-executor-backend dualgpu "
                                     "--max-model-len 4096")  # the request's length, planned


def test_a_tp_group_is_planned_as_equal_shards_at_the_smaller_cards_memory():
    fleet = parse_fleet("h=A:4GiB:bw=100,A:4GiB:free=3GiB:bw=80")
    fp = plan_fleet(TINY, fleet, REQ, tp_sizes=[2])
    r = by_id(fp)["host-tp2"].replicas[0]
    assert r.fits and r.tp == 2 and len(r.plan.ranks) == 1
    full, half = ModelSpec.from_hf_config(TINY), ModelSpec.from_hf_config(shard_config(TINY, 2))
    # vLLM's default batch on a 4 GiB card: 2,048 tokens (planner.memory.default_batch_limits)
    extra = tp_extra_reserve(full, half, 2, 16, MemoryModel(), max_num_batched_tokens=2048)
    card = r.plan.ranks[0].gpu
    assert (card.free_bytes, card.reserve_bytes, card.bandwidth_gbps) == (3 * GIB, extra, 80.0)
    ref = plan(half, [GpuFacts(0, "A", 4 * GIB, 3 * GIB, 80.0, reserve_bytes=extra)], replace(REQ, pp_size=1))
    assert r.plan.num_blocks == ref.num_blocks
    assert any("smaller card" in n for n in r.notes)
    assert r.serve_today() == (True, "stock vLLM: vllm serve MODEL --tensor-parallel-size 2 --max-model-len 4096")


def test_a_fleet_with_nothing_that_fits_says_so():
    fp = plan_fleet(TINY, parse_fleet("a=A:1GiB:bw=100;b=A:1GiB:bw=100"), REQ)  # less than a CUDA context
    assert fp.recommended is None and not fp.fitting
    assert all(not r.fits and r.reason.startswith("the model does not fit") for t in fp.topologies for r in t.replicas)
    assert fp.what_fits().startswith("no topology fits even one request")


def test_a_context_that_does_not_fit_reports_the_largest_that_does():
    # 32 blocks of 16 tokens, one of them the null block: 31 x 16 = 496 tokens
    fp = plan_fleet(TINY, parse_fleet("h=A:4GiB:bw=100"), replace(REQ, num_gpu_blocks_override=32))
    r = by_id(fp)["host-tp1"].replicas[0]
    assert not r.fits and r.largest_fitting_max_model_len == 496
    assert "496" in fp.what_fits() and "host-tp1" in fp.what_fits()


def test_a_replica_that_does_not_fit_leaves_its_cards_idle_and_the_others_serve():
    fp = plan_fleet(TINY, parse_fleet("big=A:4GiB:bw=100;small=A:1GiB:bw=100"), REQ, tp_sizes=[1])
    t = by_id(fp)["host-tp1"]
    assert t.fits and [r.name for r in t.fitting] == ["big"]
    assert [(c.label, "does not fit" in why) for c, why in t.idle] == [("small:0 A", True)]
    assert t.tokens_per_s == pytest.approx(t.fitting[0].tokens_per_s)


def test_mixed_tp_group_on_a_mixed_box_is_refused_and_pipeline_is_recommended():
    fp = plan_fleet(TINY, parse_fleet("box=A:8GiB:bw=200,B:4GiB:bw=100"), REQ)
    t = by_id(fp)
    assert not t["host-tp2"].fits and t["host-tp2"].replicas[0].reason.startswith("mixed TP group")
    assert fp.recommended is not None and fp.recommended.layout.tp == 1


def test_recommendation_preferences_and_bad_values():
    fp = plan_fleet(TINY, parse_fleet("a=A:4GiB:bw=100,A:4GiB:bw=100;b=B:4GiB:bw=300"), REQ)
    fit = fp.fitting
    best, why = recommend(fp.topologies, "throughput")
    assert best.tokens_per_s >= max(t.tokens_per_s for t in fit) * 0.97 and best.id in why
    fast, why = recommend(fp.topologies, "latency")
    assert fast.decode_ms <= min(t.decode_ms for t in fit) / 0.97 and "ms per step" in why
    with pytest.raises(BadRequest):
        recommend(fp.topologies, "cheapest")
    with pytest.raises(BadRequest):
        plan_fleet(TINY, parse_fleet("a=A:4GiB"), REQ, prefer="cheapest")


@pytest.fixture(scope="module")
def seed():
    """The seed-002 box: two hosts of two 16 GB cards; the reference model with NVFP4 weights at
    that setup's settings (8 sequences, 8,192 batched tokens, 16-bit KV), context auto."""
    fleet = parse_fleet("box1=RTX 5080,RTX 5080;box2=RTX 4070 Ti SUPER,RTX 4070 Ti SUPER")
    fleet = Fleet(tuple(Host(h.name, tuple(replace(g, reserve_bytes=GIB) for g in h.gpus)) for h in fleet.hosts))
    req = PlanRequest(max_model_len=-1, max_num_seqs=8, max_num_batched_tokens=8192, decode_context_tokens=16384)
    return plan_fleet(reference_config(), fleet, req, weight_format="nvfp4")


def test_seed_fleet_topologies(seed):
    t = by_id(seed)
    assert list(t) == ["host-tp1", "group-tp1", "fleet-tp1", "host-tp2", "fleet-tp2"]
    # one 16 GB card cannot hold the embedding (248,320 x 5,120 x 2 bytes = 2.37 GiB), the head and
    # ~13 GiB of 4-bit layers besides its CUDA context and the 1 GiB left free
    assert not t["group-tp1"].fits
    assert all(r.reason.startswith("the model does not fit") for r in t["group-tp1"].replicas)
    for tid in ("host-tp1", "fleet-tp1", "host-tp2", "fleet-tp2"):
        assert t[tid].fits and t[tid].idle == []
    # each host's TP-2 replica uses that host's two cards as one stage
    for r in t["host-tp2"].replicas:
        assert [{c.host for c in s} for s in r.stage_of_rank] == [{r.name}]
    # across hosts, each host's stages stay together: exactly one network crossing
    assert t["fleet-tp1"].replicas[0].network_hops == 1 and t["fleet-tp2"].replicas[0].network_hops == 1
    assert [t[i].runs_today for i in ("host-tp1", "fleet-tp1", "host-tp2", "fleet-tp2")] == [True, False, True, False]
    # the aggregate is the sum of the replicas
    assert t["host-tp2"].tokens_per_s == pytest.approx(sum(r.tokens_per_s for r in t["host-tp2"].replicas))
    # a TP-2 pair reads half the weights per card: its single stream beats the same pair as PP2
    for a, b in zip(t["host-tp2"].replicas, t["host-tp1"].replicas):
        assert a.decode_ms < b.decode_ms
    assert seed.recommended is not None and seed.recommended.id in seed.reason


def test_seed_route_weights_predicted_and_measured(seed):
    routes = fleet_routes(seed, "qwen3.8-27b")
    assert set(routes) == {"host-tp1", "host-tp2"}  # the topologies with two replicas that fit
    rs = by_id(seed)["host-tp2"].replicas
    w = routes["host-tp2"]["weights"]
    total = sum(r.tokens_per_s for r in rs)
    for r in rs:
        assert abs(w[r.name] - 100 * r.tokens_per_s / total) < 1  # proportional, rounded
    measured = fleet_routes(seed, "qwen3.8-27b", {"box1": 244, "box2": 177}, "host-tp2")
    assert measured["host-tp2"]["source"] == "measured" and measured["host-tp2"]["weights"] == {"box1": 58, "box2": 42}
    body = measured["host-tp2"]["gpustack"]["body"]
    assert [t["weight"] for t in body["targets"]] == [58, 42]
    with pytest.raises(BadRequest):
        fleet_routes(seed, "m", {"box1": 244, "box3": 1})  # matches no topology's replicas
    with pytest.raises(BadRequest):
        fleet_routes(seed, "m", {"box1": 244, "box2": 177}, "fleet-tp2")  # one replica: no weights
    with pytest.raises(BadRequest):
        fleet_routes(seed, "m", None, "no-such-topology")
