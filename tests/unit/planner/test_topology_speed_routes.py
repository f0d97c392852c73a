"""The TP shard config, the decode speed model and route weights, against hand arithmetic."""

from __future__ import annotations

import pytest

from vllm_dualgpu.planner import BadRequest, ModelSpec, reference_config
from vllm_dualgpu.planner.memory import MemoryModel
from vllm_dualgpu.planner.topology_routes import (
    backend_urls,
    gpustack_route,
    production_stack_command,
    read_measured,
    route_weights,
)
from vllm_dualgpu.planner.topology_shard import shard_config, tp_extra_reserve
from vllm_dualgpu.planner.topology_speed import LinkModel, StageSpeed, hop_ms, step_ms, throughput

TINY = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 256, "intermediate_size": 512,
    "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 1000,
    "max_position_embeddings": 4096, "torch_dtype": "bfloat16", "tie_word_embeddings": False,
}


def test_shard_config_divides_what_vllm_shards():
    s = shard_config(reference_config(), 2)["text_config"]
    assert (s["num_attention_heads"], s["num_key_value_heads"], s["head_dim"]) == (12, 2, 256)
    assert s["intermediate_size"] == 17408 // 2
    assert (s["linear_num_key_heads"], s["linear_num_value_heads"]) == (8, 24)
    assert s["vocab_size"] == 248320 // 2  # already a multiple of 64
    assert s["hidden_size"] == 5120
    eight = shard_config(reference_config(), 8)["text_config"]
    assert eight["num_key_value_heads"] == 1  # 4 KV heads over 8 ranks: replicated
    assert shard_config(TINY, 2)["vocab_size"] == 1024 // 2  # 1000 padded to 1024 first


@pytest.mark.parametrize("tp", [3, 5])
def test_shard_config_refuses_sizes_vllm_refuses(tp):
    with pytest.raises(BadRequest):
        shard_config(reference_config(), tp)  # 4 KV heads: neither divisible by nor dividing 3 or 5


def test_a_shard_holds_half_of_every_matrix_and_whole_norms():
    H, nH, nKV, hd, I = 256, 4, 2, 64, 512
    matrices = (nH * hd * H + 2 * nKV * hd * H + H * nH * hd + 3 * I * H) * 2  # bf16
    norms = (2 * H + 2 * hd) * 2  # input/post norms + q/k norms (Qwen3)
    full = ModelSpec.from_hf_config(TINY)
    half = ModelSpec.from_hf_config(shard_config(TINY, 2))
    assert full.layers[0].weight_bytes == matrices + norms
    assert half.layers[0].weight_bytes == matrices // 2 + norms
    assert half.embed_bytes == 512 * H * 2 and half.lm_head_bytes == 512 * H * 2


def test_tp_extra_reserve_is_the_gathered_sampler_plus_the_group_communicator():
    mm = MemoryModel()
    full = ModelSpec.from_hf_config(TINY)
    half = ModelSpec.from_hf_config(shard_config(TINY, 2))
    assert tp_extra_reserve(full, half, 2, 10, mm) == int(10 * 1000 * 6.0) - int(10 * 512 * 6.0) + 256 * (1 << 20)
    assert tp_extra_reserve(full, full, 1, 10, mm) == 0


LINK = LinkModel()


def test_stage_time_is_reads_over_bandwidth_plus_all_reduces():
    s = StageSpeed(weights_read_bytes=10**9, per_seq_read_bytes=10**8, bandwidth_gbps=1000, tp=1, allreduces=0)
    assert s.ms(1, 1000, LINK) == pytest.approx(1.1)  # 1.1 GB at 1000 GB/s
    assert s.ms(3, 1000, LINK) == pytest.approx(1.3)
    t = StageSpeed(10**9, 10**8, 1000, tp=2, allreduces=10)
    # each all-reduce: 25 us + 2(2-1)/2 x 1 x 1000 x 2 bytes over 12 GB/s
    assert t.ms(1, 1000, LINK) == pytest.approx(1.1 + 10 * (0.025 + 2000 / 12e9 * 1e3))


