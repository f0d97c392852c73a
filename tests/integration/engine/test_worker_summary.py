"""The worker's one summary line per rank (GPU, layers, weights, KV, blocks, context, memory)."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from vllm_dualgpu import envs
from vllm_dualgpu import rank_summary
from vllm_dualgpu.engine import handoff
from vllm_dualgpu.engine import worker as w

GiB = 1024**3


@pytest.fixture
def fake_rank(monkeypatch):
    import torch

    rank_summary.clear()
    # An exported split that is not the plan's must not be what the summary reports.
    monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", "20,20")
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d: (int(1.5 * GiB), 140 * GiB))
    r = object.__new__(w.DualGpuWorker)
    r.rank, r.device = 1, "cuda:1"
    r.cache_config = SimpleNamespace(num_gpu_blocks=9261, block_size=16)
    r.model_config = SimpleNamespace(max_model_len=32768)
    r.model_runner = SimpleNamespace(model_memory_usage=int(10.52 * GiB))
    r._dualgpu_kv_bytes = 9261 * 29 * 65536
    r._pp_position = lambda: (1, 2)
    r._dualgpu_plan = handoff.Handoff(
        ranks=(handoff.RankRecord(0, 1, "NVIDIA H200", GiB, None, 11, 5 * GiB),
               handoff.RankRecord(1, 0, "NVIDIA H200", GiB, None, 29, 14 * GiB)),
        partition=(11, 29), partition_source="plan")
    r._dualgpu_rank = r._dualgpu_plan.ranks[1]
    yield r
    rank_summary.clear()


def test_summary_line_has_every_field(fake_rank, caplog, monkeypatch):
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # the executor's, inherited
    caplog.set_level(logging.INFO, logger="vllm.dualgpu")
    logging.getLogger("vllm.dualgpu").propagate = True
    rank_summary.note("GPU", "NVIDIA H200 (cuda:1)")
    fake_rank._log_summary()
    lines = [r.getMessage() for r in caplog.records if "vllm-dualgpu rank" in r.getMessage()]
    assert len(lines) == 1
    line = lines[0]
    assert line.startswith("vllm-dualgpu rank 1/2: GPU: NVIDIA H200 (cuda:1)")
    assert "allocator: PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True; " in line
    assert "layers: 29 of 11/29" in line
    assert "weights: 10.52 GiB" in line
    assert "9261 blocks x 16 tokens" in line
    # 9,261 x 16 = 148,176 tokens of pool, capped at --max-model-len for one request.
    assert "max context: 32,768 tokens (pool 148,176)" in line
    assert line.endswith("free after: 1.50 GiB")


def test_summary_says_torchs_default_allocator(fake_rank, caplog, monkeypatch):
    for var in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"):
        monkeypatch.delenv(var, raising=False)
    caplog.set_level(logging.INFO, logger="vllm.dualgpu")
    logging.getLogger("vllm.dualgpu").propagate = True
    fake_rank._log_summary()
    line = next(r.getMessage() for r in caplog.records if "vllm-dualgpu rank" in r.getMessage())
    assert "allocator: torch's default (no PYTORCH_CUDA_ALLOC_CONF or PYTORCH_ALLOC_CONF)" in line


def test_kv_bytes_count_the_one_backing_allocation_once():
    """Found on the GPUs: a hybrid rank's three overlaid group tensors were added up, and its
    summary said "KV: 58.36 GiB" beside "free after: 117.63 GiB" with a 21.06 GiB budget."""
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheTensor

    size = 35415 * 589824
    tensors = [KVCacheTensor(size=size, layers=[f"model.layers.{i}.x"], layer_stride=0, block_stride=589824)
               for i in (0, 1, 3)]
    config = KVCacheConfig(num_blocks=35415, kv_cache_tensors=tensors, kv_cache_groups=[])
    assert w.kv_backing_bytes(config) == size
    assert w.kv_backing_bytes(KVCacheConfig(num_blocks=0, kv_cache_tensors=[], kv_cache_groups=[])) == 0


def test_profile_is_compared_with_the_plan():
    # Measured on two H200s (docs/benchmarks.md, split 10/30, rank 0): budget 13.57 GiB, vLLM
    # left 5.67 GiB for KV; a plan that predicted 5.69 GiB of KV (7.88 GiB besides) is 20 MiB off.
    line = w.profiled_vs_predicted(int(13.57 * GiB), int(5.67 * GiB), int(13.57 * GiB) - int(5.69 * GiB))
    assert line == "7.90 GiB measured by vLLM, predicted 7.88 GiB (+20 MiB, +0.3%)"
    assert w.profiled_vs_predicted(10 * GiB, 4 * GiB, None) == "6.00 GiB (no plan to compare)"


def test_rank_budget_respects_reserve_and_cap():
    assert w.rank_budget(14 * GiB, GiB, None) == 13 * GiB
    assert w.rank_budget(14 * GiB, GiB, 8 * GiB) == 8 * GiB


def test_an_even_split_is_reported_as_such(fake_rank, caplog):
    caplog.set_level(logging.INFO, logger="vllm.dualgpu")
    logging.getLogger("vllm.dualgpu").propagate = True
    fake_rank._dualgpu_plan = handoff.Handoff(fake_rank._dualgpu_plan.ranks, (20, 20), "even")
    fake_rank._log_summary()
    (line,) = [r.getMessage() for r in caplog.records if "vllm-dualgpu rank" in r.getMessage()]
    assert "layers: even split" in line


def test_the_worker_reads_its_record_from_the_config_it_received():
    """The record travels in additional_config (pickled to spawned workers) and reads back typed."""
    import pickle

    from vllm.config import VllmConfig

    plan = handoff.Handoff((handoff.RankRecord(0, 3, "RTX 4070 Ti SUPER", GiB, 12 * GiB, 13, 7 * GiB),
                            handoff.RankRecord(1, 1, "RTX 5090", 0, None, 51, 20 * GiB)), (13, 51), "plan")
    cfg = VllmConfig()
    handoff.update_settings(cfg, gpu_memory_utilization=0.8)
    handoff.store(cfg, plan)
    received = pickle.loads(pickle.dumps(cfg))
    assert handoff.load(received) == plan
    assert handoff.load(received).rank(1).physical_gpu_id == 1 and handoff.load(received).rank(2) is None
    assert handoff.frontend_settings(received)["gpu_memory_utilization"] == 0.8
    assert handoff.load(VllmConfig()) is None


def test_the_record_keeps_the_compile_cache_key_stable():
    """vLLM hashes additional_config into its compile-cache key: two boots of one command on the
    same cards give the same record even when free memory moved (the record holds no free memory
    or KV budget)."""
    from vllm.config import VllmConfig

    def boot(free):
        from vllm_dualgpu.engine import planning
        from vllm_dualgpu.nvml import VisibleGpu
        from vllm_dualgpu.planner import ModelSpec, PlanRequest, plan

        gpus = [VisibleGpu(0, "NVIDIA H200", 140 * GiB, free[0], (9, 0), 4800.0, "a"),
                VisibleGpu(1, "NVIDIA H200", 140 * GiB, free[1], (9, 0), 4800.0, "b")]
        from vllm_dualgpu.nvml import to_gpu_facts

        model = ModelSpec.from_hf_config({
            "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 2048,
            "intermediate_size": 6144, "num_hidden_layers": 28, "num_attention_heads": 16,
            "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936,
            "max_position_embeddings": 40960, "torch_dtype": "bfloat16"})
        result = plan(model, to_gpu_facts(gpus, [GiB, GiB]), PlanRequest(max_model_len=8192, layer_partition=[12, 16]))
        cfg = VllmConfig()
        handoff.store(cfg, planning._handoff(result, [gpus[i] for i in result.order], [12, 16]))
        return config_hash(cfg), result

    (h1, r1), (h2, r2) = boot((30 * GiB, 16 * GiB)), boot((29 * GiB, 15 * GiB))
    assert r1.ranks[0].kv_budget_bytes != r2.ranks[0].kv_budget_bytes
    assert h1 == h2


class _FakeDist:
    """Records the pipeline warm-up's calls; broadcast can fail like NCCL under NCCL_ALGO."""

    def __init__(self, broadcast_error=None):
        self.calls, self.broadcast_error = [], broadcast_error

    def isend(self, t, dst, group):
        self.calls.append(("isend", dst, group))
        return SimpleNamespace(wait=lambda: None)

    def irecv(self, t, src, group):
        self.calls.append(("irecv", src, group))
        return SimpleNamespace(wait=lambda: None)

    def broadcast(self, t, src, group):
        self.calls.append(("broadcast", src, group))
        if self.broadcast_error:
            raise self.broadcast_error


