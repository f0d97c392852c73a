"""The executor's plan application on a real VllmConfig, with the GPUs NVML would report faked."""

from __future__ import annotations

import json
import logging

import pytest
from plan_exports import restore_environ  # noqa: F401  (autouse: the plan's exports undone)

from vllm_dualgpu import envs
from vllm_dualgpu.engine import handoff
from vllm_dualgpu.engine import planning as apply
from vllm_dualgpu.nvml import VisibleGpu

GiB = 1024**3
H200_TOTAL = int(140.4 * GiB)

# Qwen3-14B-class shapes with block-FP8 weights: the model of the GPU benchmark (docs/benchmarks.md).
Q14_FP8 = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 5120,
    "intermediate_size": 17408, "num_hidden_layers": 40, "num_attention_heads": 40,
    "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936,
    "max_position_embeddings": 262144, "rms_norm_eps": 1e-6, "rope_theta": 1000000,
    "torch_dtype": "bfloat16", "tie_word_embeddings": False,
    "quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic",
                            "weight_block_size": [128, 128]},
}


@pytest.fixture(scope="module")
def make_config(tmp_path_factory):
    import vllm.platforms
    from vllm.platforms.cpu import CpuPlatform

    vllm.platforms._current_platform = CpuPlatform()
    import vllm_dualgpu

    vllm_dualgpu.register()
    from vllm.engine.arg_utils import EngineArgs

    from vllm_dualgpu.engine import preflight

    d = tmp_path_factory.mktemp("q14")
    (d / "config.json").write_text(json.dumps(Q14_FP8))

    def make(**kw):
        old = preflight.nvml_gpu_count
        preflight.nvml_gpu_count = lambda: 2
        try:
            args = dict(model=str(d), load_format="dummy", skip_tokenizer_init=True,
                        pipeline_parallel_size=2, distributed_executor_backend="dualgpu",
                        max_model_len=32768)
            args.update(kw)
            cfg = EngineArgs(**args).create_engine_config()
        finally:
            preflight.nvml_gpu_count = old
        # On a GPU machine vLLM resolves the worker to its GPU worker; the plan replaces it.
        cfg.parallel_config.worker_cls = apply.STOCK_WORKER
        return cfg

    return make


@pytest.fixture
def big_first_pair(monkeypatch):
    """GPU 0 with 32 GiB free, GPU 1 with 16 GiB free: the big card comes first in PCI order."""
    gpus = [VisibleGpu(0, "NVIDIA H200", H200_TOTAL, 32 * GiB, (9, 0), 4800.0, "GPU-a"),
            VisibleGpu(1, "NVIDIA H200", H200_TOTAL, 16 * GiB, (9, 0), 4800.0, "GPU-b")]
    monkeypatch.setattr(apply, "read_visible_gpus", lambda: gpus)
    for var in ("VLLM_PP_LAYER_PARTITION", envs.RESERVE, "CUDA_VISIBLE_DEVICES", envs.PLAN_FILE, envs.OBJECTIVE):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    return gpus


