"""Every GPU run's real VllmConfig, built on the CPU (what the GPU scripts' ``--dry-run`` checked):
the e2e runs in bf16 and float32, MTP and EAGLE3 under PP=2 and stock vLLM's EAGLE3 refusal, the
DFlash2 runs (stock on one rank, the plugin under PP=2: their configs, the executor's plan on the
virtual pair, the W4A16 drafter's files in vLLM's own class and its kernel on SM 9.0), the vision
model, and the checkpoints with an INT8-packed embedding. The runs' settings come from
tests/gpu (gpu_runs, gpu_tokens, gpu_models), so a GPU test cannot boot something these did not
build."""

from __future__ import annotations

import bisect
import json
import logging

import pytest
import torch

import gpu_models as gm
from conftest import v2_runner_or_skip
import gpu_runs
import gpu_tokens as tok
from vllm_dualgpu.engine import preflight


def executor(cfg) -> str:
    backend = cfg.parallel_config.distributed_executor_backend
    return getattr(backend, "__name__", str(backend))


# --- e2e: stock on one GPU vs the plugin on two ------------------------------------------------------


def test_e2e_engine_settings_per_run(tmp_path, monkeypatch):
    monkeypatch.delenv("GDN_PREFILL_BACKEND", raising=False)
    ks = tok.engine_kwargs("dense", tmp_path, 1, "bfloat16")
    kp = tok.engine_kwargs("hybrid", tmp_path, 2, "bfloat16", mtp=True)
    assert "distributed_executor_backend" not in ks and "pipeline_parallel_size" not in ks
    assert kp["distributed_executor_backend"] == "dualgpu" and kp["pipeline_parallel_size"] == 2
    assert kp["speculative_config"] == tok.MTP and "speculative_config" not in ks
    for k in (ks, kp):
        assert k["enforce_eager"] and k["dtype"] == "bfloat16" and k["max_model_len"] == tok.MAX_MODEL_LEN
        assert k["skip_tokenizer_init"] and not k["disable_log_stats"]
    # Hybrid runs name their GDN prefill kernel (the same in every run); dense ones do not.
    assert kp["additional_config"] == gm.gdn_prefill_config() == {"gdn_prefill_backend": "triton"}
    assert "additional_config" not in ks
    # bf16: vLLM picks the attention backend; Triton's float32 default is untouched.
    assert "attention_backend" not in ks and "attention_backend" not in kp
    es, ep = tok.run_env("bfloat16", gpu="0"), tok.run_env("bfloat16")
    assert es["CUDA_VISIBLE_DEVICES"] == "0" and "CUDA_VISIBLE_DEVICES" not in ep
    assert es["CUBLAS_WORKSPACE_CONFIG"] == ep["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"
    assert "VLLM_BATCH_INVARIANT" not in es and "TRITON_F32_DEFAULT" not in ep
    assert tok.run_env("float32")["TRITON_F32_DEFAULT"] == "ieee"


def test_e2e_rejects_an_unknown_dtype(monkeypatch):
    monkeypatch.setenv("E2E_DTYPE", "float16")
    with pytest.raises(ValueError, match="E2E_DTYPE='float16': must be one of bfloat16, float32"):
        tok.e2e_dtype()


@pytest.mark.slow
@pytest.mark.parametrize("dtype", tok.DTYPES)
def test_e2e_engine_configs(engine_config, tmp_path, dtype):
    """Each run of test_gpu_e2e_correctness builds; float32 runs get float32 configs with Triton
    attention, the drafter in float32 too; the MTP model in float32 is the all-attention twin."""
    mtp_model = tok.mtp_model(dtype)
    assert mtp_model == ("attn" if dtype == "float32" else "hybrid")
    for model, mtp in (("dense", False), (mtp_model, True)):
        folder = gm.write_config_only(gm.PRESETS[tok.PRESETS[model]](), tmp_path / model)
        for pp in (1, 2):
            cfg = engine_config(**tok.engine_kwargs(model, folder, pp, dtype, mtp))
            name = f"{model} pp={pp} {dtype}"
            assert str(cfg.model_config.dtype) == f"torch.{dtype}", name
            assert cfg.parallel_config.pipeline_parallel_size == pp, name
            if pp == 2:
                assert executor(cfg) == "DualGpuExecutor", name
            assert cfg.cache_config.enable_prefix_caching, name
            backend = getattr(cfg.attention_config.backend, "name", None)
            assert backend == ("TRITON_ATTN" if dtype == "float32" else None), (name, backend)
            spec = cfg.speculative_config
            assert (spec is not None) == mtp, name
            if mtp:
                assert str(spec.draft_model_config.dtype) == f"torch.{dtype}", name


# --- speculative decoding under PP=2 -----------------------------------------------------------------


@pytest.fixture(scope="module")
def spec_dirs(tmp_path_factory):
    d = tmp_path_factory.mktemp("spec")
    return gm.write_config_only(gm.SPEC_HYBRID, d / "model"), gm.write_config_only(gm.EAGLE3_CONFIG, d / "drafter")


def test_spec_runs_keep_vllms_stat_loggers(tmp_path):
    """The speculative-decoding tests record vLLM's acceptance counters (LLM.get_metrics()), which
    raise "Stat logging disabled" unless the run keeps its stat loggers."""
    for kw in (gpu_runs.spec_kwargs(tmp_path), gpu_runs.spec_kwargs(tmp_path, "eagle3", tmp_path / "d")):
        assert kw.get("disable_log_stats", True) is False, kw["speculative_config"]


@pytest.mark.slow
def test_mtp_config(engine_config, spec_dirs):
    cfg = engine_config(**gpu_runs.spec_kwargs(spec_dirs[0]))
    spec = cfg.speculative_config
    assert cfg.model_config.architectures == ["Qwen3_5ForCausalLM"] and cfg.model_config.is_hybrid
    assert spec.draft_model_config.architectures == ["Qwen3_5MTP"] and spec.method == "mtp"
    assert spec.num_speculative_tokens == gpu_runs.NUM_SPEC
    assert executor(cfg) == "DualGpuExecutor" and cfg.parallel_config.pipeline_parallel_size == 2
    assert cfg.cache_config.mamba_cache_mode == "align"
    assert max(map(len, gpu_runs.spec_prompts())) + 128 <= cfg.model_config.max_model_len
    layers = gm.SPEC_HYBRID["num_hidden_layers"]
    assert layers // gm.SPEC_HYBRID["full_attention_interval"] >= 2 and layers % 2 == 0  # attention on both ranks


@pytest.mark.slow
def test_eagle3_config_with_the_plugin(engine_config, spec_dirs):
    from vllm.distributed.utils import get_pp_indices
    from vllm.model_executor.models.registry import ModelRegistry
    from vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils import get_eagle3_aux_layers_from_config

    model, drafter = spec_dirs
    cfg = engine_config(**gpu_runs.spec_kwargs(model, "eagle3", drafter))  # the plugin's preflight inside
    spec = cfg.speculative_config
    draft = spec.draft_model_config
    entry = ModelRegistry.models.get(draft.architecture)
    assert spec.method == "eagle3" and spec.num_speculative_tokens == 2 and not spec.parallel_drafting
    assert f"{entry.module_name}.{entry.class_name}" == gm.EAGLE3_DRAFTER_CLASS
    assert draft.hf_config.hidden_size == cfg.model_config.get_hidden_size()
    assert (getattr(draft.hf_config, "draft_vocab_size", None) or draft.get_vocab_size()) == cfg.model_config.get_vocab_size()
    aux = get_eagle3_aux_layers_from_config(spec)
    assert list(aux) == gm.EAGLE3_AUX_LAYERS
    assert draft.hf_config.eagle_config["eagle_aux_hidden_state_layer_ids"] == gm.EAGLE3_AUX_LAYERS  # sizes the fc
    pp, n = cfg.parallel_config.pipeline_parallel_size, cfg.model_config.get_total_num_hidden_layers()
    assert gm.aux_layer_ranks(aux, [get_pp_indices(n, r, pp) for r in range(pp)]) == {2: 0, 4: 0, 5: 1}
    assert executor(cfg) == "DualGpuExecutor" and pp == 2
    assert v2_runner_refuses(cfg) == []
    assert preflight.check(cfg, 2) == []  # as with two GPUs visible
    assert preflight.aux_relay_problem(cfg.model_config.architectures) == ""


def test_aux_layer_ranks():
    assert gm.aux_layer_ranks([2, 4, 5], [(0, 4), (4, 8)]) == {2: 0, 4: 0, 5: 1}
    assert gm.aux_layer_ranks([0, 3, 8], [(0, 3), (3, 8)]) == {0: 0, 3: 0, 8: 1}


@pytest.mark.slow
def test_stock_accepts_eagle3_config_and_its_worker_check_refuses(engine_config, spec_dirs, qwen3_5):
    """Stock ("mp") accepts the config; the refusal is the V2 runner's load-time check
    (``verify_supports_aux_hidden_states_over_pp``), run here on vLLM's stock decoder."""
    from torch import nn
    from vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils import verify_supports_aux_hidden_states_over_pp

    cfg = engine_config(**gpu_runs.spec_kwargs(spec_dirs[0], "eagle3", spec_dirs[1], backend="mp"))
    assert str(cfg.parallel_config.distributed_executor_backend) == "mp"
    assert cfg.speculative_config.method == "eagle3"
    model = qwen3_5.Qwen3_5ForCausalLM.__new__(qwen3_5.Qwen3_5ForCausalLM)
    nn.Module.__init__(model)
    decoder = qwen3_5.Qwen3_5Model.__new__(qwen3_5.Qwen3_5Model)
    nn.Module.__init__(decoder)
    model.model = decoder
    with pytest.raises(ValueError, match="Qwen3_5ForCausalLM does not support eagle3 with pipeline parallelism"):
        verify_supports_aux_hidden_states_over_pp(model, "eagle3")


# --- DFlash next to the hybrid: stock on one rank, the plugin under PP=2 ------------------------------


@pytest.fixture(scope="module")
def dflash_dirs(tmp_path_factory):
    """Config-only folders of the DFlash runs (the GPU test writes the weights)."""
    d = tmp_path_factory.mktemp("dflash")
    return (gm.write_config_only(gm.DFLASH_TARGET, d / "target"),
            gm.write_config_only(gm.dflash_drafter_config(), d / "drafter"))


def test_dflash_runs_settings(tmp_path, monkeypatch):
    """Stock and the plugin differ only in PP, the executor and the plugin's utilization; the
    split, mask token, prompts and lengths fit the models."""
    monkeypatch.delenv("GDN_PREFILL_BACKEND", raising=False)
    ks = gpu_runs.dflash_kwargs(tmp_path / "t", tmp_path / "d", 1)
    kp = gpu_runs.dflash_kwargs(tmp_path / "t", tmp_path / "d", 2)
    assert "distributed_executor_backend" not in ks and "pipeline_parallel_size" not in ks
    assert "gpu_memory_utilization" not in ks  # stock keeps vLLM's default and the GPU to itself
    assert kp.pop("distributed_executor_backend") == "dualgpu" and kp.pop("pipeline_parallel_size") == 2
    assert kp.pop("gpu_memory_utilization") == gpu_runs.spec_kwargs(tmp_path)["gpu_memory_utilization"] == 0.3
    assert ks == kp
    assert ks["speculative_config"] == {"method": "dflash", "model": str(tmp_path / "d"), "num_speculative_tokens": 7}
    assert ks["dtype"] == "bfloat16" and ks["enforce_eager"] and ks["enable_prefix_caching"]
    assert ks["load_format"] == "auto" and ks["disable_log_stats"] is False  # real weights; get_metrics works
    assert ks["additional_config"] == {"gdn_prefill_backend": "triton"} and ks["attention_backend"] == "TRITON_ATTN"
    assert gpu_runs.DFLASH_ENV == {"VLLM_PP_LAYER_PARTITION": "4,4"}
    layers = gm.DFLASH_TARGET["num_hidden_layers"]
    assert sum(gm.DFLASH_SPLIT) == layers == 8
    assert gm.DFLASH_TARGET["layer_types"].count("full_attention") == 2  # one attention layer per rank at 4/4
    prompts = gpu_runs.spec_prompts()
    vocab = gm.DFLASH_TARGET["vocab_size"]
    assert max(map(max, prompts)) < gm.DFLASH_MASK_TOKEN_ID < vocab  # the mask is no prompt token
    longest = max(map(len, prompts))
    assert gm.DFLASH_WINDOW < longest  # the drafter's window slides in the long prompt
    assert longest + gpu_runs.DFLASH_MAX_TOKENS + gpu_runs.DFLASH_TOKENS + 1 <= gpu_runs.DFLASH_MAX_MODEL_LEN


def test_dflash_drafter_config_is_the_reference_shape_scaled():
    ref = json.loads(gm.DFLASH_FIXTURE.read_text())
    cfg = gm.dflash_drafter_config()
    t = gm.DFLASH_TARGET
    assert cfg["architectures"] == ref["architectures"] == ["DFlash2DraftModel"] and cfg["model_type"] == "qwen3"
    assert cfg["num_hidden_layers"] == ref["num_hidden_layers"] == 5
    assert cfg["layer_types"] == ref["layer_types"] == ["sliding_attention"] * 5
    assert cfg["is_causal"] is ref["is_causal"] is False
    assert cfg["use_sliding_window"] is ref["use_sliding_window"] is True
    assert cfg["sliding_window"] == gm.DFLASH_WINDOW != ref["sliding_window"] == 2048
    assert cfg["num_target_layers"] == t["num_hidden_layers"] and ref["num_target_layers"] == 64
    assert cfg["quantization_config"] == ref["quantization_config"]
    w = cfg["quantization_config"]["config_groups"]["group_0"]["weights"]
    assert (w["num_bits"], w["group_size"], w["symmetric"], w["strategy"]) == (4, 128, True, "group")
    for k in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size"):
        assert cfg[k] == t[k], k
    # the reference's hidden and MLP widths are its target's too (Qwen3.8-27B-class: 5120, 17408)
    assert (ref["hidden_size"], ref["intermediate_size"]) == (5120, 17408)
    dfl, rdfl = cfg["dflash_config"], ref["dflash_config"]
    assert len(dfl["target_layer_ids"]) == len(rdfl["target_layer_ids"]) == 5
    # the reference's ids: 5 evenly spaced, the last L - 3 ([5, 19, 33, 47, 61] of 64)
    assert rdfl["target_layer_ids"] == list(range(5, 64 - 3 + 1, 14))
    assert dfl["target_layer_ids"] == list(range(1, t["num_hidden_layers"] - 3 + 1))
    assert 0 <= dfl["mask_token_id"] < cfg["vocab_size"] and "swa_window_size" not in dfl
    # the convolutions and the draft block as the reference's; the selector smaller
    for k in ("conv_kernel_size", "conv_group_size", "block_size"):
        assert dfl[k] == rdfl[k], k
    assert (dfl["conv_kernel_size"], dfl["conv_group_size"], dfl["block_size"]) == (2, 16, 1 + gpu_runs.DFLASH_TOKENS)
    assert t["hidden_size"] % dfl["conv_group_size"] == 0
    assert (rdfl["selector_rank"], rdfl["selector_top_k"]) == (256, 16)
    assert (dfl["selector_rank"], dfl["selector_top_k"]) == (32, 8)


@pytest.mark.slow
def test_dflash_configs(engine_config, dflash_dirs, monkeypatch, v2_runner):
    from vllm.distributed.utils import get_pp_indices
    from vllm.model_executor.layers.linear import (
        MergedColumnParallelLinear,
        QKVParallelLinear,
        ReplicatedLinear,
        RowParallelLinear,
    )
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead
    from vllm.model_executor.models.qwen3_dflash import _resolve_layer_attention, dflash_has_any_non_causal
    from vllm.model_executor.models.registry import ModelRegistry
    from vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils import get_eagle3_aux_layers_from_config
    from vllm.v1.worker.gpu.spec_decode.utils import get_parallel_drafting_token_id

    from torch import nn
    from vllm.config import VllmConfig

    for k, v in gpu_runs.DFLASH_ENV.items():  # the plugin run's split, for preflight and get_pp_indices
        monkeypatch.setenv(k, v)
    target, drafter = dflash_dirs
    cfgs = {pp: engine_config(**gpu_runs.dflash_kwargs(target, drafter, pp)) for pp in (1, 2)}
    assert executor(cfgs[2]) == "DualGpuExecutor" and executor(cfgs[1]) != "DualGpuExecutor"
    for pp, cfg in cfgs.items():
        spec, draft, mc = cfg.speculative_config, cfg.speculative_config.draft_model_config, cfg.model_config
        assert cfg.parallel_config.pipeline_parallel_size == pp
        assert mc.architectures == ["Qwen3_5ForCausalLM"] and mc.is_hybrid and str(mc.dtype) == "torch.bfloat16"
        assert cfg.cache_config.enable_prefix_caching and cfg.cache_config.mamba_cache_mode == "align"
        assert spec.method == "dflash" and spec.num_speculative_tokens == gpu_runs.DFLASH_TOKENS
        assert draft.architectures == ["DFlash2DraftModel"] and str(draft.dtype) == "torch.bfloat16"
        entry = ModelRegistry.models.get(draft.architecture)
        assert f"{entry.module_name}.{entry.class_name}" == gm.DFLASH_DRAFTER_CLASS
        # the V2 runner (the DFlash2Speculator's) takes every feature of both runs, so CUDA picks it
        # with VLLM_USE_V2_MODEL_RUNNER unset (config/vllm.py:758-767); V1 refuses the drafter
        assert v2_runner_refuses(cfg) == []
        if hasattr(cfg, "_get_v1_model_runner_unsupported_features"):  # vLLM 0.34 has no V1 runner
            assert "DFlash candidate-head drafts" in cfg._get_v1_model_runner_unsupported_features()
        assert draft.quantization == "compressed-tensors" and mc.quantization is None
        hf = draft.hf_config
        assert get_parallel_drafting_token_id(hf) == gm.DFLASH_MASK_TOKEN_ID < mc.get_vocab_size()
        assert dflash_has_any_non_causal(hf)  # is_causal false: vLLM asks for a non-causal backend
        assert [_resolve_layer_attention(hf, i) for i in range(5)] == [(gm.DFLASH_WINDOW, False)] * 5
        assert hf.dflash_config["selector_top_k"] == gm.DFLASH_SELECTOR_TOP_K
        assert hf.hidden_size == mc.get_hidden_size() and draft.get_vocab_size() == mc.get_vocab_size()
        assert cfg.model_config.max_model_len == gpu_runs.DFLASH_MAX_MODEL_LEN
    # the drafter's quantization as its workers build it: W4A16 on every linear layer, the
    # convolutions' kernel projections and fc too (the selector's projection is built without it)
    cfg = cfgs[2]
    qc = VllmConfig.get_quantization_config(cfg.speculative_config.draft_model_config, cfg.load_config)
    assert type(qc).__name__ == "CompressedTensorsConfig"

    def scheme(cls, prefix):
        layer = cls.__new__(cls)  # get_quant_method looks at the class and the prefix only
        nn.Module.__init__(layer)
        m = qc.get_quant_method(layer, prefix)
        return getattr(layer, "scheme", None) if m is not None else None

    first = f"model.layers.{gm.DFLASH_TARGET['num_hidden_layers']}"  # the drafter's layers follow the target's
    for cls, prefix in ((QKVParallelLinear, f"{first}.self_attn.qkv_proj"), (RowParallelLinear, f"{first}.self_attn.o_proj"),
                        (MergedColumnParallelLinear, f"{first}.mlp.gate_up_proj"),
                        (RowParallelLinear, f"{first}.mlp.down_proj"), (ReplicatedLinear, "model.fc"),
                        (ReplicatedLinear, f"{first}.attention_conv.kernel_projection"),
                        (ReplicatedLinear, f"{first}.mlp_conv.kernel_projection")):
        s = scheme(cls, prefix)
        assert type(s).__name__ == "CompressedTensorsWNA16", prefix
        assert (s.num_bits, s.group_size, s.symmetric, str(s.quant_type)) == (4, 128, True, "uint4b8"), prefix
    assert scheme(ParallelLMHead, "lm_head") is None
    # the aux states: vLLM reads target_layer_ids + 1; at 4/4 rank 0 captures 2, 3, 4 and relays them
    aux = get_eagle3_aux_layers_from_config(cfg.speculative_config)
    assert list(aux) == [i + 1 for i in gm.DFLASH_TARGET_LAYER_IDS] == [2, 3, 4, 5, 6]
    n = cfg.model_config.get_total_num_hidden_layers()
    bounds = [get_pp_indices(n, r, 2) for r in range(2)]
    assert bounds == [(0, 4), (4, 8)]
    ranks = gm.aux_layer_ranks(aux, bounds)
    assert ranks == {2: 0, 3: 0, 4: 0, 5: 1, 6: 1}
    relayed = [i for i, r in ranks.items() if r == 0]
    assert len(relayed) == bisect.bisect_right(aux, bounds[1][0]) == 3  # rank 1's slots for rank 0's states
    assert preflight.check(cfg, 2) == []  # as with two GPUs visible
    assert preflight.aux_relay_problem(cfg.model_config.architectures) == ""


@pytest.mark.slow
def test_dflash_plan_on_the_virtual_pair(engine_config, dflash_dirs, monkeypatch, tmp_path, v2_runner):
    """The executor's plan for the plugin run on the CPU: NVML faked as the one H200 of a GPU
    machine, the virtual pair the harness asks for (gpu_harness.pair_env), the engine's patches
    applied as in EngineCore. Split 4/4 as pinned; the plan file and the executor's line give one
    pool, which vLLM's (patched) KV planning gives the plan's KV budgets; the drafter, its weights
    and the 3 relayed states are charged to rank 1."""
    import os

    from gpu_harness import virtual_spec
    from plan_match import Lines

    from vllm_dualgpu import plugin
    from vllm_dualgpu import envs
    from vllm_dualgpu.engine import kv_pricing
    from vllm_dualgpu.engine import planning as apply
    from vllm_dualgpu.nvml import VisibleGpu
    from vllm_dualgpu.patches.kv_cache_utils import kv_cache_configs
    from vllm_dualgpu.process import ENGINE

    plugin.ensure(frozenset({ENGINE}))
    gib = 1024**3
    h200 = VisibleGpu(0, "NVIDIA H200", int(140.4 * gib), 139 * gib, (9, 0), 4800.0, "GPU-a")
    monkeypatch.setattr(apply, "read_visible_gpus", lambda: [h200])
    for var in ("VLLM_DUALGPU_RESERVE", "CUDA_VISIBLE_DEVICES", "VLLM_DUALGPU_OBJECTIVE"):
        monkeypatch.delenv(var, raising=False)
    plan_file = tmp_path / "plan.json"
    env = {**gpu_runs.DFLASH_ENV, "VLLM_DUALGPU_VIRTUAL_GPUS": virtual_spec(), "VLLM_DUALGPU_PLAN_FILE": str(plan_file)}
    saved = dict(os.environ)
    os.environ.update(env)
    log = logging.getLogger("vllm.dualgpu")
    lines, level = Lines(), log.level
    try:
        cfg = engine_config(**gpu_runs.dflash_kwargs(*dflash_dirs, 2))
        cfg.parallel_config.worker_cls = apply.STOCK_WORKER  # as on a GPU machine; the plan replaces it
        log.addHandler(lines)
        log.setLevel(logging.INFO)
        applied = apply.apply_plan(cfg)
    finally:
        log.removeHandler(lines)
        log.setLevel(level)
        os.environ.clear()
        os.environ.update(saved)
        envs.forget_exports()
    plan = applied.plan
    assert plan.partition == gm.DFLASH_SPLIT and cfg.parallel_config.assigned_physical_gpu_ids == [0, 0]
    assert [g.capability for g in applied.gpus] == [(8, 9), (9, 0)]  # the drafter's rank presents SM 9.0
    logged = [m for m in lines.messages if m.startswith("vllm-dualgpu plan: ")]
    assert len(logged) == 1 and f"predicted KV pool {plan.num_blocks:,} blocks" in logged[0], logged
    written = json.loads(plan_file.read_text())
    assert written["num_blocks"] == plan.num_blocks > 0 and written["partition"] == gm.DFLASH_SPLIT
    assert written["drafter"]["method"] == "dflash" and written["drafter"]["kv_layers"] == 5
    assert written["drafter"]["sliding_window"] == gm.DFLASH_WINDOW
    assert not [m for m in lines.messages if "vLLM's functions give this split" in m], lines.messages
    r0, r1 = written["ranks"]
    assert "drafter" in r1["fixed_detail"] and "drafter" not in r0["fixed_detail"]
    # rank 1 receives rank 0's three aux states with every batch: tokens x hidden x 2 bytes each
    hidden, tokens = gm.DFLASH_TARGET["hidden_size"], cfg.scheduler_config.max_num_batched_tokens
    assert r1["reserve_detail"]["pp_receive_aux"] == 3 * tokens * hidden * 2
    assert "pp_receive_aux" not in r0["reserve_detail"]
    # vLLM's (patched) run-time planning of the plan's KV budgets gives the plan's pool and groups
    specs = kv_pricing.rank_specs(kv_pricing.layer_specs(cfg, plan.kv), plan.kv, plan.partition)
    with kv_pricing._layout_resolved(cfg):
        configs = kv_cache_configs(cfg, specs, [r.kv_budget_bytes for r in plan.ranks])
    assert [c.num_blocks for c in configs] == [plan.num_blocks] * 2
    assert [len(c.kv_cache_groups) for c in configs] == [len(written["kv_cache"]["groups"])] * 2
    assert len(written["kv_cache"]["groups"]) == len(plan.kv.groups)


@pytest.fixture(scope="module")
def dflash_drafter_dir(tmp_path_factory):
    return gm.write_dflash_drafter(tmp_path_factory.mktemp("dflash-drafter") / "drafter")


def vllm_ops_or_skip(cfg) -> None:
    """Building vLLM's model layers may need its compiled ops: on vLLM 0.30.0's CPU platform
    SiluAndMul takes torch.ops._C.silu_and_mul at construction, which its CUDA build does not
    register next to the CPU build of torch (0.33's takes it only on CUDA)."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.activation import SiluAndMul

    try:
        with set_current_vllm_config(cfg):
            SiluAndMul()
    except AttributeError as exc:
        pytest.skip(f"vLLM's model layers cannot be built here ({exc}: vLLM 0.30.0's compiled ops with the "
                    "CPU build of torch)")


def dflash_drafter_on_cpu(engine_config, dflash_dirs, drafter_dir, monkeypatch):
    """The stock run's config (the V2 runner's, as on the GPU) and vLLM's DFlash2Qwen3ForCausalLM
    built from it on the CPU (one TP and PP rank); skipped where vLLM's layers cannot be built."""
    from types import SimpleNamespace

    from vllm.config import set_current_vllm_config
    from vllm.distributed import parallel_state
    from vllm.model_executor.models.qwen3_dflash2 import DFlash2Qwen3ForCausalLM
    from vllm.utils.torch_utils import set_default_torch_dtype

    v2_runner_or_skip(monkeypatch)  # vLLM's V1 runner refuses DFlash2
    cfg = engine_config(**gpu_runs.dflash_kwargs(dflash_dirs[0], drafter_dir, 1))
    vllm_ops_or_skip(cfg)
    monkeypatch.setattr(parallel_state, "_TP", SimpleNamespace(world_size=1, rank_in_group=0))
    monkeypatch.setattr(parallel_state, "_PP", SimpleNamespace(world_size=1, rank_in_group=0, is_first_rank=True,
                                                               is_last_rank=True))
    with set_current_vllm_config(cfg), set_default_torch_dtype(cfg.model_config.dtype):
        return cfg, DFlash2Qwen3ForCausalLM(vllm_config=cfg, prefix="")


