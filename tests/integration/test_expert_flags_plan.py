"""The reference setup's own flags through the dualgpu executor: `plan` and the executor ask the
planner the same question (from the CLI's arguments and from vLLM's config), and the planner's
answer is a pool that runs as set with a warning where its estimates call it tight (issue 28).
This is the pure planner's answer; the executor's pricing with vLLM's own functions is
tests/integration/engine/test_headline_expert_plan.py's.

The DFlash2 launchers as the reference writes them (the bundled reference's FP8 weights, which
the executor reads from the checkpoint): 1,664-token blocks, --kv-cache-memory-bytes
9e9 (vLLM then skips its profile: every rank's grouping sees 9e9 bytes), the launcher's split and
a hand-set pool of one 262,144-token request.

At W8A16's split, 19/45, the package's grouping is the reference's (2 attention groups of 8, 6 Gated
DeltaNet groups of 8, the drafter's window group); a request takes 2 x cdiv(262,144, 1,664) = 2 x
158 attention blocks, 6 x 9 recurrent-state blocks and 5 window blocks, plus vLLM's null block:
376 blocks. The reference's 375 (without the null block) holds 157 attention blocks a group:
157 x 1,664 = 261,248 tokens.

At FP8's split, 21/43, with 9e9 bytes on both ranks the package groups 4 groups of 16 and the window
group: 158 + 3 x 9 + 5 + 1 = 191 blocks. Planned with the stock grouping first (15 groups), that
pool looked larger than the RTX 5090 and the plan refused it before regrouping.
"""

from __future__ import annotations

import json

import pytest

from test_plan_matches_executor import GPUS, cli_request, reference_dirs  # noqa: F401
from vllm_dualgpu.engine import planning
from vllm_dualgpu.planner import ModelSpec, fit, parse_gpus

EXPERT = ["--max-model-len", "262144", "--kv-cache-dtype", "fp8", "--enable-prefix-caching",
          "--max-num-seqs", "2", "--max-num-batched-tokens", "1024", "--block-size", "1664",
          "--kv-cache-memory-bytes", "9000000000"]


@pytest.fixture(autouse=True)
def _no_objective(monkeypatch):
    monkeypatch.delenv("VLLM_DUALGPU_OBJECTIVE", raising=False)


@pytest.mark.parametrize("split,blocks,fits,largest,groups", [
    ([19, 45], 376, True, 262_144, 9), ([19, 45], 375, False, 261_248, 9), ([21, 43], 191, True, 262_144, 5)])
def test_the_experts_pool_is_planned_alike_and_warned_not_refused(engine_config, reference_dirs, monkeypatch,
                                                                    split, blocks, fits, largest, groups):
    target, draft, _ = reference_dirs
    text = ",".join(map(str, split))
    monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", text)
    # vLLM's default FlashInfer workspace, set as a user would: these pools were sized against it
    monkeypatch.setenv("VLLM_FLASHINFER_WORKSPACE_BUFFER_SIZE", str(394 * 2**20))
    spec = {"method": "dflash", "model": str(draft), "num_speculative_tokens": 7}
    argv = EXPERT + [
        "--num-gpu-blocks-override", str(blocks), "--speculative-config", json.dumps(spec), "--layer-partition", text]
    cli_model, cli_req = cli_request(target, argv)
    cfg = engine_config(model=str(target), load_format="dummy", skip_tokenizer_init=True, pipeline_parallel_size=2,
                        distributed_executor_backend="dualgpu", max_model_len=262144, kv_cache_dtype="fp8",
                        enable_prefix_caching=True, max_num_seqs=2, max_num_batched_tokens=1024, block_size=1664,
                        kv_cache_memory_bytes=9_000_000_000, num_gpu_blocks_override=blocks,
                        speculative_config=spec, mamba_ssm_cache_dtype="float32")
    # the executor's question: its request with the split the front end captured (the environment)
    ex_model = ModelSpec.from_hf_config(cfg.model_config.hf_config.to_dict(), quantization=cfg.model_config.quantization)
    ex_req = planning.plan_request(cfg, planning._settings(cfg)["user_partition"])
    for field in ("layer_partition", "num_gpu_blocks_override", "kv_cache_memory_bytes", "block_size"):
        assert getattr(cli_req, field) == getattr(ex_req, field), field
    gpus = parse_gpus(GPUS)
    a, b = fit(cli_model, gpus, cli_req), fit(ex_model, gpus, ex_req)
    for f in (a, b):
        assert (f.fits, f.largest_max_model_len) == (fits, largest)
        p = f.plan
        assert p.partition == split and p.num_blocks == blocks and p.block_size == 1664
        assert len(p.kv.groups) == groups
        tight = [n for n in p.warnings if n.startswith(f"--num-gpu-blocks-override {blocks}: rank 0 (RTX 4070 Ti SUPER)"
                                                    " is predicted short by")]
        assert len(tight) == 1 and "lower the override" in tight[0]


SERVING = ["--max-model-len", "262144", "--kv-cache-dtype", "fp8", "--enable-prefix-caching",
           "--max-num-seqs", "2", "--max-num-batched-tokens", "1024"]