def _warm(monkeypatch, rank_in_group, dist, free=(10 * GiB, int(9.2 * GiB))):
    import torch
    import torch.distributed
    import vllm.distributed.parallel_state as ps

    group = SimpleNamespace(world_size=2, rank_in_group=rank_in_group, ranks=[4, 5], last_rank=5,
                            device_group="pp-dev")
    monkeypatch.setattr(ps, "get_pp_group", lambda: group)
    for name in ("isend", "irecv", "broadcast"):
        monkeypatch.setattr(torch.distributed, name, getattr(dist, name))
    frees = iter(free)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d: (next(frees), 140 * GiB))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda d=None: None)
    monkeypatch.setattr(torch, "zeros", lambda *a, **k: "zeros")
    monkeypatch.setattr(torch, "empty_like", lambda t: "empty")
    r = object.__new__(w.DualGpuWorker)
    r.rank, r.device = rank_in_group, "cpu"
    r.model_runner = SimpleNamespace(pp_handler=SimpleNamespace(broadcast_group="pp-bcast"))
    rank_summary.clear()
    r._warm_pp_communicators()
    return rank_summary.facts()


def test_pipeline_communicators_are_created_before_profiling(monkeypatch):
    # First stage sends to the next, last stage receives; both join the sampled-token broadcast
    # from the last rank. The memory this took is reported.
    d0 = _FakeDist()
    facts = _warm(monkeypatch, 0, d0)
    assert d0.calls == [("isend", 5, "pp-dev"), ("broadcast", 5, "pp-bcast")]
    assert facts["pp comms"].startswith("0.80 GiB")
    d1 = _FakeDist()
    _warm(monkeypatch, 1, d1)
    assert d1.calls == [("irecv", 4, "pp-dev"), ("broadcast", 5, "pp-bcast")]


