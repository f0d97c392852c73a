"""The split search, GPU order, user overrides and every error path.

Most cases use the 4-layer tiny Qwen3 with a zero runtime-memory model, so that each split's
block count can be worked out by hand:

  layer weights 1,180,928 B; embedding = lm_head = 1024 x 256 x 2 = 524,288 B; final norm 512 B;
  one block (16 tokens, bf16) = 16 x 2 heads x (64 + 64) x 2 B = 8,192 B per layer.
"""

from __future__ import annotations

import time

import pytest
from dataclasses import replace

from vllm_dualgpu.planner import (
    BadRequest,
    ContextTooLong,
    GpuFacts,
    MemoryModel,
    ModelDoesNotFit,
    ModelSpec,
    PlanRequest,
    even_partition,
    plan,
    reference_config,
    reference_pair,
    stock_estimate,
)

MIB = 1 << 20
GIB = 1 << 30
LAYER, EMBED, NORM, PAGE = 1_180_928, 524_288, 512, 8_192
ZERO = MemoryModel(
    cuda_context_bytes=0, workspace_bytes=0, cudagraph_bytes=0, activation_element_bytes=0, sampler_bytes_per_logit=0,
    pp_comms_first_bytes=0, pp_comms_last_bytes=0, pp_comms_pcie_bytes=0, cuda_context_nvlink_bytes=0,
    cudagraph_small_bytes=0, flashinfer_workspace_bytes=0, tp_comms_pcie_bytes=0, pp_receive_tensors=0,
)
TINY = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 256, "intermediate_size": 512,
    "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 1024,
    "max_position_embeddings": 4096, "torch_dtype": "bfloat16", "tie_word_embeddings": False,
}


@pytest.fixture
def tiny():
    return ModelSpec.from_hf_config(TINY)


def pair(bw_a=None, bw_b=None, a=4 * MIB, b=8 * MIB):
    """GPU 0 with 4 MiB free, GPU 1 with 8 MiB free."""
    return [GpuFacts(0, "A", 16 * GIB, a, bw_a), GpuFacts(1, "B", 16 * GIB, b, bw_b)]


def req(**kw):
    kw.setdefault("memory", ZERO)
    return PlanRequest(**kw)


# Blocks per split on pair() (rank 0 = A, rank 1 = B):
#   1/3: A  4,194,304 - 524,288 - 1 x 1,180,928 = 2,489,088 // 8,192        = 303
#        B  8,388,608 - 524,800 - 3 x 1,180,928 = 4,321,024 // 24,576       = 175  -> 175
#   2/2: A  1,308,160 // 16,384 = 79;  B 5,501,952 // 16,384 = 335               ->  79
#   3/1: A    127,232 // 24,576 =  5;  B 6,682,880 //  8,192 = 815               ->   5
# Max context = (blocks - 1 null block) x 16: 1/3 -> 2,784; 2/2 -> 1,248; 3/1 -> 64.


def test_hand_computed_best_split(tiny):
    p = plan(tiny, pair(), req(max_model_len=2048))
    assert p.order == [0, 1]  # B has more memory: last
    assert p.partition == [1, 3] and p.partition_env() == "1,3"
    assert [r.blocks for r in p.ranks] == [303, 175]
    assert p.num_blocks == 175
    assert [r.kv_bytes_per_block for r in p.ranks] == [PAGE, 3 * PAGE]
    assert p.kv_max_context_tokens == 174 * 16 == 2784
    assert p.max_context_tokens == 2784 and p.max_model_len == 2048
    r0, r1 = p.ranks
    assert (r0.weights_bytes, r0.fixed_bytes, r0.reserve_bytes) == (LAYER, EMBED, 0)
    assert (r1.weights_bytes, r1.fixed_bytes) == (3 * LAYER, EMBED + NORM)
    # Free after boot: budget - fixed - weights - the shared 175 blocks of this rank's pages.
    assert r0.predicted_free_after_bytes == 4 * MIB - EMBED - LAYER - 175 * PAGE
    assert r1.predicted_free_after_bytes == 8 * MIB - EMBED - NORM - 3 * LAYER - 175 * 3 * PAGE
    assert r0.kv_cache_bytes == 175 * PAGE
    assert p.candidates == 3
    assert "1,3" in p.info_line()


