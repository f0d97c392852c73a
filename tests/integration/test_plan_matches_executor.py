"""`vllm-dualgpu plan` and the executor ask the planner the same question.

For one `vllm serve` command, the executor builds its PlanRequest from vLLM's real VllmConfig
(engine/planning.plan_request) and `plan` from the same arguments (cli/plan.request_from_args);
both must be the same request and give the same split on the same cards. Issue found this way:
the executor planned with the drafter sharing the target's embedding while `plan` did not, so
an MTP command printed one split and ran another.

The objective is part of the question: with zero flags both take the default ("speed") from the
same environment variable (vllm_dualgpu.envs.objective), and on the bundled reference with the
reference launchers' flags both choose the same split, pool and pool-objective alternative.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
from pathlib import Path

import pytest
from conftest import v2_runner_or_skip

from vllm_dualgpu.cli import plan as cli_plan
from vllm_dualgpu.engine import planning
from vllm_dualgpu.patching.runtime import runtime_assumptions
from vllm_dualgpu.planner import ModelSpec, PlanError, fit, parse_gpus, plan, reference_config

GPUS = "RTX 4070 Ti SUPER:16GiB,RTX 5090:32GiB"
# Fields the executor takes from vLLM's resolved config and `plan` from its arguments, and the
# objective both read from the same environment variable.
SAME = ("objective", "max_model_len", "kv_cache_dtype", "block_size", "max_num_seqs", "max_num_batched_tokens",
        "pp_size", "layer_partition", "num_gpu_blocks_override", "kv_cache_memory_bytes",
        "model_dtype", "enable_prefix_caching", "mamba_cache_dtype", "mamba_ssm_cache_dtype",
        "enforce_eager", "vision_on_every_rank", "drafter_shares_embedding", "kv_grouping", "memory", "xqa")

DENSE = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 2560,
    "intermediate_size": 9728, "num_hidden_layers": 36, "num_attention_heads": 32,
    "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936,
    "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "rope_theta": 1000000,
    "torch_dtype": "bfloat16", "tie_word_embeddings": False,
}
EAGLE3_DRAFT = {
    "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": 2560,
    "intermediate_size": 9728, "num_hidden_layers": 1, "num_attention_heads": 32,
    "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936, "draft_vocab_size": 32000,
    "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "torch_dtype": "bfloat16",
}


# vLLM's CPU platform turns an "auto" SSM state dtype into float32 (platforms/cpu.py), which a
# CUDA run would not: both sides are given it explicitly, so the comparison is the plugin's.
CPU_PLATFORM = ["--mamba-ssm-cache-dtype", "float32"]


def cli_request(model_dir, argv: list[str]):
    """`plan`'s own question for these arguments (cli/plan.ask, what `plan` itself asks)."""
    q = cli_plan.ask([str(model_dir), "--gpus", GPUS, *argv, *CPU_PLATFORM])
    return q.model, q.request


def executor_request(vllm_config):
    model = ModelSpec.from_hf_config(vllm_config.model_config.hf_config.to_dict(),
                                     quantization=vllm_config.model_config.quantization)
    return model, planning.plan_request(vllm_config, None)


def engine_kwargs(argv: list[str]) -> dict:
    """`vllm serve` flags as EngineArgs keywords (the few this test uses)."""
    p = argparse.ArgumentParser()
    p.add_argument("--max-model-len", type=int)
    p.add_argument("--kv-cache-dtype")
    p.add_argument("--max-num-seqs", type=int)
    p.add_argument("--max-num-batched-tokens", type=int)
    p.add_argument("--speculative-config", type=json.loads)
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction)
    p.add_argument("--mamba-ssm-cache-dtype")
    return {k: v for k, v in vars(p.parse_args(argv)).items() if v is not None}