def test_a_failing_broadcast_warm_up_is_a_warning_not_a_crash(monkeypatch, caplog):
    caplog.set_level(logging.WARNING, logger="vllm.dualgpu")
    logging.getLogger("vllm.dualgpu").propagate = True
    monkeypatch.setenv("NCCL_ALGO", "allreduce:tree")
    _warm(monkeypatch, 1, _FakeDist(RuntimeError("ncclInvalidUsage: no algorithm for Broadcast")))
    (msg,) = [r.getMessage() for r in caplog.records if "broadcast" in r.getMessage()]
    assert "ncclInvalidUsage" in msg and "allreduce:tree" in msg and "VLLM_BATCH_INVARIANT" in msg


def test_weights_held_outside_the_worker_are_refused_with_the_reason(monkeypatch):
    """vLLM 0.32+: a loader that keeps weights in another process would meet the worker's
    utilization of 1e-6 in vLLM's start check; the worker says what is unsupported instead."""
    from vllm.config import LoadConfig, VllmConfig

    import vllm.model_executor.model_loader as loaders

    class External:
        def get_external_weight_memory(self, vllm_config):
            return 3 * GiB

    assert w.external_weight_bytes(LoadConfig(), VllmConfig()) == 0  # vLLM's default loader
    w.refuse_external_weights(LoadConfig(), VllmConfig())  # nothing to refuse
    monkeypatch.setattr(loaders, "get_model_loader", lambda load_config: External())
    with pytest.raises(ValueError, match=r"holds 3.00 GiB of weights outside the worker process"):
        w.refuse_external_weights(LoadConfig(), VllmConfig())


def test_the_profile_is_logged_when_it_ends(fake_rank, monkeypatch, caplog):
    """Seen on the virtual pair: a run refused at the KV check logged no rank summary, so what
    each rank's profile charged was unknown. The profile is logged as soon as it ends."""
    from vllm.v1.worker.gpu_worker import Worker

    caplog.set_level(logging.INFO, logger="vllm.dualgpu")
    logging.getLogger("vllm.dualgpu").propagate = True
    monkeypatch.setattr(Worker, "determine_available_memory", lambda self: int(4.6 * GiB))
    monkeypatch.setattr(w.DualGpuWorker, "_warm_pp_communicators", lambda self: None)
    fake_rank.requested_memory = 14 * GiB
    assert fake_rank.determine_available_memory() == int(4.6 * GiB)
    lines = [r.getMessage() for r in caplog.records if "profiled:" in r.getMessage()]
    assert len(lines) == 1
    assert lines[0].startswith("vllm-dualgpu rank 1 profiled: weights 10.52 GiB, non-KV 9.40 GiB measured")
    assert "KV room 4.60 GiB of a 14.00 GiB budget" in lines[0]


def test_a_set_kv_size_is_not_reported_as_a_profile(fake_rank, monkeypatch, caplog):
    """Seen on the virtual pair (thirteenth session): with --kv-cache-memory-bytes vLLM skips its
    memory profile and returns the set bytes, and the worker logged "non-KV 5.55 GiB measured by
    vLLM, predicted 11.92 GiB (-53.4%)": budget minus the set size, compared with the plan as if
    measured. The line now says the size was set and gives torch's own peak and reserve instead."""
    import torch
    from vllm.v1.worker.gpu_worker import Worker

    caplog.set_level(logging.INFO, logger="vllm.dualgpu")
    logging.getLogger("vllm.dualgpu").propagate = True
    monkeypatch.setattr(Worker, "determine_available_memory", lambda self: int(8.38 * GiB))
    monkeypatch.setattr(w.DualGpuWorker, "_warm_pp_communicators", lambda self: None)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda d=None: int(11.61 * GiB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda d=None: int(12.25 * GiB))
    fake_rank.cache_config.kv_cache_memory_bytes = 9_000_000_000
    fake_rank.requested_memory = int(13.94 * GiB)
    assert fake_rank.determine_available_memory() == int(8.38 * GiB)
    (line,) = [r.getMessage() for r in caplog.records if "vllm-dualgpu rank 1" in r.getMessage()]
    assert "measured by vLLM" not in line and "%" not in line
    assert "--kv-cache-memory-bytes" in line and "8.38 GiB" in line and "skipped its memory profile" in line
    assert "torch's peak 11.61 GiB" in line and "reserved 12.25 GiB" in line and "weights 10.52 GiB" in line


def config_hash(cfg) -> str:
    """vLLM's compile-cache key of ``cfg``: ``compute_hash`` up to vLLM 0.33, the hash of its
    compile factors from 0.34."""
    if hasattr(cfg, "compute_hash"):
        return cfg.compute_hash()
    from vllm.config.utils import hash_config

    return hash_config(cfg)