def test_faster_card_gets_more_layers_when_the_context_fits(tiny):
    # At 1,024 tokens both 1/3 and 2/2 hold the context (3/1 does not). A reads 2,000 GB/s and B
    # 500 GB/s; one decode step at 1,024 tokens of context reads each rank's weights + 1,024 x 512 B
    # of KV per layer (+ lm_head and norm on B):
    #   2/2: A (2 x 1,180,928 + 2 x 524,288) / 2e12 + B (2 x 1,180,928 + 2 x 524,288 + 524,800) / 5e11
    #        = 0.001705216 + 0.007870464 = 0.00957568 ms
    #   1/3: A 1,705,216 / 2e12 + B 5,640,448 / 5e11 = 0.000852608 + 0.011280896 = 0.012133504 ms
    # The default objective ("speed") takes the faster 2/2.
    p = plan(tiny, pair(2000, 500), req(max_model_len=1024))
    assert p.objective == "speed" and p.partition == [2, 2] and p.num_blocks == 79
    assert p.predicted_decode_ms == pytest.approx(0.00957568)
    assert [r.predicted_decode_ms for r in p.ranks] == pytest.approx([0.001705216, 0.007870464])
    assert plan(tiny, pair(2000, 500), req(max_model_len=1024, objective="auto")).partition == [2, 2]
    # ... while the pool objective takes the largest pool.
    assert plan(tiny, pair(2000, 500), req(max_model_len=1024, objective="pool")).partition == [1, 3]
    # At 2,048 tokens only 1/3 holds the context, whatever the bandwidths.
    assert plan(tiny, pair(2000, 500), req(max_model_len=2048)).partition == [1, 3]
    # Equal bandwidths: every split reads the same bytes per step, the largest pool wins the tie.
    assert plan(tiny, pair(900, 900), req(max_model_len=1024)).partition == [1, 3]
    # Unknown bandwidths: no prediction, the pool rule (test_objective.py: and a note).
    assert plan(tiny, pair(), req(max_model_len=1024)).partition == [1, 3]


def test_auto_max_model_len_takes_the_largest_that_fits(tiny):
    p = plan(tiny, pair(), req(max_model_len=-1))
    assert p.partition == [1, 3] and p.max_model_len == 2784


def test_context_too_long_reports_the_largest_that_fits(tiny):
    with pytest.raises(ContextTooLong) as e:
        plan(tiny, pair(), req(max_model_len=4096))
    assert e.value.largest_fitting_max_model_len == 2784
    assert e.value.requested == 4096
    assert "the largest that fits is 2,784" in str(e.value) and "--max-model-len 4,096 does not fit" in str(e.value)
    assert "2,784 (layer split 1/3);" in str(e.value)  # the split that reaches it (Fit.plan holds its plan)
    assert plan(tiny, pair(), req(max_model_len=2784)).max_context_tokens == 2784
    with pytest.raises(ContextTooLong):
        plan(tiny, pair(), req(max_model_len=2785))
    with pytest.raises(BadRequest, match="larger than the model's maximum"):
        plan(tiny, pair(), req(max_model_len=5000))


def test_model_does_not_fit_names_the_short_rank(tiny):
    # 1 MiB + 2 MiB. Each rank needs fixed + weights + 2 blocks (one 1-token request + the null block);
    # shortfalls (rank 0, rank 1):
    #   1/3: 524,288 + 1,180,928 + 16,384 - 1,048,576 = 673,024;   524,800 + 3,542,784 + 49,152 - 2,097,152 = 2,019,584
    #   2/2: 524,288 + 2,361,856 + 32,768 - 1,048,576 = 1,870,336; 524,800 + 2,361,856 + 32,768 - 2,097,152 =   822,272
    #   3/1: 3,067,648;                                            -375,040
    # The closest split is 2/2 (its worst rank is short by the least); rank 0 is short by 1,870,336 B.
    with pytest.raises(ModelDoesNotFit) as e:
        plan(tiny, pair(a=1 * MIB, b=2 * MIB), req(max_model_len=16))
    err = e.value
    assert (err.rank, err.gpu_name, err.short_bytes, err.partition) == (0, "A", 1_870_336, [2, 2])
    assert err.shortfalls == [(0, "A", 1_870_336), (1, "B", 822_272)]
    assert "rank 0 (A) is short by 1.78 MiB (and rank 1 (B) by 0.78 MiB)" in str(err)
    # With exactly those bytes more on each card, 2/2 fits.
    p = plan(tiny, pair(a=1 * MIB + 1_870_336, b=2 * MIB + 822_272), req(max_model_len=16))
    assert p.partition == [2, 2] and p.num_blocks == 2