def test_the_drafters_attention_backend_reaches_both_plans(engine_config, reference_dirs, monkeypatch):
    """The launchers' DRAFT_ATTN (`"attention_backend": "TRITON_ATTN"` in --speculative-config): a
    drafter off FlashInfer has no FlashInfer workspace of its own on the last rank. `plan` reads the
    flag's JSON and the executor vLLM's SpeculativeConfig: both see the backend and charge the
    last rank alike, one workspace less than with the drafter put on FlashInfer."""
    target, draft, _ = reference_dirs
    monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", "19,45")
    base = {"method": "dflash", "model": str(draft), "num_speculative_tokens": 7}
    spec = {**base, "attention_backend": "TRITON_ATTN"}
    gpus = parse_gpus(GPUS)
    cli_model, cli_req = cli_request(target, SERVING + ["--speculative-config", json.dumps(spec),
                                                        "--layer-partition", "19,45"])
    _, cli_flashinfer = cli_request(target, SERVING + ["--speculative-config",
                                                       json.dumps({**base, "attention_backend": "FLASHINFER"}),
                                                       "--layer-partition", "19,45"])
    cfg = engine_config(model=str(target), load_format="dummy", skip_tokenizer_init=True, pipeline_parallel_size=2,
                        distributed_executor_backend="dualgpu", max_model_len=262144, kv_cache_dtype="fp8",
                        enable_prefix_caching=True, max_num_seqs=2, max_num_batched_tokens=1024,
                        speculative_config=spec, mamba_ssm_cache_dtype="float32")
    ex_model = ModelSpec.from_hf_config(cfg.model_config.hf_config.to_dict(), quantization=cfg.model_config.quantization)
    ex_req = planning.plan_request(cfg, planning._settings(cfg)["user_partition"])
    assert str(ex_req.speculative.get("attention_backend", "")).upper().endswith("TRITON_ATTN"), ex_req.speculative
    cli, ex, on_flashinfer = (fit(m, gpus, r).plan for m, r in
                              ((cli_model, cli_req), (ex_model, ex_req), (cli_model, cli_flashinfer)))
    assert cli.ranks[-1].reserve_bytes == ex.ranks[-1].reserve_bytes
    # one workspace: the executor's 97 MiB for this shape (tests/unit/planner/test_flashinfer_workspace.py)
    assert on_flashinfer.ranks[-1].reserve_bytes - cli.ranks[-1].reserve_bytes == 97 * 2**20
    assert on_flashinfer.ranks[0].reserve_bytes == cli.ranks[0].reserve_bytes  # the drafter is on the last rank


def test_zero_flags_put_the_dflash_drafter_where_the_plan_does(engine_config, reference_dirs, monkeypatch):
    """No backend chosen: the executor sets the DFlash drafter's attention backend by the
    planner's rule before the workers start (the target on FlashInfer: mismatched capabilities,
    fp8 KV), and its plan then charges the last rank what `plan` charges for the same flags."""
    from vllm_dualgpu.engine.attention_backend import apply_common_backend, apply_drafter_backend

    target, draft, _ = reference_dirs
    monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", "19,45")
    spec = {"method": "dflash", "model": str(draft), "num_speculative_tokens": 7}
    cli_model, cli_req = cli_request(target, SERVING + ["--speculative-config", json.dumps(spec),
                                                        "--layer-partition", "19,45"])
    cfg = engine_config(model=str(target), load_format="dummy", skip_tokenizer_init=True, pipeline_parallel_size=2,
                        distributed_executor_backend="dualgpu", max_model_len=262144, kv_cache_dtype="fp8",
                        enable_prefix_caching=True, max_num_seqs=2, max_num_batched_tokens=1024,
                        speculative_config=spec, mamba_ssm_cache_dtype="float32")
    assert cfg.speculative_config.attention_backend is None
    caps = [g.capability for g in parse_gpus(GPUS)]
    apply_common_backend(cfg, caps)  # FlashInfer for the target on vLLM 0.33 (0.30 leaves it to vLLM)
    target = cfg.attention_config.backend
    assert apply_drafter_backend(cfg, caps) == "TRITON_ATTN"
    assert cfg.speculative_config.attention_backend.name == "TRITON_ATTN"
    assert cfg.attention_config.backend == target  # the target's stays
    assert apply_drafter_backend(cfg, caps) is None  # now chosen: left as it is
    ex_model = ModelSpec.from_hf_config(cfg.model_config.hf_config.to_dict(), quantization=cfg.model_config.quantization)
    ex_req = planning.plan_request(cfg, planning._settings(cfg)["user_partition"])
    gpus = parse_gpus(GPUS)
    cli, ex = fit(cli_model, gpus, cli_req).plan, fit(ex_model, gpus, ex_req).plan
    assert cli.ranks[-1].reserve_bytes == ex.ranks[-1].reserve_bytes
    assert cli.ranks[-1].reserve_detail["flashinfer_workspace"] == 97 * 2**20  # the target's only


def test_an_mtp_drafter_keeps_the_targets_backend(engine_config, reference_dirs):
    from vllm_dualgpu.engine.attention_backend import apply_drafter_backend

    target, _, _ = reference_dirs
    cfg = engine_config(model=str(target), load_format="dummy", skip_tokenizer_init=True, pipeline_parallel_size=2,
                        distributed_executor_backend="dualgpu", max_model_len=262144, kv_cache_dtype="fp8",
                        max_num_seqs=2, max_num_batched_tokens=1024,
                        speculative_config={"method": "mtp", "num_speculative_tokens": 3})
    assert apply_drafter_backend(cfg, [g.capability for g in parse_gpus(GPUS)]) is None
    assert cfg.speculative_config.attention_backend is None