def assert_same(cli, executor):
    (cli_model, cli_req), (ex_model, ex_req) = cli, executor
    differ = {f: (getattr(cli_req, f), getattr(ex_req, f)) for f in SAME
              if getattr(cli_req, f) != getattr(ex_req, f)}
    assert not differ, f"plan and the executor ask different questions (plan, executor): {differ}"
    cs, es = cli_req.speculative or {}, ex_req.speculative or {}
    for key in ("method", "num_speculative_tokens"):
        assert cs.get(key) == es.get(key), key
    gpus = parse_gpus(GPUS)
    a, b = plan(cli_model, gpus, cli_req), plan(ex_model, gpus, ex_req)
    assert (a.order, a.partition, a.num_blocks, a.pool_tokens) == (b.order, b.partition, b.num_blocks, b.pool_tokens)
    assert a.objective == b.objective
    assert a.flashinfer_workspace_bytes == b.flashinfer_workspace_bytes  # what the executor exports
    alt = [(p.pool_alternative.order, p.pool_alternative.partition, p.pool_alternative.num_blocks,
            p.pool_alternative.pool_tokens) if p.pool_alternative else None for p in (a, b)]
    assert alt[0] == alt[1]
    # The predictions agree to 1e-6: the DFlash drafter's config as vLLM gives it to the executor
    # lacks its model_type "qwen3", so the executor counts no q/k norms in it (5 x 2 x 128 x 2 bytes).
    assert a.predicted_decode_ms == pytest.approx(b.predicted_decode_ms, rel=1e-6)
    # the same drafter on both sides (a DFlash2 one by its architecture, which the executor reads
    # from vLLM's draft config)
    assert (a.drafter and a.drafter.name) == (b.drafter and b.drafter.name)
    return a


@pytest.fixture(autouse=True)
def _zero_flags(monkeypatch):
    """No objective or split from the environment: the zero-flag question on both sides."""
    for var in ("VLLM_DUALGPU_OBJECTIVE", "VLLM_PP_LAYER_PARTITION"):
        monkeypatch.delenv(var, raising=False)


@pytest.fixture
def dense_config(tmp_path):
    import vllm.platforms
    from vllm.engine.arg_utils import EngineArgs
    from vllm.platforms.cpu import CpuPlatform

    vllm.platforms._current_platform = CpuPlatform()
    (tmp_path / "config.json").write_text(json.dumps(DENSE))

    def make(argv, **extra):
        return EngineArgs(model=str(tmp_path), load_format="dummy", skip_tokenizer_init=True,
                          pipeline_parallel_size=2, **engine_kwargs(argv + CPU_PLATFORM),
                          **extra).create_engine_config()

    return tmp_path, make


def test_runtime_assumptions_follow_the_registry():
    r = runtime_assumptions("0.30.0")
    assert r.drafter_shares_embedding and r.vision_tower_first_rank_only
    fields = r.request_fields()
    assert set(fields) == {"drafter_shares_embedding", "vision_on_every_rank", "kv_grouping", "memory"}
    assert {k: fields[k] for k in ("drafter_shares_embedding", "vision_on_every_rank", "kv_grouping")} == {
        "drafter_shares_embedding": True, "vision_on_every_rank": False, "kv_grouping": "dualgpu"}
    # vLLM 0.33's entries of the KV grouping patches carry a "-033" suffix: still in force
    assert runtime_assumptions("0.33.0").kv_grouping == "dualgpu"
    # A registry without the drafter patch: the drafter keeps its own copy.
    from vllm_dualgpu.patching.registry import PATCHES

    without = tuple(p for p in PATCHES if p.name != "drafter-shares-target-embed")
    assert not runtime_assumptions("0.30.0", without).drafter_shares_embedding


def test_dense_command(dense_config):
    d, make = dense_config
    argv = ["--max-model-len", "32768", "--kv-cache-dtype", "fp8", "--max-num-seqs", "8",
            "--max-num-batched-tokens", "4096"]
    assert_same(cli_request(d, argv), executor_request(make(argv)))


def test_attention_config_without_xqa(dense_config):
    """vLLM's use_trtllm_attention=false reaches both questions (no XQA workspace is planned)."""
    d, make = dense_config
    argv = ["--max-model-len", "32768", "--kv-cache-dtype", "fp8", "--max-num-seqs", "8",
            "--max-num-batched-tokens", "4096"]
    off = '{"use_trtllm_attention": false}'
    cli = cli_request(d, argv + ["--attention-config", off])
    ex = executor_request(make(argv, attention_config={"use_trtllm_attention": False}))
    assert cli[1].xqa is False and ex[1].xqa is False
    assert_same(cli, ex)
    assert cli_request(d, argv)[1].xqa is True and executor_request(make(argv))[1].xqa is True