class Lines(logging.Handler):
    """The package logger's messages (a handler of its own: vLLM's logging configuration, made
    when the first config of a process is built, resets its children's handlers)."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())

    def trade(self) -> list[str]:
        return [m for m in self.messages if "the pool objective gives" in m]


@pytest.fixture
def lines(make_config):
    make_config()  # vLLM configures its logging once, clearing its children's handlers: before ours
    log = logging.getLogger("vllm.dualgpu")
    handler, level = Lines(), log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    yield handler
    log.removeHandler(handler)
    log.setLevel(level)


def test_the_default_objective_logs_what_the_pool_objective_gives(make_config, big_first_pair, monkeypatch, lines):
    """Issue 26: the big card four times as fast; with zero flags the engine takes the fastest
    split that holds the context and logs one line with the pool objective's split, which
    VLLM_DUALGPU_OBJECTIVE=pool then applies; equal cards (the same bytes read on any split)
    log nothing more."""
    big, small = big_first_pair
    monkeypatch.setattr(apply, "read_visible_gpus", lambda: [
        VisibleGpu(0, big.name, big.total_bytes, big.free_bytes, big.capability, 4800.0, "GPU-a"),
        VisibleGpu(1, small.name, small.total_bytes, small.free_bytes, small.capability, 1200.0, "GPU-b")])
    speed = apply.apply_plan(make_config()).plan
    alt = speed.pool_alternative
    assert speed.objective == "speed" and alt is not None
    assert lines.trade() == [speed.trade_line()]
    assert speed.predicted_decode_ms < alt.predicted_decode_ms and speed.num_blocks < alt.num_blocks
    lines.messages.clear()
    monkeypatch.setenv(envs.OBJECTIVE, "pool")
    pool = apply.apply_plan(make_config()).plan
    assert (pool.objective, pool.order, pool.partition, pool.num_blocks) == ("pool", alt.order, alt.partition,
                                                                             alt.num_blocks)
    assert lines.trade() == [] and any("vllm-dualgpu plan: ranks" in m for m in lines.messages)
    lines.messages.clear()
    monkeypatch.delenv(envs.OBJECTIVE)
    monkeypatch.setattr(apply, "read_visible_gpus", lambda: big_first_pair)
    same = apply.apply_plan(make_config()).plan
    assert same.objective == "speed" and same.pool_alternative is None and lines.trade() == []


def test_big_card_last_and_split_applied(make_config, big_first_pair):
    import os

    cfg = make_config()
    applied = apply.apply_plan(cfg)
    # The 32 GiB card (GPU 0) holds the output head: it must be the last rank.
    assert cfg.parallel_config.assigned_physical_gpu_ids == [1, 0]
    split = applied.plan.partition
    assert os.environ["VLLM_PP_LAYER_PARTITION"] == f"{split[0]},{split[1]}"
    # The small card gets fewer layers, and the split beats an even one by a wide margin.
    assert split[0] < split[1] and sum(split) == 40
    assert cfg.parallel_config.worker_cls == apply.OUR_WORKER
    record = handoff.load(cfg)
    assert [r.reserve_bytes for r in record.ranks] == [envs.DEFAULT_RESERVE_BYTES] * 2
    assert [r.physical_gpu_id for r in record.ranks] == [1, 0]
    assert record.partition == tuple(split) and record.partition_source == "plan"
    assert not any(k.startswith("VLLM_DUALGPU_RANK") for k in os.environ)


def test_pool_beats_the_even_split(make_config, big_first_pair, monkeypatch):
    chosen = apply.apply_plan(make_config()).plan
    monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", "20,20")
    even = apply.apply_plan(make_config()).plan
    assert even.partition == [20, 20]
    assert chosen.num_blocks > 1.5 * even.num_blocks


def test_user_partition_wins_and_is_logged(make_config, big_first_pair, monkeypatch, caplog):
    import os

    caplog.set_level(logging.INFO, logger="vllm.dualgpu")
    logging.getLogger("vllm.dualgpu").propagate = True
    monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", "16,24")
    applied = apply.apply_plan(make_config())
    assert applied.plan.partition == [16, 24]
    assert os.environ["VLLM_PP_LAYER_PARTITION"] == "16,24"
    assert any("set by the user: using it as the layer split" in r.getMessage() for r in caplog.records)


def test_per_gpu_reserve_follows_the_gpu_not_the_rank(make_config, big_first_pair, monkeypatch):
    monkeypatch.setenv(envs.RESERVE, "1GiB,0")  # 1 GiB kept free on GPU 0 (the big one, last rank)
    cfg = make_config()
    apply.apply_plan(cfg)
    assert [r.reserve_bytes for r in handoff.load(cfg).ranks] == [0, GiB]


def test_explicit_utilization_caps_each_rank(make_config, big_first_pair):
    cfg = make_config(gpu_memory_utilization=0.1)
    applied = apply.apply_plan(cfg)
    cap = int(0.1 * H200_TOTAL)
    record = handoff.load(cfg)
    assert [r.cap_bytes for r in record.ranks] == [cap, cap]
    # The plan budgets what the workers will get (seen on GPUs: a prediction from the uncapped
    # budget made the summary line's non-KV prediction negative).
    assert [r.budget_bytes for r in applied.plan.ranks] == [min(cap, 16 * GiB - envs.DEFAULT_RESERVE_BYTES),
                                                            min(cap, 32 * GiB - envs.DEFAULT_RESERVE_BYTES)]
    assert all(0 < kv < cap for kv in (r.kv_budget_bytes for r in applied.plan.ranks))
    # What the workers compare vLLM's profile with: budget - KV budget, less the CUDA context.
    for r, rec in zip(applied.plan.ranks, record.ranks):
        assert rec.predicted_non_kv_bytes == (r.budget_bytes - r.kv_budget_bytes - r.fixed_detail["cuda_context"]
                                              - rec.after_profile_bytes)
        assert 0 < rec.predicted_non_kv_bytes < cap


def test_plan_file(make_config, big_first_pair, monkeypatch, tmp_path):
    path = tmp_path / "plan.json"
    monkeypatch.setenv(envs.PLAN_FILE, str(path))
    applied = apply.apply_plan(make_config())
    data = json.loads(path.read_text())
    assert data["physical_gpu_ids"] == [1, 0]
    assert data["partition"] == applied.plan.partition
    assert data["num_blocks"] == applied.plan.num_blocks


def test_each_rank_gets_its_prediction(make_config, big_first_pair):
    from vllm_dualgpu.engine.worker import profiled_vs_predicted

    cfg = make_config()
    applied = apply.apply_plan(cfg)
    predicted = [r.predicted_non_kv_bytes for r in handoff.load(cfg).ranks]
    assert all(p > 0 for p in predicted)
    # Rank 1 (the 32 GiB card) holds 29 of 40 layers and the head: it pays more besides KV.
    assert applied.plan.partition[1] > applied.plan.partition[0] and predicted[1] > predicted[0]
    requested = 15 * GiB
    # vLLM measured 100 MiB more than predicted: its KV is 100 MiB smaller than requested - predicted.
    line = profiled_vs_predicted(requested, requested - predicted[0] - 100 * 2**20, predicted[0])
    assert "+100 MiB" in line and "measured by vLLM" in line


def test_context_far_too_long_fails_before_weights_load(make_config, big_first_pair):
    from vllm_dualgpu.planner import ContextTooLong

    with pytest.raises(ContextTooLong, match=r"--max-model-len 262,144 does not fit: the largest that fits is"):
        apply.apply_plan(make_config(max_model_len=262144))


def test_block_size_is_an_override_only_when_the_user_gave_it(make_config):
    """vLLM fills in a default block size; the plan must not report it as the user's choice."""
    assert apply.plan_request(make_config(), None).block_size is None
    assert apply.plan_request(make_config(block_size=32), None).block_size == 32