def test_user_overrides_win(tiny):
    p = plan(tiny, pair(), req(max_model_len=64, layer_partition=[3, 1]))
    assert p.partition == [3, 1] and p.num_blocks == 5 and p.overrides == {"layer_partition": "3,1"}
    p = plan(tiny, pair(), req(max_model_len=64, gpu_order=[1, 0]))
    assert p.order == [1, 0]  # B first although it is the larger card
    assert p.overrides["gpu_order"] == "1,0"
    # Blocks forced on every rank; the split must still fit them: 200 blocks x 8,192 B fit A's
    # 2,489,088 B with 1/3, but B would need 200 x 24,576 = 4,915,200 > 4,321,024; 2/2 needs
    # 200 x 16,384 = 3,276,800 > A's 1,308,160. Only 100 blocks fit (1/3).
    p = plan(tiny, pair(), req(max_model_len=64, num_gpu_blocks_override=100))
    assert p.num_blocks == 100 and p.partition == [1, 3] and p.ranks[1].kv_cache_bytes == 100 * 3 * PAGE
    with pytest.raises(ModelDoesNotFit, match="num-gpu-blocks-override 200"):
        plan(tiny, pair(), req(max_model_len=64, num_gpu_blocks_override=200))
    # The same KV bytes on every rank (1 MiB): 1/3 -> min(128, 42) = 42 blocks; 2/2 -> 64 on both;
    # 3/1 does not fit (A has 127,232 B for KV). The override changes the best split to 2/2.
    p = plan(tiny, pair(), req(max_model_len=64, kv_cache_memory_bytes=1 * MIB))
    assert p.partition == [2, 2] and p.num_blocks == 64
    assert p.overrides["kv_cache_memory_bytes"] == MIB


def test_bad_requests(tiny):
    for kw, msg in [
        (dict(layer_partition=[2, 1]), "sums to 3"),
        (dict(layer_partition=[4]), "1 entries for 2 ranks"),
        (dict(layer_partition=[4, 0]), "at least one layer"),
        (dict(gpu_order=[0, 0]), "2 different GPUs"),
        (dict(gpu_order=[0, 7]), "not among"),
        (dict(pp_size=3), "needs 3 GPUs"),
        (dict(objective="fast"), "objective"),
        (dict(num_gpu_blocks_override=1), "below the minimum of 2"),
    ]:
        with pytest.raises(BadRequest, match=msg):
            plan(tiny, pair(), req(max_model_len=64, **kw))
    with pytest.raises(BadRequest, match="no GPUs"):
        plan(tiny, [], req())


def test_one_gpu_or_pp1_behaves_like_stock(tiny):
    for gpus, kw in [(pair()[:1], {}), (pair(), {"pp_size": 1})]:
        # Even a model that does not fit raises nothing: vLLM runs (and reports) as stock.
        p = plan(tiny, [GpuFacts(g.index, g.name, g.total_bytes, 1 * MIB) for g in gpus], req(**kw))
        assert p.passthrough and p.partition_env() is None
        assert p.order == [0] and p.partition == [4]
        assert "vLLM runs as stock" in p.info_line()


