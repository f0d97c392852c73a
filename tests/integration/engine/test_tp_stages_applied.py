"""TP groups as pipeline stages through the executor's plan application, on real VllmConfigs
(`-pp 2 -tp 2`, the tiny Qwen3 fixture) with only the GPUs NVML would report faked."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest

from vllm_dualgpu import envs
from vllm_dualgpu.engine import handoff
from vllm_dualgpu.engine import planning as apply
from vllm_dualgpu.nvml import VisibleGpu

GiB = 1024**3
TINY = json.loads((Path(__file__).parents[2] / "fixtures" / "tiny_qwen3.json").read_text())


def gpu(i, name="NVIDIA GeForce RTX 5090", total=32, free=30.0, cc=(12, 0)):
    return VisibleGpu(i, name, total * GiB, int(free * GiB), cc, None, f"GPU-{i}")


def small(i, free=15.0):
    return gpu(i, "NVIDIA GeForce RTX 4070 Ti SUPER", 16, free, (8, 9))


@pytest.fixture(scope="module")
def make_config(tmp_path_factory):
    import vllm.platforms
    from vllm.platforms.cpu import CpuPlatform

    vllm.platforms._current_platform = CpuPlatform()
    import vllm_dualgpu

    vllm_dualgpu.register()
    from vllm.engine.arg_utils import EngineArgs

    from vllm_dualgpu.engine import preflight

    def make(model=TINY, gpus_seen=4, **kw):
        d = tmp_path_factory.mktemp("m")
        (d / "config.json").write_text(json.dumps(model))
        old = preflight.nvml_gpu_count
        preflight.nvml_gpu_count = lambda: gpus_seen
        try:
            args = dict(model=str(d), load_format="dummy", skip_tokenizer_init=True,
                        pipeline_parallel_size=2, tensor_parallel_size=2,
                        distributed_executor_backend="dualgpu", max_model_len=4096, max_num_seqs=8)
            args.update(kw)
            cfg = EngineArgs(**args).create_engine_config()
        finally:
            preflight.nvml_gpu_count = old
        cfg.parallel_config.worker_cls = apply.STOCK_WORKER  # what vLLM resolves on a GPU machine
        return cfg

    return make


@pytest.fixture(autouse=True)
def clean_environ(monkeypatch):

    saved = dict(os.environ)
    for var in ("VLLM_PP_LAYER_PARTITION", envs.RESERVE, "CUDA_VISIBLE_DEVICES", envs.PLAN_FILE):
        monkeypatch.delenv(var, raising=False)
    yield
    os.environ.clear()
    os.environ.update(saved)
    envs.forget_exports()


def visible(monkeypatch, gpus):
    monkeypatch.setattr(apply, "read_visible_gpus", lambda: gpus)


@pytest.fixture
def logged(monkeypatch):
    """What the plan application logs, through a logger of the test's own: vLLM 0.33 configures
    its loggers when it first starts (dictConfig resets the handlers of vLLM's child loggers)."""
    records: list[str] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda r: records.append(r.getMessage())
    own = logging.Logger("tp-stages-test", logging.INFO)
    own.addHandler(handler)
    monkeypatch.setattr(apply, "logger", own)
    return records


def test_equal_card_groups_in_vllm_rank_order(make_config, monkeypatch, logged):
    visible(monkeypatch, [gpu(0), small(1), gpu(2), small(3)])  # two kinds, interleaved in PCI order
    cfg = make_config()
    applied = apply.apply_plan(cfg)
    pc = cfg.parallel_config
    assert pc.world_size == 4
    # Stage 0 = the two 4070 Ti SUPERs (GPUs 1, 3), stage 1 = the two 5090s (GPUs 0, 2: the
    # stage with the most memory last); vLLM's rank r = stage x 2 + TP rank.
    assert pc.assigned_physical_gpu_ids == [1, 3, 0, 2]
    assert [g.physical_id for g in applied.gpus] == [1, 3, 0, 2] and applied.tp_size == 2
    split = applied.plan.partition
    assert os.environ["VLLM_PP_LAYER_PARTITION"] == f"{split[0]},{split[1]}"
    assert sum(split) == 4 and split[0] < split[1]
    assert pc.worker_cls == apply.OUR_WORKER
    record = handoff.load(cfg)  # the record travels in the config the workers receive
    assert record.tp_size == 2 and record.partition_source == "plan"
    rows = [(r.rank, r.physical_gpu_id, r.stage, r.tp_rank, r.num_layers, r.reserve_bytes) for r in record.ranks]
    d = envs.DEFAULT_RESERVE_BYTES
    assert rows == [(0, 1, 0, 0, split[0], d), (1, 3, 0, 1, split[0], d),
                    (2, 0, 1, 0, split[1], d), (3, 2, 1, 1, split[1], d)]
    # Each worker finds its own record by its global rank.
    assert [record.rank(r).physical_gpu_id for r in range(4)] == [1, 3, 0, 2]
    assert record.rank(4) is None
    # The two ranks of a stage are predicted to carry the same non-KV costs.
    assert record.ranks[0].predicted_non_kv_bytes == record.ranks[1].predicted_non_kv_bytes > 0
    line = next(m for m in logged if m.startswith("vllm-dualgpu plan:"))
    assert line.startswith("vllm-dualgpu plan: TP 2 stages 1:NVIDIA GeForce RTX 4070 Ti SUPER")
    assert " + 3:NVIDIA GeForce RTX 4070 Ti SUPER" in line and " -> 0:NVIDIA GeForce RTX 5090" in line


def test_equal_cards_with_less_free_are_planned_as_equals(make_config, monkeypatch, logged):
    visible(monkeypatch, [gpu(0, free=30), gpu(1, free=20), gpu(2, free=30), gpu(3, free=30)])
    cfg = make_config()
    applied = apply.apply_plan(cfg)
    assert "vllm-dualgpu: TP groups planned as equals at the smaller card's free memory" in logged
    # The stage holding GPU 1 (20 GiB free) has the smaller budget, so it goes first.
    assert [g.physical_id for g in applied.gpus] == [0, 1, 2, 3]
    assert applied.plan.ranks[0].gpu.free_bytes == 20 * GiB


def refusal(make_config, monkeypatch, gpus, **kw) -> str:
    visible(monkeypatch, gpus)
    cfg = make_config(**kw)
    with pytest.raises(ValueError) as e:  # the executor logs a ValueError as one ERROR line
        apply.apply_plan(cfg)
    return str(e.value)


def test_mixed_tp_group_is_refused(make_config, monkeypatch):
    msg = refusal(make_config, monkeypatch, [gpu(0), gpu(1), small(2), gpu(3, "NVIDIA GeForce RTX 5080", 16, 15)])
    assert msg.startswith("mixed TP group: --tensor-parallel-size 2 x --pipeline-parallel-size 2 needs "
                          "stages of 2 cards of one kind; of GPUs 0:RTX 5090, 1:RTX 5090, "
                          "2:RTX 4070 Ti SUPER, 3:RTX 5080, GPU 2 (RTX 4070 Ti SUPER, 16 GiB), "
                          "GPU 3 (RTX 5080, 16 GiB) would share a stage")
    assert "\n" not in msg


def test_too_few_cards_is_refused(make_config, monkeypatch):
    msg = refusal(make_config, monkeypatch, [gpu(0), gpu(1), gpu(2)])
    assert msg.startswith("--pipeline-parallel-size 2 x --tensor-parallel-size 2 needs 4 GPUs, but "
                          "only 3 are visible (NVIDIA GeForce RTX 5090, ")


def test_too_few_cards_is_refused_in_the_front_end(make_config):
    from vllm_dualgpu.engine.preflight import PreflightError

    with pytest.raises(PreflightError, match=r"^--pipeline-parallel-size 2 x --tensor-parallel-size 2 needs 4 GPUs, but 3 are visible"):
        make_config(gpus_seen=3)


def test_heads_tp_does_not_divide_is_vllms_refusal(make_config):
    with pytest.raises(ValueError, match=r"Total number of attention heads \(4\) must be divisible by tensor parallel size \(3\)"):
        make_config(tensor_parallel_size=3, gpus_seen=6)


def test_kv_heads_tp_does_not_divide_is_refused_before_workers(make_config, monkeypatch):
    # vLLM accepts 6 heads at TP 2 when building the config; its QKV layer would fail on 3 KV
    # heads only when the workers load the model.
    six = dict(TINY, hidden_size=384, num_attention_heads=6, num_key_value_heads=3)
    msg = refusal(make_config, monkeypatch, [gpu(i) for i in range(4)], model=six)
    assert msg.startswith("tensor parallel size 2 does not divide the model's KV heads (3); vLLM refuses it")


def test_physical_ids_and_positions_when_cuda_visible_devices_picks_cards(make_config, monkeypatch, tmp_path):
    # As if CUDA_VISIBLE_DEVICES=4,5,6,7: vLLM is given NVML (physical) ids, the plan file also
    # the positions among the visible cards, both in rank order.
    visible(monkeypatch, [gpu(4), small(5), gpu(6), small(7)])
    path = tmp_path / "plan.json"
    monkeypatch.setenv(envs.PLAN_FILE, str(path))
    cfg = make_config()
    apply.apply_plan(cfg)
    assert cfg.parallel_config.assigned_physical_gpu_ids == [5, 7, 4, 6]
    data = json.loads(path.read_text())
    assert data["physical_gpu_ids"] == [5, 7, 4, 6] and data["cuda_visible_devices"] == "1,3,0,2"
    assert [r.physical_gpu_id for r in handoff.load(cfg).ranks] == [5, 7, 4, 6]


def test_a_hybrid_model_in_tp_stages_is_priced_by_vllms_functions(qwen3_5_hybrid_config, monkeypatch, logged):
    """The Gated DeltaNet state and attention pages of one TP rank, as the planner's shard sizes
    them, are what vLLM's own spec functions give at TP 2 (kv_pricing would warn otherwise)."""
    from vllm_dualgpu.engine import kv_pricing, preflight

    monkeypatch.setattr(preflight, "nvml_gpu_count", lambda: 4)
    cfg = qwen3_5_hybrid_config(tensor_parallel_size=2, max_num_seqs=4, max_num_batched_tokens=2048,
                                mamba_ssm_cache_dtype="float32")
    cfg.parallel_config.worker_cls = apply.STOCK_WORKER
    visible(monkeypatch, [gpu(i) for i in range(4)])
    warnings = []
    monkeypatch.setattr(kv_pricing.logger, "warning", lambda msg, *a: warnings.append(msg % a))
    applied = apply.apply_plan(cfg)
    assert not [w for w in warnings if "priced by the planner's own arithmetic only" in w], warnings
    assert cfg.parallel_config.assigned_physical_gpu_ids == [0, 1, 2, 3]
    assert [r.stage for r in handoff.load(cfg).ranks] == [0, 0, 1, 1] and sum(applied.plan.partition) == 8