def test_a_second_plan_in_one_process_does_not_take_the_first_as_the_users(make_config, big_first_pair, tmp_path):
    """With multiprocessing off, a second LLM(...) plans in the process that exported the first
    plan's VLLM_PP_LAYER_PARTITION; that value is the plugin's, not the user's."""
    import os

    first = make_config()
    apply.apply_plan(first)
    exported = os.environ["VLLM_PP_LAYER_PARTITION"]
    assert handoff.load(first).partition_source == "plan"
    # A second model with 28 layers: the first export (summing to 40) would not even parse as
    # its split if it were taken for the user's.
    d = tmp_path / "q14-28"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({**Q14_FP8, "num_hidden_layers": 28}))
    second = make_config(model=str(d))
    assert handoff.frontend_settings(second)["user_partition"] is None
    applied = apply.apply_plan(second)
    assert handoff.load(second).partition_source == "plan" and sum(applied.plan.partition) == 28
    assert ",".join(map(str, applied.plan.partition)) == os.environ["VLLM_PP_LAYER_PARTITION"] != exported


def test_mixed_capabilities_with_fp8_kv_share_one_attention_backend(engine_config, tmp_path):
    """vLLM 0.33's KV specs carry the backend's block alignment (0.30's do not); on the virtual
    pair (vLLM 0.33) rank 0 picked FlashInfer and rank 1 FlashAttention, and their attention
    layers did not group. The executor sets one backend in the config every worker receives."""
    import shutil

    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    from vllm.v1.kv_cache_interface import AttentionSpec

    from vllm_dualgpu.engine.attention_backend import apply_common_backend

    from conftest import FIXTURES

    shutil.copy(FIXTURES / "tiny_qwen3.json", tmp_path / "config.json")
    make = lambda **kw: engine_config(model=str(tmp_path), load_format="dummy",  # noqa: E731
                                      skip_tokenizer_init=True, pipeline_parallel_size=2,
                                      distributed_executor_backend="dualgpu", **kw)
    aligned = "block_stride_alignment" in AttentionSpec.__dataclass_fields__
    cfg = make(kv_cache_dtype="fp8")
    assert cfg.attention_config.backend is None
    apply_common_backend(cfg, [(8, 9), (9, 0)])
    assert cfg.attention_config.backend == (AttentionBackendEnum.FLASHINFER if aligned else None)
    chosen = make(kv_cache_dtype="fp8", attention_backend="TRITON_ATTN")
    apply_common_backend(chosen, [(8, 9), (9, 0)])
    assert chosen.attention_config.backend == AttentionBackendEnum.TRITON_ATTN
    bf16 = make()
    apply_common_backend(bf16, [(8, 9), (9, 0)])
    assert bf16.attention_config.backend is None