def test_gpu_order_largest_last_and_three_ranks(tiny):
    # Three cards: 3 MiB (index 0), 6 MiB (index 1), 3 MiB (index 2). The 6 MiB card goes last.
    # Splits (rank 0 pays the embedding, the last rank lm_head + norm, the middle neither):
    #   1/1/2: 3,145,728 - 524,288 - 1,180,928 = 1,440,512 // 8,192 = 175;  middle 1,964,800 // 8,192 = 239;
    #          last 6,291,456 - 524,800 - 2,361,856 = 3,404,800 // 16,384 = 207  -> 175
    #   1/2/1: middle 783,872 // 16,384 = 47 -> 47;   2/1/1: rank 0 259,584 // 16,384 = 15 -> 15
    gpus = [GpuFacts(0, "A", 8 * GIB, 3 * MIB), GpuFacts(1, "B", 8 * GIB, 6 * MIB), GpuFacts(2, "C", 8 * GIB, 3 * MIB)]
    p = plan(tiny, gpus, req(pp_size=3, max_model_len=64))
    assert p.order[-1] == 1 and sorted(p.order) == [0, 1, 2]
    assert p.partition == [1, 1, 2] and p.num_blocks == 175 and p.partition_env() == "1,1,2"
    assert [r.blocks for r in p.ranks] == [175, 239, 207]
    # Two GPUs for four cards... and more GPUs than ranks: the ones with the most free memory.
    p = plan(tiny, gpus + [GpuFacts(3, "D", 8 * GIB, 1 * MIB)], req(pp_size=3, max_model_len=64))
    assert 3 not in p.order and any("planning on the 3" in n for n in p.notes)
    # Identical cards keep CUDA order.
    same = [GpuFacts(0, "H200", 141 * GIB, 100 * GIB), GpuFacts(1, "H200", 141 * GIB, 100 * GIB)]
    assert plan(tiny, same, req(max_model_len=64)).order == [0, 1]
    # The reference pair: RTX 5090 is CUDA 0, the 4070 Ti SUPER CUDA 1 -> order 1,0.
    p = plan(ModelSpec.from_hf_config(reference_config()), reference_pair(), PlanRequest(kv_cache_dtype="fp8"))
    assert p.order == [1, 0]
    assert p.ranks[0].fixed_detail.keys() >= {"embedding", "vision", "cuda_context"}
    assert p.ranks[1].fixed_detail.keys() >= {"lm_head", "cuda_context"}


def test_even_partition_is_vllms():
    # get_pp_indices: remainder goes to the ranks before the last
    assert even_partition(40, 2) == [20, 20]
    assert even_partition(61, 2) == [31, 30]
    assert even_partition(10, 3) == [3, 4, 3]
    assert even_partition(11, 4) == [3, 3, 3, 2]


# Measured 2026-11-30 (docs/benchmarks.md, "KV pool"): two H200s (NVML total 143,771 MiB) with
# ballast leaving 16 GiB and 32 GiB free, 14B-class dense Qwen3, block-FP8 weights (dummy), bf16
# KV, eager, LLM() defaults there: 16,384 batched tokens, 1,024 sequences, block size 16, 1 GiB
# reserve, the pipeline's NCCL communicators created before profiling (0.79 / 1.04 GiB measured).
H200_TOTAL = 143771 * (1 << 20)
MEASURED_STOCK_U010 = 37_376  # tokens; stock fails at 0.90 and 0.11 (first session's run)
MEASURED_PLUGIN = {  # layers on the 16 GiB card -> KV pool tokens
    8: 112_000,
    10: 124_896,
    11: 127_600,  # the plugin's own choice, no flags
    12: 110_176,
    20: 33_520,
}
# What vLLM's profile left for the first rank's KV cache ("Available KV cache memory", GiB).
MEASURED_RANK0_KV_GIB = {8: 6.29, 10: 5.67, 11: 5.35, 12: 5.04, 20: 2.56}


