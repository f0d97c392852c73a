"""`vllm-dualgpu plan -pp 2 -tp 2` prints the plan the executor applies for the same command:
the same TP stages, the same GPU of every vLLM rank, the same split and KV pool
(test_plan_matches_executor.py holds the two requests together for TP 1)."""

from __future__ import annotations

import json

import pytest
from plan_match import sandbox
from test_plan_matches_executor import DENSE  # the same dense model as the TP-1 test

from vllm_dualgpu.cli import main
from vllm_dualgpu.engine import handoff
from vllm_dualgpu.engine import planning as apply
from vllm_dualgpu.nvml import VisibleGpu
from vllm_dualgpu.planner import parse_gpus

# Two kinds interleaved in PCI order: the stages are the 4070 Ti SUPERs (1, 3) and the 5090s (0, 2).
GPUS = ("RTX 5090:32GiB:30GiB,RTX 4070 Ti SUPER:16GiB:15GiB,"
        "RTX 5090:32GiB:30GiB,RTX 4070 Ti SUPER:16GiB:15GiB")
SERVE = {"max_model_len": 32768, "max_num_seqs": 8, "max_num_batched_tokens": 4096,
         "kv_cache_dtype": "fp8", "mamba_ssm_cache_dtype": "float32"}  # CPU platform: see the TP-1 test
EAGLE3_DRAFT = {
    "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": 2560,
    "intermediate_size": 9728, "num_hidden_layers": 1, "num_attention_heads": 32,
    "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936, "draft_vocab_size": 32000,
    "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "torch_dtype": "bfloat16",
}


@pytest.fixture
def model_dir(tmp_path, monkeypatch):
    yield from sandbox(tmp_path, monkeypatch, DENSE)


def plan_json(model_dir, capsys, serve=SERVE) -> dict:
    argv = ["plan", str(model_dir), "-pp", "2", "-tp", "2", "--gpus", GPUS, "--json"]
    for k, v in serve.items():
        argv += [f"--{k.replace('_', '-')}", json.dumps(v) if isinstance(v, dict) else str(v)]
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


def executor_apply(model_dir, monkeypatch, serve=SERVE):
    import vllm.platforms
    from vllm.engine.arg_utils import EngineArgs
    from vllm.platforms.cpu import CpuPlatform

    import vllm_dualgpu
    from vllm_dualgpu.engine import preflight

    vllm.platforms._current_platform = CpuPlatform()
    vllm_dualgpu.register()
    monkeypatch.setattr(preflight, "nvml_gpu_count", lambda: 4)
    cfg = EngineArgs(model=str(model_dir), load_format="dummy", skip_tokenizer_init=True,
                     pipeline_parallel_size=2, tensor_parallel_size=2,
                     distributed_executor_backend="dualgpu", **serve).create_engine_config()
    cfg.parallel_config.worker_cls = apply.STOCK_WORKER
    # NVML would report the same cards the --gpus line describes.
    seen = [VisibleGpu(g.index, g.name, g.total_bytes, g.free_bytes, g.capability, g.bandwidth_gbps, f"GPU-{g.index}")
            for g in parse_gpus(GPUS)]
    monkeypatch.setattr(apply, "read_visible_gpus", lambda: seen)
    return cfg, apply.apply_plan(cfg)


def test_plan_and_executor_agree_on_tp_stages(model_dir, capsys, monkeypatch):
    printed = plan_json(model_dir, capsys)
    cfg, applied = executor_apply(model_dir, monkeypatch)
    ranks = printed["tp"]["ranks"]
    assert [r["gpu"] for r in ranks] == cfg.parallel_config.assigned_physical_gpu_ids == [1, 3, 0, 2]
    assert [(r["stage"], r["tp_rank"]) for r in ranks] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert printed["plan"]["cuda_visible_devices"] == "1,3,0,2"
    assert printed["plan"]["partition"] == list(applied.plan.partition)
    assert printed["plan"]["num_blocks"] == applied.plan.num_blocks
    assert printed["plan"]["max_model_len"] == applied.plan.max_model_len == 32768
    record = handoff.load(cfg)
    assert [r.num_layers for r in record.ranks] == [printed["plan"]["partition"][r["stage"]] for r in ranks]
    assert "--pipeline-parallel-size 2 --tensor-parallel-size 2 --distributed-executor-backend dualgpu" in printed["command"]


def test_plan_and_executor_agree_with_an_eagle3_drafter(model_dir, capsys, monkeypatch, tmp_path_factory):
    draft = tmp_path_factory.mktemp("eagle3")
    (draft / "config.json").write_text(json.dumps(EAGLE3_DRAFT))
    serve = {**SERVE, "max_model_len": 16384,
             "speculative_config": {"method": "eagle3", "model": str(draft), "num_speculative_tokens": 3}}
    printed = plan_json(model_dir, capsys, serve)
    cfg, applied = executor_apply(model_dir, monkeypatch, serve)
    assert cfg.speculative_config.draft_tensor_parallel_size == 2  # vLLM's default: the target's
    assert printed["plan"]["partition"] == list(applied.plan.partition)
    assert printed["plan"]["num_blocks"] == applied.plan.num_blocks
    assert printed["plan"]["drafter"]["weight_bytes"] == applied.plan.drafter.weight_bytes
    assert [r["gpu"] for r in printed["tp"]["ranks"]] == cfg.parallel_config.assigned_physical_gpu_ids