def test_a_hand_set_pool_past_the_plan_runs_with_a_warning(make_config, big_first_pair, monkeypatch, lines):
    """--num-gpu-blocks-override past the largest pool of any split (the pool objective's split is
    within 1% of that pool, so 2% past it): vLLM does not check it, so the executor does not refuse
    it either; it says which rank it expects short."""
    monkeypatch.setenv("VLLM_DUALGPU_OBJECTIVE", "pool")
    planned = apply.apply_plan(make_config()).plan
    past = int(planned.num_blocks * 1.02) + 10
    applied = apply.apply_plan(make_config(num_gpu_blocks_override=past)).plan
    assert applied.num_blocks == past
    assert [x for x in lines.messages if x.startswith(f"vllm-dualgpu: --num-gpu-blocks-override {applied.num_blocks}: rank ")
            and "is predicted short by" in x and x.endswith("lower the override")], lines.messages


def test_flashinfer_workspaces_come_off_the_budget_vllm_sizes_the_kv_cache_from(make_config, monkeypatch):
    """vLLM 0.33 builds its attention backends with the KV cache (v1/worker/gpu/model_runner.py,
    initialize_kv_cache -> init_attn_backend), after its profile sized the pool, and FlashInfer then
    allocates its workspace: vLLM never charges it. With an fp8 KV cache on cards of different
    capability (FlashInfer on both), each rank's record carries that buffer, which the worker takes
    off the budget it hands vLLM, and vLLM's charges are predicted without it. Its size is what
    vLLM allocates: the configured size (the user's 128 MiB here) grown to vLLM's estimate for the
    batch, max_num_batched_tokens x query heads x head size x 16 bytes
    (FlashInferMetadataBuilder._get_workspace_buffer). The RTX 5090 rank (SM 12.0) decodes
    through XQA and holds a second buffer of the configured size, not grown
    (_get_trtllm_workspace_buffer): 128 MiB more there."""
    gpus = [VisibleGpu(0, "NVIDIA GeForce RTX 4070 Ti SUPER", 16 * GiB, 16 * GiB, (8, 9), 672.0, "GPU-a"),
            VisibleGpu(1, "NVIDIA GeForce RTX 5090", 32 * GiB, 32 * GiB, (12, 0), 1792.0, "GPU-b")]
    monkeypatch.setattr(apply, "read_visible_gpus", lambda: gpus)
    for var in ("VLLM_PP_LAYER_PARTITION", envs.RESERVE, "CUDA_VISIBLE_DEVICES", envs.PLAN_FILE, envs.OBJECTIVE):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("VLLM_FLASHINFER_WORKSPACE_BUFFER_SIZE", str(128 * 2**20))
    for tokens, expected in ((1024, 128 * 2**20),  # vLLM's estimate 80 MiB: the configured size
                             (8192, 8192 * Q14_FP8["num_attention_heads"] * Q14_FP8["head_dim"] * 16)):
        cfg = make_config(kv_cache_dtype="fp8", max_num_batched_tokens=tokens)
        applied = apply.apply_plan(cfg)
        records = handoff.load(cfg).ranks
        xqa = [0, 128 * 2**20]  # the 4070 (SM 8.9), the 5090 (SM 12.0), in rank order
        assert [r.gpu_name for r in records] == ["NVIDIA GeForce RTX 4070 Ti SUPER", "NVIDIA GeForce RTX 5090"]
        assert [r.after_profile_bytes for r in records] == [expected + x for x in xqa], tokens
        for r, rec, x in zip(applied.plan.ranks, records, xqa):
            assert rec.predicted_non_kv_bytes == (r.budget_bytes - r.kv_budget_bytes - r.fixed_detail["cuda_context"]
                                                  - expected - x)
    bf16 = make_config()
    apply.apply_plan(bf16)
    assert [r.after_profile_bytes for r in handoff.load(bf16).ranks] == [0, 0]