@pytest.mark.slow
def test_dflash_drafter_files_load_into_vllms_class(engine_config, dflash_dirs, dflash_drafter_dir, monkeypatch):
    """vLLM's DFlash2Qwen3ForCausalLM, built on the CPU from the stock run's config, loads the
    written files through its own load_weights: every parameter but those the drafter takes from
    the target (embedding, lm_head), the mask embedding it has no file for and the attention
    layers' KV-cache scales (not in a checkpoint without an fp8 KV cache) is written, the
    stacked q/k/v and gate/up rows are the files' tensors in vLLM's order, the convolutions'
    and the selector's parameters are the files' tensors (the kernel projections packed, the
    selector's projection a plain bf16 weight), and the drafter does not declare an embedding or
    lm_head of its own (so vLLM shares the target's)."""

    from safetensors.torch import load_file
    from vllm.config import set_current_vllm_config

    cfg, model = dflash_drafter_on_cpu(engine_config, dflash_dirs, dflash_drafter_dir, monkeypatch)
    sentinel = -7
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(sentinel)
    files = load_file(str(dflash_drafter_dir / "model.safetensors"))
    with set_current_vllm_config(cfg):
        model.load_weights(files.items())
    shared = ("model.embed_tokens.", "lm_head.", "model.mask_embedding")
    params = dict(model.named_parameters())
    unwritten = [n for n, p in params.items() if bool((p == sentinel).all())]
    assert unwritten and all(n.startswith(shared) or ".attn." in n for n in unwritten), unwritten
    assert {n for n in unwritten if ".attn." not in n} == {"model.embed_tokens.weight", "lm_head.weight",
                                                            "model.mask_embedding"}
    assert not model.has_own_embed_tokens and not model.has_own_lm_head
    assert not model.model.has_separate_mask_embedding
    nl = cfg.speculative_config.draft_model_config.hf_config.num_hidden_layers
    for i in range(nl):
        for fused, parts in (("self_attn.qkv_proj", ("q_proj", "k_proj", "v_proj")),
                             ("mlp.gate_up_proj", ("gate_proj", "up_proj"))):
            where = fused.split(".")[0]
            for suffix in ("weight_packed", "weight_scale"):
                got = params[f"model.layers.{i}.{fused}.{suffix}"]
                want = torch.cat([files[f"layers.{i}.{where}.{p}.{suffix}"] for p in parts])
                assert got.dtype == want.dtype and torch.equal(got, want), (i, fused, suffix)
        for name in ("self_attn.o_proj", "mlp.down_proj", "attention_conv.kernel_projection",
                     "mlp_conv.kernel_projection"):
            for suffix in ("weight_packed", "weight_scale", "weight_shape"):
                assert torch.equal(params[f"model.layers.{i}.{name}.{suffix}"], files[f"layers.{i}.{name}.{suffix}"])
        for conv in ("attention_conv", "mlp_conv"):
            got, want = params[f"model.layers.{i}.{conv}.base_kernel"], files[f"layers.{i}.{conv}.base_kernel"]
            assert got.dtype == want.dtype == torch.bfloat16 and torch.equal(got, want), (i, conv)
            packed = params[f"model.layers.{i}.{conv}.kernel_projection.weight_packed"]
            assert packed.shape == (2 * 2 * 1024 // 16, 1024 // 8)  # out: 2 x taps x hidden / 16
    for name in ("predecessor_codebook", "successor_codebook", "hidden_projection.weight"):
        got, want = params[f"model.candidate_selector.{name}"], files[f"candidate_selector.{name}"]
        assert got.dtype == want.dtype == torch.bfloat16 and torch.equal(got, want), name
    assert params["model.candidate_selector.predecessor_codebook"].shape == (8192, gm.DFLASH_SELECTOR_RANK)
    assert not [n for n in params if n.startswith("model.candidate_selector.hidden_projection.weight_")]
    for suffix in ("weight_packed", "weight_scale", "weight_shape"):
        assert torch.equal(params[f"model.fc.{suffix}"], files[f"fc.{suffix}"])
    assert params["model.fc.weight_packed"].shape == (1024, 5 * 1024 // 8)  # 5 target states in
    assert "model.fc.weight" not in params and "model.layers.0.self_attn.qkv_proj.weight" not in params


@pytest.mark.slow
def test_dflash_drafter_w4a16_runs_machete_on_sm90(engine_config, dflash_dirs, dflash_drafter_dir, monkeypatch):
    """vLLM's kernel choice for each of the drafter's layers on an SM 9.0 CUDA device, asked on
    the CPU: the layer configs vLLM builds for them, and choose_mp_linear_kernel with a platform
    stub that says CUDA 9.0 (the kernels' own checks read only that), the kernels the GPU children
    disable (gpu_harness.PRECOMPILED_KERNELS) disabled. Machete: no FP8 activations for CUTLASS
    W4A8, Machete comes before Marlin and Humming."""
    from types import SimpleNamespace

    from gpu_harness import PRECOMPILED_KERNELS
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.kernels import linear as kernels
    from vllm.model_executor.kernels.linear.mixed_precision import cutlass, machete
    from vllm.platforms.interface import PlatformEnum

    cfg, model = dflash_drafter_on_cpu(engine_config, dflash_dirs, dflash_drafter_dir, monkeypatch)
    layers = {n: m for n, m in model.named_modules() if getattr(m, "scheme", None) is not None}
    assert len(layers) == 5 * (4 + 2) + 1  # qkv, o, gate_up, down and two kernel projections per layer, and fc
    assert sum(n.endswith("conv.kernel_projection") for n in layers) == 5 * 2
    sm90 = SimpleNamespace(_enum=PlatformEnum.CUDA, is_cuda=lambda: True, is_rocm=lambda: False,
                           is_device_capability=lambda c: c == 90,
                           get_device_capability=lambda: SimpleNamespace(major=9, minor=0, to_int=lambda: 90))
    for module in (kernels, cutlass, machete):
        monkeypatch.setattr(module, "current_platform", sm90)
    monkeypatch.setenv("VLLM_DISABLED_KERNELS", PRECOMPILED_KERNELS["VLLM_DISABLED_KERNELS"])
    chosen = {}
    with set_current_vllm_config(cfg):
        for name, m in layers.items():
            config = m.scheme.kernel.config  # vLLM's MPLinearLayerConfig of this layer
            assert config.act_type == torch.bfloat16 and config.group_size == 128 and not config.zero_points
            chosen[name] = kernels.choose_mp_linear_kernel(config, compute_capability=90).__name__
    assert set(chosen.values()) == {"MacheteLinearKernel"}, chosen


# --- the vision tower on the first rank only ---------------------------------------------------------


@pytest.mark.slow
def test_vision_configs(engine_config, tmp_path):
    from transformers import AutoConfig, AutoTokenizer
    from vllm.model_executor.models.registry import ModelRegistry

    from vllm_dualgpu.patches.spec_common import is_dualgpu_pp

    model = gm.write_vision_model(tmp_path / "vision")
    cfg_json = json.loads((model / "config.json").read_text())
    hf, tk = AutoConfig.from_pretrained(str(model)), AutoTokenizer.from_pretrained(str(model))
    ids = {k: tk.convert_tokens_to_ids(t) for k, t in zip(gm.TOKEN_KEYS, gm.VISION_TOKENS)}
    assert all(cfg_json[k] == v for k, v in ids.items()) and all(0 < v < hf.text_config.vocab_size for v in ids.values())
    assert hf.vision_config.depth == 2 and cfg_json["vision_config"]["out_hidden_size"] == cfg_json["text_config"]["hidden_size"]
    assert all(max(p) < min(ids.values()) for p in gpu_runs.vision_prompts())
    for name in ("preprocessor_config.json", "video_preprocessor_config.json", "tokenizer.json"):
        assert (model / name).exists(), name
    for backend in ("dualgpu", "mp"):
        cfg = engine_config(**gpu_runs.vision_kwargs(model, backend))
        mc = cfg.model_config
        cls, _ = ModelRegistry.resolve_model_cls(mc.architectures, mc)
        assert cls.__name__ == "Qwen3_5ForConditionalGeneration" and mc.is_multimodal_model and mc.is_hybrid
        assert mc.uses_mrope and cfg.parallel_config.pipeline_parallel_size == 2
        assert mc.get_multimodal_config().get_limit_per_prompt("image") == 1  # stock builds the tower everywhere
        assert v2_runner_refuses(cfg) == []
        assert executor(cfg) == ("DualGpuExecutor" if backend == "dualgpu" else "mp")
        if backend == "dualgpu":
            assert preflight.check(cfg, 2) == [] and is_dualgpu_pp(cfg)


# --- an INT8-packed embedding --------------------------------------------------------------------------


def test_pack_layout_is_the_kernels():
    """Value c at bits 8 * (c % 4) of word c // 4, stored + 128 (compressed-tensors' pack_to_int32)."""
    q = torch.tensor([[1, 2, -128, 127]], dtype=torch.int32)
    word = 129 | 130 << 8 | 0 << 16 | 255 << 24
    assert gm.pack(q).tolist() == [[word - 2**32]]
    assert torch.equal(gm.unpack(gm.pack(q), 4), q)


def test_quantize_round_trips_and_dequantizes_exactly():
    g = torch.Generator().manual_seed(1)
    w = (torch.randn(64, 256, generator=g) * 0.05).to(torch.bfloat16)
    q, scale = gm.quantize(w)
    assert scale.shape == (64, 256 // gm.GROUP) and scale.dtype == torch.bfloat16
    assert int(q.abs().max()) <= gm.QMAX
    packed = gm.pack(q)
    assert packed.dtype == torch.int32 and packed.shape == (64, 256 // gm.PACK)
    assert torch.equal(gm.unpack(packed, 256), q)
    table = gm.dequantize(packed, scale, 256)
    assert table.dtype == torch.bfloat16
    # Power-of-two scales: the float32 product is already a bf16 value, so no rounding mode matters.
    exact = q.float() * scale.float().repeat_interleave(gm.GROUP, dim=1)
    assert torch.equal(table.float(), exact)
    assert (table.float() - w.float()).abs().max() <= scale.float().max()  # a quantization, not noise


@pytest.fixture(scope="module")
def embed_checkpoints(tmp_path_factory):
    return gm.write_embed_checkpoints(tmp_path_factory.mktemp("embedq"))


def kernel_rows(packed, scale, ids):
    """vLLM's ``_dequant_gather_kernel`` source, run by Triton's interpreter on the CPU (vLLM
    itself disables Triton without a GPU driver), for the rows ``ids``."""
    import ast
    import os
    from pathlib import Path

    import vllm.model_executor.layers.quantization.compressed_tensors as ct

    path = Path(ct.__file__).parent / "compressed_tensors_embedding.py"
    fn = next(n for n in ast.parse(path.read_text()).body
              if isinstance(n, ast.FunctionDef) and n.name == "_dequant_gather_kernel")
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"  # read when triton.jit wraps the function
    try:
        import triton
        import triton.language as tl

        ns = {"triton": triton, "tl": tl}
        exec(compile(ast.Module([fn], []), str(path), "exec"), ns)
    finally:
        if old is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = old
    hidden, groups = packed.shape[1] * gm.PACK, scale.shape[1]
    out = torch.empty(len(ids), hidden, dtype=scale.dtype)
    ns["_dequant_gather_kernel"][(len(ids), 1)](  # the arguments _dequant_gather_triton passes
        ids, packed, scale, out, hidden, packed.shape[1], groups, NUM_BITS=gm.BITS, PACK_FACTOR=gm.PACK,
        GROUP_SIZE=0 if groups == 1 else hidden // groups, BLOCK=min(1 << (hidden - 1).bit_length(), 1024))
    return out


@pytest.mark.slow
def test_embed_checkpoints_pack_what_the_kernel_unpacks(embed_checkpoints):
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
    from safetensors.torch import load_file

    qt = load_file(str(embed_checkpoints["quantized"] / "model.safetensors"))
    dn = load_file(str(embed_checkpoints["dense"] / "model.safetensors"))
    packed, scale = qt[f"{gm.EMBED}.weight_packed"], qt[f"{gm.EMBED}.weight_scale"]
    hidden = int(qt[f"{gm.EMBED}.weight_shape"][1])
    q = gm.unpack(packed, hidden)
    table = dn[f"{gm.EMBED}.weight"]
    assert torch.equal(gm.pack(q), packed) and int(q.min()) >= -gm.OFFSET
    assert torch.equal(pack_to_int32(q.to(torch.int8), gm.BITS), packed)
    assert torch.equal(table.view(torch.int16), gm.dequantize(packed, scale, hidden).view(torch.int16))
    same = sorted(k for k in dn if k in qt and torch.equal(dn[k], qt[k]))
    assert len(same) == len(dn) - 1 == len(qt) - 3  # only the embedding differs
    ids = torch.tensor(sorted({0, 1, len(table) - 1, *range(5, len(table), 97)}))
    assert torch.equal(kernel_rows(packed, scale, ids).view(torch.int16), table[ids].view(torch.int16))
    expected = gm.embed_expected(embed_checkpoints)
    assert expected["param_bytes"]["weight_packed"] * 2 == expected["bf16_table_bytes"]  # int8: half a bf16 table
    assert expected["embedding_bytes"] < expected["bf16_table_bytes"]
    for name in ("model.safetensors", "model-mtp.safetensors"):
        assert (embed_checkpoints["quantized"] / name).exists() and (embed_checkpoints["dense"] / name).exists()
    qcfg = json.loads((embed_checkpoints["quantized"] / "config.json").read_text())
    dcfg = json.loads((embed_checkpoints["dense"] / "config.json").read_text())
    assert qcfg.pop("quantization_config") == gm.EMBED_QUANT_CONFIG and qcfg == dcfg
    assert dcfg["mtp_num_hidden_layers"] == 1


@pytest.mark.slow
def test_embed_engine_configs(engine_config, embed_checkpoints, monkeypatch):
    from torch import nn
    from vllm.config import VllmConfig
    from vllm.model_executor.layers.linear import ColumnParallelLinear, QKVParallelLinear
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

    for k, v in gpu_runs.EMBEDQ_ENV.items():  # the arms' split, for preflight
        monkeypatch.setenv(k, v)
    arms = {"plugin-quantized": ("quantized", "dualgpu"), "plugin-dense": ("dense", "dualgpu"),
            "stock-quantized": ("quantized", "mp")}
    cfgs = {a: engine_config(**gpu_runs.embedq_kwargs(embed_checkpoints[ck], b)) for a, (ck, b) in arms.items()}
    assert [executor(c) for c in cfgs.values()] == ["DualGpuExecutor", "DualGpuExecutor", "mp"]
    assert [c.model_config.quantization for c in cfgs.values()] == ["compressed-tensors", None, "compressed-tensors"]
    for c in cfgs.values():
        assert c.parallel_config.pipeline_parallel_size == 2 and c.speculative_config.method == "mtp"
    for a in ("plugin-quantized", "plugin-dense"):
        assert preflight.check(cfgs[a], 2) == [], a
    dense = cfgs["plugin-dense"].model_config
    assert all(max(x) < dense.get_vocab_size() for x in gpu_runs.embedq_prompts())
    assert max(map(len, gpu_runs.embedq_prompts())) + 32 + gpu_runs.NUM_SPEC <= dense.max_model_len
    cfg = cfgs["plugin-quantized"]
    assert cfg.speculative_config.draft_model_config.quantization == "compressed-tensors"
    qc = VllmConfig._get_quantization_config(cfg.model_config, cfg.load_config)  # as the workers build it
    assert type(qc).__name__ == "CompressedTensorsConfig"

    def method(cls, prefix):
        layer = cls.__new__(cls)  # get_quant_method looks at the class and the prefix only
        nn.Module.__init__(layer)
        m = qc.get_quant_method(layer, prefix)
        return type(m).__name__ if m is not None else None

    assert method(VocabParallelEmbedding, gm.EMBED) == method(VocabParallelEmbedding, "mtp.embed_tokens") \
        == "CompressedTensorsEmbeddingWNA16Int"
    assert method(ParallelLMHead, "lm_head") is None
    assert method(QKVParallelLinear, "model.layers.3.self_attn.qkv_proj") == "UnquantizedLinearMethod"
    assert method(ColumnParallelLinear, "mtp.fc") == "UnquantizedLinearMethod"


def v2_runner_refuses(cfg) -> list:
    """What keeps vLLM from running ``cfg`` on its V2 model runner (the only one that runs these
    drafters under PP): vLLM's list up to 0.33; vLLM 0.34 has no other runner, and no list."""
    features = getattr(cfg, "_get_v2_model_runner_unsupported_features", None)
    return features() if features is not None else []