def test_hops_are_pcie_inside_a_host_and_the_network_between_hosts():
    assert hop_ms(1, 1000, LINK, network=False) == pytest.approx(0.025 + 4000 / 12e9 * 1e3)
    assert hop_ms(1, 1000, LINK, network=True) == pytest.approx(0.1 + 4000 / (10e9 / 8) * 1e3)


def test_pipeline_throughput_keeps_one_micro_batch_per_stage_in_flight():
    a = StageSpeed(10**9, 10**8, 1000, 1, 0)  # 1.0 + 0.1 m ms
    b = StageSpeed(2 * 10**9, 10**8, 1000, 1, 0)  # 2.0 + 0.1 m ms
    hop = hop_ms(2, 1000, LINK, network=False)
    assert step_ms([a, b], [False], 1, 1000, LINK) == pytest.approx(1.1 + 2.1 + hop_ms(1, 1000, LINK, network=False))
    # 4 sequences, 2 micro-batches of 2: cycle = max(1.2 + 2.2 + hop, 2 x 2.2) = 4.4 ms
    assert throughput([a, b], [False], 4, 1000, LINK) == pytest.approx(4 / max(3.4 + hop, 4.4) * 1e3)
    # one sequence: no overlap, the whole pipeline per token
    assert throughput([a, b], [False], 1, 1000, LINK) == pytest.approx(1 / (3.2 + hop_ms(1, 1000, LINK, network=False)) * 1e3)
    assert throughput([a], [], 0, 1000, LINK) == 0.0


def test_link_settings_are_checked():
    assert LinkModel.from_dict({"network_gbits_per_s": 25}).network_gbits_per_s == 25.0
    for bad in ({"wifi": 1}, {"pcie_latency_us": 0}, {"pcie_latency_us": "fast"}):
        with pytest.raises(BadRequest):
            LinkModel.from_dict(bad)


def test_route_weights_from_the_seed_measurements():
    # 244 / 421 = 57.96%, 177 / 421 = 42.04%: floors 57 + 42, the spare point to the larger remainder
    assert route_weights({"box1": 244, "box2": 177}) == {"box1": 58, "box2": 42}


def test_route_weights_sum_to_100_and_never_give_zero():
    assert route_weights({"a": 1, "b": 1, "c": 1}) == {"a": 34, "b": 33, "c": 33}
    assert route_weights({"a": 1000, "b": 1}) == {"a": 99, "b": 1}  # 0.0999% would round to 0
    w = route_weights({"a": 275, "b": 220, "c": 100})
    assert sum(w.values()) == 100 and w == {"a": 46, "b": 37, "c": 17}  # 46.22, 36.97, 16.81
    with pytest.raises(BadRequest):
        route_weights({"a": 1, "b": 0})


def test_measured_file_format():
    assert read_measured({"box1": 244, "box2": 177.5}) == {"box1": 244.0, "box2": 177.5}
    for bad in ([], {}, {"box1": -1}, {"box1": "fast"}, {"box1": True}, {"box1": float("nan")}):
        with pytest.raises(BadRequest):
            read_measured(bad)


def test_router_outputs():
    body = gpustack_route("qwen", {"box1": 58, "box2": 42})
    assert body["name"] == "qwen" and [t["weight"] for t in body["targets"]] == [58, 42]
    assert all(set(t) == {"model_id", "weight"} for t in body["targets"])
    urls = backend_urls([("box1:0", "box1"), ("box1:1", "box1"), ("box2", "box2")])
    assert urls == {"box1:0": "http://box1:8000", "box1:1": "http://box1:8001", "box2": "http://box2:8000"}
    cmd = production_stack_command("qwen", {"a": "http://box1:8000", "b": "http://box2:8000"})
    assert "--static-backends http://box1:8000,http://box2:8000" in cmd and "--static-models qwen,qwen" in cmd
    assert "weight" not in cmd