@pytest.mark.parametrize("flags,extra,expandable", [
    ([], {}, True),
    (["-tp", "2"], {"tensor_parallel_size": 2}, False),  # vLLM's custom all-reduce: CUDA IPC
    (["-tp", "2", "--disable-custom-all-reduce"], {"tensor_parallel_size": 2, "disable_custom_all_reduce": True},
     True),
])
def test_the_allocator_for_the_workers_is_the_same_answer(dense_config, monkeypatch, flags, extra, expandable):
    """`plan` says what torch allocator the executor gives its workers; both ask
    envs.allocator_choice, `plan` from its flags and the executor from vLLM's config."""
    for var in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        monkeypatch.delenv(var, raising=False)
    d, make = dense_config
    argv = ["--max-model-len", "32768"]
    gpus = GPUS if not extra else f"{GPUS},{GPUS}"  # TP 2 x PP 2: four cards
    cli = cli_plan.ask([str(d), "--gpus", gpus, "-pp", "2", *argv, *flags, *CPU_PLATFORM]).allocator
    cfg = make(argv, **extra)
    # ParallelConfig turns custom all-reduce off where the platform has none (the CPU); CUDA keeps the flag
    cfg.parallel_config.disable_custom_all_reduce = extra.get("disable_custom_all_reduce", False)
    executor = planning.allocator_choice(cfg)
    assert cli == executor and cli.expandable is expandable
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "max_split_size_mb:512")
    cli = cli_plan.ask([str(d), "--gpus", gpus, "-pp", "2", *argv, *flags, *CPU_PLATFORM]).allocator
    assert cli == planning.allocator_choice(cfg) and not cli.expandable


def test_eagle3_command(dense_config, tmp_path_factory):
    d, make = dense_config
    draft = tmp_path_factory.mktemp("eagle3")
    (draft / "config.json").write_text(json.dumps(EAGLE3_DRAFT))
    spec = json.dumps({"method": "eagle3", "model": str(draft), "num_speculative_tokens": 3})
    argv = ["--max-model-len", "16384", "--max-num-seqs", "4", "--max-num-batched-tokens", "2048",
            "--speculative-config", spec]
    try:
        cfg = make(argv)
    except Exception as exc:  # vLLM's CPU platform may refuse a drafter: say so, do not pass
        pytest.fail(f"vLLM did not build the EAGLE3 config on the CPU platform: {exc}")
    result = assert_same(cli_request(d, argv), executor_request(cfg))
    assert result.drafter is not None


def test_mtp_command(qwen3_5_hybrid_config, tmp_path):
    cfg = qwen3_5_hybrid_config(max_model_len=4096, max_num_seqs=4, max_num_batched_tokens=2048,
                                mamba_ssm_cache_dtype="float32", speculative_config={"method": "mtp", "num_speculative_tokens": 3})
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg.model_config.hf_config.to_dict()))
    argv = shlex.split("--max-model-len 4096 --max-num-seqs 4 --max-num-batched-tokens 2048 "
                       "--enable-prefix-caching "
                       "--speculative-config '{\"method\": \"mtp\", \"num_speculative_tokens\": 3}'")
    result = assert_same(cli_request(d, argv), executor_request(cfg))
    assert result.drafter is not None


def test_vllms_flashinfer_workspace_size_is_the_same_question(qwen3_5_hybrid_config, tmp_path, monkeypatch):
    """vLLM allocates its FlashInfer workspace at VLLM_FLASHINFER_WORKSPACE_BUFFER_SIZE bytes (the
    reference launchers set 128 MiB): `plan` and the executor read it from the same environment and
    plan it; unset, they plan the size the executor sets."""
    monkeypatch.setenv("VLLM_FLASHINFER_WORKSPACE_BUFFER_SIZE", str(128 << 20))
    cfg = qwen3_5_hybrid_config(max_model_len=4096, max_num_seqs=4, max_num_batched_tokens=2048,
                                mamba_ssm_cache_dtype="float32")
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg.model_config.hf_config.to_dict()))
    argv = ["--max-model-len", "4096", "--max-num-seqs", "4", "--max-num-batched-tokens", "2048"]
    cli, executor = cli_request(d, argv), executor_request(cfg)
    assert cli[1].memory.flashinfer_workspace_bytes == executor[1].memory.flashinfer_workspace_bytes == 128 << 20
    assert_same(cli, executor)
    monkeypatch.delenv("VLLM_FLASHINFER_WORKSPACE_BUFFER_SIZE")
    cli, executor = cli_request(d, argv), executor_request(cfg)
    # unset: both plan the size the executor will set (planner/memory.py plugin_flashinfer_workspace)
    assert cli[1].memory.flashinfer_workspace_sized and executor[1].memory.flashinfer_workspace_sized
    assert_same(cli, executor)


