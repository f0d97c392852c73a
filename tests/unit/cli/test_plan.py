"""``vllm-dualgpu plan``: the reference table, JSON, --gpus, a model path, and every error exit."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from vllm_dualgpu.cli import main
from vllm_dualgpu.planner import MemoryModel, ModelSpec, PlanRequest, parse_gpus, plan, reference_config

TINY = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 256, "intermediate_size": 512,
    "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 1024,
    "max_position_embeddings": 4096, "torch_dtype": "bfloat16", "tie_word_embeddings": False,
}


@pytest.fixture(autouse=True)
def _no_reserve_env(monkeypatch):
    """The hand-computed cases below keep nothing free unless they say reserve=."""
    monkeypatch.setenv("VLLM_DUALGPU_RESERVE", "0")


@pytest.fixture(autouse=True)
def _no_partition_env(monkeypatch):
    monkeypatch.delenv("VLLM_PP_LAYER_PARTITION", raising=False)


def run_cli(capsys, *argv):
    rc = main(["plan", *argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_no_arguments_prints_the_reference_table_quickly():
    env = {k: v for k, v in os.environ.items() if k != "VLLM_PP_LAYER_PARTITION"}
    t = time.perf_counter()
    r = subprocess.run(
        [sys.executable, "-c", "from vllm_dualgpu.cli import main; raise SystemExit(main(['plan']))"],
        capture_output=True, text=True, env=env, timeout=60,
    )
    elapsed = time.perf_counter() - t
    assert r.returncode == 0, r.stderr
    assert elapsed < 2.0, elapsed
    out = r.stdout
    assert "Qwen3.8-27B-class" in out and "48 Gated DeltaNet + 16 full attention" in out
    assert "[1] RTX 4070 Ti SUPER" in out and "[0] RTX 5090" in out
    assert "2,048 bytes per token per attention layer" in out  # fp8 KV: 4 heads x 512 x 1 byte
    assert "--max-model-len 262,144" in out
    assert "CUDA_VISIBLE_DEVICES=1,0 VLLM_PP_LAYER_PARTITION=" in out
    assert "--distributed-executor-backend dualgpu" in out
    assert "Stock vLLM, as 0.30.0 sizes it" in out


def test_json_output_matches_the_planner(capsys):
    rc, out, _ = run_cli(capsys, "--json")
    assert rc == 0
    d = json.loads(out)
    # The reference pair with VLLM_DUALGPU_RESERVE=0 (the autouse fixture), planned with the
    # reference setup's single-user serving flags: fp8 KV, 2 sequences, 1,024 batched tokens.
    want = plan(ModelSpec.from_hf_config(reference_config()), parse_gpus("RTX 5090,RTX 4070 Ti SUPER"),
                PlanRequest(kv_cache_dtype="fp8", max_num_seqs=2, max_num_batched_tokens=1024,
                            memory=MemoryModel(flashinfer_workspace_sized=True)))  # the executor's size
    assert d["plan"]["partition"] == want.partition and d["plan"]["order"] == [1, 0]
    assert d["plan"]["num_blocks"] == want.num_blocks
    assert (d["plan"]["max_num_seqs"], d["plan"]["max_num_batched_tokens"]) == (2, 1024)
    assert "--max-num-seqs 2 --max-num-batched-tokens 1024" in d["command"]
    assert d["plan"]["ranks"][1]["gpu"]["name"] == "RTX 5090"
    assert d["stock"]["partition"] == [32, 32]
    assert d["command"].startswith("vllm serve MODEL --pipeline-parallel-size 2")


def test_gpus_and_a_model_directory(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    gpus = "A:6GiB:bw=2000,B:8GiB:5GiB:bw=500"
    rc, out, _ = run_cli(capsys, str(tmp_path), "--gpus", gpus, "--max-model-len", "1k", "--json")
    assert rc == 0, out
    d = json.loads(out)["plan"]
    assert d["max_model_len"] == 1000  # vLLM's human-readable ints: 1k = 1000
    assert [r["gpu"]["name"] for r in d["ranks"]] == ["B", "A"]  # A has more free memory: last
    assert d["ranks"][0]["gpu"]["free_bytes"] == 5 << 30
    want = plan(ModelSpec.from_hf_config(TINY), parse_gpus(gpus), PlanRequest(max_model_len=1000))
    assert (d["partition"], d["num_blocks"]) == (want.partition, want.num_blocks)


def test_model_path_config_json_and_speculative(tmp_path, capsys):
    cfg = {k: v for k, v in reference_config().items() if k != "_vllm_dualgpu"}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    rc, out, _ = run_cli(
        capsys, str(tmp_path / "config.json"), "--gpus", "RTX 4070 Ti SUPER,RTX 5090", "--kv-cache-dtype", "fp8",
        "--max-model-len", "131072", "--speculative-config", '{"method": "mtp", "num_speculative_tokens": 3}',
    )
    assert rc == 0
    assert "block 1600 tokens" in out  # 3 speculative tokens widen the conv state (see the KV tests)
    assert "Speculative decoding: 1 MTP layer(s), 3 tokens" in out
    # The executor's drafter shares the target's embedding (drafter-shares-target-embed): the
    # plan assumes the same and charges no copy (it did, and printed another split than ran).
    assert "drafter's embedding copy" not in out
    assert f"vllm serve {tmp_path / 'config.json'}" in out


def test_draft_model_config_is_read_from_its_directory(tmp_path, capsys):
    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text(json.dumps({k: v for k, v in reference_config("qwen3-14b").items()}))
    draft = tmp_path / "draft"
    draft.mkdir()
    (draft / "config.json").write_text(json.dumps(dict(TINY, hidden_size=5120, vocab_size=151936, num_hidden_layers=2)))
    spec = json.dumps({"method": "eagle3", "model": str(draft), "num_speculative_tokens": 3})
    rc, out, _ = run_cli(capsys, str(target), "--gpus", "RTX 4090,RTX 3090", "--max-model-len", "8192",
                         "--speculative-config", spec, "--json")
    assert rc == 0, out
    d = json.loads(out)["plan"]
    assert d["drafter"]["kv_layers"] == 2 and d["kv_cache"]["grouping"] == "uniform-type"
    assert "drafter" in d["ranks"][-1]["fixed_detail"]
    missing = json.dumps({"method": "eagle3", "model": str(tmp_path / "nope"), "num_speculative_tokens": 3})
    rc, _, err = run_cli(capsys, str(target), "--gpus", "RTX 4090,RTX 3090", "--speculative-config", missing)
    assert rc == 2 and "cannot find" in err


def test_context_too_long_prints_the_largest_that_fits(capsys):
    rc, _, err = run_cli(capsys, "--kv-cache-dtype", "auto")
    assert rc == 1
    assert "--max-model-len 262,144 does not fit: the largest that fits is" in err
    largest = int(err.split("the largest that fits is ")[1].split(" ")[0].replace(",", ""))
    rc, out, _ = run_cli(capsys, "--kv-cache-dtype", "auto", "--max-model-len", str(largest))
    assert rc == 0 and f"--max-model-len {largest:,}" in out
    rc, _, _ = run_cli(capsys, "--kv-cache-dtype", "auto", "--max-model-len", str(largest + 1))
    assert rc == 1
    rc, out, _ = run_cli(capsys, "--kv-cache-dtype", "auto", "--json")
    d = json.loads(out)
    assert rc == 1 and d["error"] == "ContextTooLong" and d["largest_fitting_max_model_len"] == largest


def test_model_that_does_not_fit_names_the_rank(capsys):
    rc, _, err = run_cli(capsys, "--gpus", "RTX 4060 Ti:8GiB,RTX 3060")
    assert rc == 1
    assert "the model does not fit: rank" in err and "is short by" in err and "GiB" in err
    rc, out, _ = run_cli(capsys, "--gpus", "RTX 4060 Ti:8GiB,RTX 3060", "--json")
    d = json.loads(out)
    assert d["error"] == "ModelDoesNotFit" and d["short_bytes"] > 0 and d["rank"] in (0, 1)


def test_pp1_and_one_gpu_run_as_stock(capsys):
    rc, out, _ = run_cli(capsys, "-pp", "1", "--gpus", "H200,RTX 5090")
    assert rc == 0 and "pipeline_parallel_size=1: vLLM runs as stock" in out
    assert "VLLM_PP_LAYER_PARTITION" not in out
    rc, out, _ = run_cli(capsys, "--gpus", "H200", "--json")
    d = json.loads(out)
    assert rc == 0 and d["plan"]["passthrough"] is True and d["plan"]["partition_env"] is None
    # stock on the reference pair puts everything on GPU 0, the 5090: not the 262,144 tokens
    rc, _, err = run_cli(capsys, "-pp", "1")
    assert rc == 1 and "--max-model-len 262,144 does not fit" in err


def test_overrides_from_flags_and_environment(capsys, monkeypatch):
    rc, out, _ = run_cli(capsys, "--layer-partition", "16,48", "--json")
    d = json.loads(out)["plan"]
    assert rc == 0 and d["partition"] == [16, 48] and d["overrides"]["layer_partition"] == "16,48"
    monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", "20,44")
    rc, out, _ = run_cli(capsys)
    assert rc == 0 and "User overrides honoured: layer_partition=20,44" in out
    monkeypatch.delenv("VLLM_PP_LAYER_PARTITION")
    rc, out, _ = run_cli(capsys, "--gpu-order", "0,1", "--max-model-len", "65536", "--json")
    assert rc == 0 and json.loads(out)["plan"]["order"] == [0, 1]


def test_bad_arguments_exit_2(capsys):
    for argv, msg in [
        (["--gpus", "Mystery:oops"], "--gpus: cannot read 'oops' as a memory size"),
        (["--layer-partition", "10,10"], "sums to 20"),
        (["--weight-format", "fp7"], "unknown weight format"),
        (["-tp", "2"], "-tp 2 with -pp 1 is one TP group"),  # the reference pair: two cards
        (["/nonexistent/model"], "cannot find"),
        (["--reference", "llama"], "unknown reference model"),
    ]:
        rc, _, err = run_cli(capsys, *argv)
        assert rc == 2, (argv, err)
        assert msg in err, (argv, err)
    with pytest.raises(SystemExit):
        main(["plan", "--speculative-config", "{not json"])


def test_gpus_without_reserve_get_the_executors_default(capsys, monkeypatch):
    """plan keeps free what the executor would: VLLM_DUALGPU_RESERVE, else 1 GiB a card."""
    monkeypatch.delenv("VLLM_DUALGPU_RESERVE")
    # 131,072 tokens: a length the pair holds with 3 GiB kept free (the model's 262,144 does not,
    # now that both ranks hold the 2.4 GiB embedding), so the JSON has a plan to read.
    mml = ("--max-model-len", "131072")
    rc, out, _ = run_cli(capsys, "--gpus", "RTX 4070 Ti SUPER,RTX 5090:reserve=2GiB", *mml, "--json")
    assert rc == 0, out
    ranks = {r["gpu"]["name"]: r["gpu"]["reserve_bytes"] for r in json.loads(out)["plan"]["ranks"]}
    assert ranks == {"RTX 4070 Ti SUPER": 1 << 30, "RTX 5090": 2 << 30}
    monkeypatch.setenv("VLLM_DUALGPU_RESERVE", "512MiB,0")
    rc, out, _ = run_cli(capsys, "--gpus", "RTX 4070 Ti SUPER,RTX 5090", *mml, "--json")
    assert rc == 0, out
    ranks = {r["gpu"]["name"]: r["gpu"]["reserve_bytes"] for r in json.loads(out)["plan"]["ranks"]}
    assert ranks == {"RTX 4070 Ti SUPER": 512 << 20, "RTX 5090": 0}


def test_an_unsupported_vllm_is_said_and_the_plan_assumes_the_newest(monkeypatch, capsys):
    """plan says what doctor says about a vLLM the dualgpu backend refuses (issue 16)."""
    from vllm_dualgpu import support
    from vllm_dualgpu.patching.runtime import runtime_assumptions

    monkeypatch.setattr(support, "installed_vllm_version", lambda: "0.35.0")
    rc, out, _ = run_cli(capsys, "--max-model-len", "8192")
    assert rc == 0
    assert "Note: vllm-dualgpu 0.1.0 supports vLLM >=0.30.0,<0.35, found 0.35.0" in out
    assert f"this plan assumes vLLM {support.CHECKED_RELEASES[-1]}" in out
    assert runtime_assumptions().vllm_version == support.CHECKED_RELEASES[-1]


@pytest.mark.parametrize("flag,value", [("--decode-context", "65536"), ("--prefer", "latency"),
                                        ("--tp-sizes", "1,2"), ("--route-name", "m")])
def test_a_fleet_option_on_one_pipeline_is_refused_not_ignored(capsys, flag, value):
    """2026-12-04: `plan --decode-context 64` on one pipeline printed the prediction at
    --max-model-len, the flag silently unused (it belongs to fleet plans). The executor predicts at
    --max-model-len, so a single pipeline's plan cannot take it either: refused, saying where it applies."""
    rc, out, err = run_cli(capsys, flag, value)
    assert rc == 2 and out == ""
    first = err.splitlines()[0]
    assert first.startswith(f"vllm-dualgpu plan: {flag} is a fleet option"), first
    assert "--fleet" in first and "';'" in first