def test_reference_point_14b_on_ballasted_h200s():
    """Planner vs the GPU measurement: every split's pool within 3%, the first rank's KV budget
    within 256 MiB, and the plan's own choice the best measured split. The activation and sampler
    constants were fitted to the first session's runs and the NCCL term measured directly, so
    these later runs check the model rather than being fitted by it."""
    model = ModelSpec.from_hf_config(reference_config("qwen3-14b"))
    r = PlanRequest(max_model_len=32768, max_num_seqs=1024, max_num_batched_tokens=16384,
                    enforce_eager=True, block_size=16)

    def gpus(reserve):
        return [GpuFacts(0, "NVIDIA H200", H200_TOTAL, 16 * GIB, reserve_bytes=reserve, nvlink=True),
                GpuFacts(1, "NVIDIA H200", H200_TOTAL, 32 * GIB, reserve_bytes=reserve, nvlink=True)]

    for util, boots in ((0.9, False), (0.11, False), (0.10, True)):
        assert stock_estimate(model, gpus(0), r, util).boots is boots, util
    stock = stock_estimate(model, gpus(0), r, 0.10)
    assert stock.partition == [20, 20]
    assert abs(stock.pool_tokens - MEASURED_STOCK_U010) <= 0.15 * MEASURED_STOCK_U010

    for small, measured in MEASURED_PLUGIN.items():
        p = plan(model, gpus(GIB), replace(r, layer_partition=[small, 40 - small]))
        assert abs(p.pool_tokens - measured) <= 0.03 * measured, (small, p.pool_tokens, measured)
        kv0 = MEASURED_RANK0_KV_GIB[small] * GIB
        assert abs(p.ranks[0].kv_budget_bytes - kv0) <= 256 * MIB + 0.005 * GIB, small  # log rounds to 0.01

    chosen = plan(model, gpus(GIB), r)
    assert chosen.order == [0, 1]  # the 16 GiB card first, the output head on the 32 GiB card
    assert chosen.partition == [11, 29] and max(MEASURED_PLUGIN, key=MEASURED_PLUGIN.get) == 11
    assert MEASURED_PLUGIN[11] >= 3 * MEASURED_STOCK_U010
    # The NCCL term follows the link: the measured NVLink figures here, the PCIe estimate when a
    # card has no NVLink (or NVML cannot say).
    pcie = plan(model, [replace(g, nvlink=None) for g in gpus(GIB)], replace(r, layer_partition=[11, 29]))
    nvl = plan(model, gpus(GIB), replace(r, layer_partition=[11, 29]))
    assert nvl.ranks[0].reserve_detail["pp_comms"] == r.memory.pp_comms_first_bytes
    assert nvl.ranks[1].reserve_detail["pp_comms"] == r.memory.pp_comms_last_bytes
    assert [x.reserve_detail["pp_comms"] for x in pcie.ranks] == [r.memory.pp_comms_pcie_bytes] * 2
    assert pcie.pool_tokens > nvl.pool_tokens


def test_reference_27b_pair_reaches_full_context():
    model = ModelSpec.from_hf_config(reference_config())
    p = plan(model, reference_pair(), PlanRequest(kv_cache_dtype="fp8"))
    assert p.max_model_len == 262144 and p.kv_max_context_tokens >= 262144
    assert p.block_size == 1568
    small, big = p.ranks
    assert small.gpu.name == "RTX 4070 Ti SUPER" and len(big.layers) > len(small.layers)
    assert big.predicted_free_after_bytes >= big.gpu.reserve_bytes  # the desktop's 1 GiB stays free
    assert small.predicted_free_after_bytes >= 0
    # Speculative decoding with MTP: the drafter and its embedding copy sit on the last rank.
    mtp = plan(model, reference_pair(), PlanRequest(kv_cache_dtype="fp8", max_model_len=131072,
                                                   speculative={"method": "mtp", "num_speculative_tokens": 3}))
    assert mtp.block_size == 1600
    assert {"drafter", "drafter_embedding"} <= mtp.ranks[1].fixed_detail.keys()
    assert "drafter" not in mtp.ranks[0].fixed_detail


def test_search_is_fast_for_128_layers_and_3_ranks():
    cfg = dict(TINY, num_hidden_layers=128, max_position_embeddings=32768)
    model = ModelSpec.from_hf_config(cfg)
    gpus = [GpuFacts(i, n, 8 * GIB, f * MIB, bw) for i, (n, f, bw) in enumerate([("A", 96, 500), ("B", 80, 900), ("C", 200, 1800)])]
    t = time.perf_counter()
    p = plan(model, gpus, req(pp_size=3, max_model_len=1024))
    assert time.perf_counter() - t < 5
    assert p.candidates == 2 * 126 * 127 // 2  # C(127, 2) compositions x 2 orders of the first two
    assert sum(p.partition) == 128 and p.order[-1] == 2


def test_to_json_and_table(tiny):
    import json

    p = plan(tiny, pair(2000, 500), req(max_model_len=1024))
    d = json.loads(p.to_json())
    assert d["partition"] == [2, 2] and d["partition_env"] == "2,2" and d["num_blocks"] == 79
    assert d["ranks"][1]["kv_bytes_per_block"] == 2 * PAGE
    assert d["ranks"][0]["gpu"]["index"] == 0
    t = p.table()
    assert "rank 0" in t and "rank 1" in t and "2,2" in t and "79 blocks" in t