DRAFTER = Path(__file__).resolve().parents[1] / "fixtures" / "dflash2_drafter_standin.json"
# the public Qwen3.8-27B DFlash2 drafter's config (DFlash2DraftModel: convolutions, a candidate selector)
DFLASH2 = Path(__file__).resolve().parents[1] / "fixtures" / "dflash2_drafter.json"
# The reference launchers' serving flags (docs/headline-analysis.md), drafter aside.
LAUNCHER = ["--max-model-len", "262144", "--kv-cache-dtype", "fp8", "--enable-prefix-caching",
            "--max-num-seqs", "2", "--max-num-batched-tokens", "1024"]


@pytest.fixture(scope="module")
def reference_dirs(tmp_path_factory):
    """The bundled reference (block-FP8, vision) as a checkpoint folder, and the DFlash2 stand-in drafter."""
    d = tmp_path_factory.mktemp("reference")
    cfg = {k: v for k, v in reference_config().items() if k != "_vllm_dualgpu"}
    (d / "target").mkdir()
    (d / "drafter").mkdir()
    (d / "target" / "config.json").write_text(json.dumps(cfg))
    (d / "drafter" / "config.json").write_text(DRAFTER.read_text())
    (d / "dflash2").mkdir()
    (d / "dflash2" / "config.json").write_text(DFLASH2.read_text())
    return d / "target", d / "drafter", d / "dflash2"


@pytest.mark.parametrize("drafter,grouping", [("dflash", "searched"), ("dflash", "own"), ("dflash2", "searched"),
                                              ("mtp", "searched"), ("mtp", "own")])
def test_reference_launcher_same_split_under_the_default_objective(engine_config, reference_dirs, drafter, grouping,
                                                                    monkeypatch):
    """The bundled reference on the reference pair with the launchers' flags and zero flags of
    the plugin's: `plan` and the executor ask with the default objective and choose the same
    split, pool and pool-objective alternative; the split is the fastest predicted among those
    that hold 262,144 tokens, each split priced with the KV grouping the chosen split has
    ("searched") or with its own ("own"). A split's pool is held against a request in its own
    blocks: with the DFlash drafter the splits' groupings differ (5 to 13 groups), and so do the
    size of a block and the blocks a request takes (192 to 566)."""
    import vllm.platforms
    from vllm.platforms.cpu import CpuPlatform

    vllm.platforms._current_platform = CpuPlatform()
    target, draft, draft2 = reference_dirs
    if drafter == "dflash2":  # vLLM refuses it under the V1 runner the CPU platform would pick; GPUs run V2
        v2_runner_or_skip(monkeypatch)
    spec = ({"method": "dflash", "model": str(draft2 if drafter == "dflash2" else draft), "num_speculative_tokens": 7}
            if drafter.startswith("dflash") else {"method": "mtp", "num_speculative_tokens": 3})
    argv = LAUNCHER + ["--speculative-config", json.dumps(spec)]
    cfg = engine_config(model=str(target), load_format="dummy", skip_tokenizer_init=True,
                        pipeline_parallel_size=2, distributed_executor_backend="dualgpu",
                        **engine_kwargs(argv + CPU_PLATFORM))
    cli, ex = cli_request(target, argv), executor_request(cfg)
    assert cli[1].objective == ex[1].objective == "speed"
    result = assert_same(cli, ex)
    assert result.objective == "speed" and result.max_model_len == 262144
    assert result.drafter is not None and result.drafter.num_speculative_tokens == spec["num_speculative_tokens"]
    assert result.drafter.name.startswith("DFlash2 drafter") == (drafter == "dflash2"), result.drafter.name
    # the rule, checked against every split forced on the same question
    model, request = ex
    layout = result.kv if grouping == "searched" else None
    gpus = parse_gpus(GPUS)
    assert result.held_requests == 1

    def roomy_pool(p) -> bool:
        """A request's blocks in the plan's grouping, with the null block, and the 3% to spare the
        rule keeps where a split can."""
        return p.num_blocks >= (p.kv.blocks_per_request(262144) + 1) * 1.03

    holding, roomy = [], []
    for n in range(1, model.num_layers):
        try:
            f = fit(model, gpus, dataclasses.replace(request, layer_partition=[n, model.num_layers - n],
                                                     gpu_order=result.order), kv_layout=layout)
        except PlanError:  # not even one token fits on this split
            continue
        if f.fits:
            holding.append(f.plan.predicted_decode_ms)
            if roomy_pool(f.plan):
                roomy.append(f.plan.predicted_decode_ms)
    if roomy:
        assert roomy_pool(result) and result.predicted_decode_ms <= min(roomy) * 1.005
    else:
        assert result.predicted_decode_ms <= min(holding) * 1.005