def test_the_executor_sets_flashinfers_workspace_where_the_user_did_not(make_config, monkeypatch):
    """Unset: the executor exports the plan's size before the workers spawn (they inherit it) and
    logs it; a second plan in the same process does not take that export for the user's; a user's
    own value is left alone; a run without FlashInfer takes its export back."""
    import os

    gpus = [VisibleGpu(0, "NVIDIA GeForce RTX 4070 Ti SUPER", 16 * GiB, 16 * GiB, (8, 9), 672.0, "GPU-a"),
            VisibleGpu(1, "NVIDIA GeForce RTX 5090", 32 * GiB, 32 * GiB, (12, 0), 1792.0, "GPU-b")]
    monkeypatch.setattr(apply, "read_visible_gpus", lambda: gpus)
    for var in ("VLLM_PP_LAYER_PARTITION", envs.RESERVE, "CUDA_VISIBLE_DEVICES", envs.PLAN_FILE, envs.OBJECTIVE,
                "VLLM_FLASHINFER_WORKSPACE_BUFFER_SIZE"):
        monkeypatch.delenv(var, raising=False)
    cfg = make_config(kv_cache_dtype="fp8", max_num_batched_tokens=1024)
    first = apply.apply_plan(cfg).plan
    exported = os.environ.get("VLLM_FLASHINFER_WORKSPACE_BUFFER_SIZE")
    assert exported is not None and 0 < int(exported) == first.flashinfer_workspace_bytes < 394 * 2**20
    # the worker takes what vLLM will allocate off its budget: the export, grown to vLLM's estimate
    est = 1024 * Q14_FP8["num_attention_heads"] * Q14_FP8["head_dim"] * 16
    # (and the RTX 5090 rank, SM 12.0, XQA's buffer of the exported size, not grown)
    assert [r.after_profile_bytes for r in handoff.load(cfg).ranks] == [max(int(exported), est),
                                                                        max(int(exported), est) + int(exported)]
    again = apply.apply_plan(make_config(kv_cache_dtype="fp8", max_num_batched_tokens=1024)).plan
    assert again.flashinfer_workspace_bytes == first.flashinfer_workspace_bytes  # not the user's value
    apply.apply_plan(make_config())  # bf16 KV: no rank runs FlashInfer
    assert "VLLM_FLASHINFER_WORKSPACE_BUFFER_SIZE" not in os.environ
    monkeypatch.setenv("VLLM_FLASHINFER_WORKSPACE_BUFFER_SIZE", str(200 * 2**20))
    user_cfg = make_config(kv_cache_dtype="fp8", max_num_batched_tokens=1024)
    assert apply.apply_plan(user_cfg).plan.flashinfer_workspace_bytes == 0
    assert os.environ["VLLM_FLASHINFER_WORKSPACE_BUFFER_SIZE"] == str(200 * 2**20)
    assert [r.after_profile_bytes for r in handoff.load(user_cfg).ranks] == [200 * 2**20, 400 * 2**20]


def test_the_executor_runs_its_workers_with_expandable_segments(make_config, lines, monkeypatch):
    """Zero flags: the workers inherit PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, said in
    one line; a user's own allocator setting is kept; sleep mode (vLLM's own pool) takes the
    export back; a second plan in the process does not take the export for the user's."""
    import os

    gpus = [VisibleGpu(0, "NVIDIA GeForce RTX 4070 Ti SUPER", 16 * GiB, 16 * GiB, (8, 9), 672.0, "GPU-a"),
            VisibleGpu(1, "NVIDIA GeForce RTX 5090", 32 * GiB, 32 * GiB, (12, 0), 1792.0, "GPU-b")]
    monkeypatch.setattr(apply, "read_visible_gpus", lambda: gpus)
    for var in ("VLLM_PP_LAYER_PARTITION", envs.RESERVE, "CUDA_VISIBLE_DEVICES", envs.PLAN_FILE, envs.OBJECTIVE,
                "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        monkeypatch.delenv(var, raising=False)
    apply.apply_plan(make_config())
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    lines = [m for m in lines.messages if "PYTORCH_CUDA_ALLOC_CONF" in m]
    assert len(lines) == 1 and lines[0].startswith(
        "vllm-dualgpu: the workers run with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True: "), lines
    apply.apply_plan(make_config())
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    asleep = make_config()
    asleep.model_config.enable_sleep_mode = True  # vLLM's CPU platform refuses the flag itself
    apply.apply_plan(asleep)
    assert "PYTORCH_CUDA_ALLOC_CONF" not in os.environ
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "max_split_size_mb:512")
    apply.apply_plan(make_config())
    assert "PYTORCH_CUDA_ALLOC_CONF" not in os.environ and os.environ["PYTORCH_ALLOC_CONF"] == "max_split_size_mb:512"
