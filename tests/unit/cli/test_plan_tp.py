"""``vllm-dualgpu plan -pp P -tp T``: TP groups as pipeline stages, and each refusal's exit."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vllm_dualgpu.cli import main

TINY = str(Path(__file__).parents[2] / "fixtures" / "tiny_qwen3.json")
MIXED_KINDS = "RTX 5090,RTX 4070 Ti SUPER,RTX 5090,RTX 4070 Ti SUPER"


@pytest.fixture(autouse=True)
def _env(monkeypatch):
    monkeypatch.delenv("VLLM_PP_LAYER_PARTITION", raising=False)
    monkeypatch.delenv("VLLM_DUALGPU_RESERVE", raising=False)


def run_cli(capsys, *argv):
    rc = main(["plan", TINY, "--max-model-len", "4096", *argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_stages_ranks_and_the_serve_line(capsys):
    rc, out, _ = run_cli(capsys, "-pp", "2", "-tp", "2", "--gpus", MIXED_KINDS)
    assert rc == 0
    assert "Model: Qwen3ForCausalLM, one TP-2 rank" in out
    assert "  stage 0: rank 0 GPU 1 RTX 4070 Ti SUPER + rank 1 GPU 3 RTX 4070 Ti SUPER\n" in out
    assert "  stage 1: rank 2 GPU 0 RTX 5090 + rank 3 GPU 2 RTX 5090\n" in out
    assert "--pipeline-parallel-size 2 --tensor-parallel-size 2 --distributed-executor-backend dualgpu" in out
    assert "(by hand: CUDA_VISIBLE_DEVICES=1,3,0,2 " in out
    assert "Stock vLLM" not in out  # stock's TP x PP takes the cards in CUDA order: not this plan


def test_pp_defaults_to_the_cards_over_tp(capsys):
    rc, out, _ = run_cli(capsys, "-tp", "2", "--gpus", MIXED_KINDS, "--json")
    d = json.loads(out)
    assert rc == 0 and len(d["plan"]["partition"]) == 2 and d["tp"]["size"] == 2
    assert [r["gpu"] for r in d["tp"]["ranks"]] == [1, 3, 0, 2]


@pytest.mark.parametrize("argv, first", [
    (["-pp", "2", "-tp", "2", "--gpus", "RTX 5090,RTX 5090,RTX 4070 Ti SUPER,RTX 5080"], "mixed TP group: "),
    (["-pp", "2", "-tp", "2", "--gpus", "RTX 5090,RTX 5090,RTX 5090"],
     "--pipeline-parallel-size 2 x --tensor-parallel-size 2 needs 4 GPUs, but only 3"),
    (["-pp", "2", "-tp", "3", "--gpus", ",".join(["RTX 5090"] * 6)],
     "tensor parallel size 3 does not divide the model's attention heads (4)"),
    (["-tp", "2", "--gpus", "RTX 5090,RTX 5090"], "-tp 2 with -pp 1 is one TP group"),
    (["-tp", "2", "--gpus", MIXED_KINDS, "--gpu-order", "0,1,2,3"], "--gpu-order with -tp 2"),
])
def test_refusals_exit_2_with_one_line(capsys, argv, first):
    rc, out, err = run_cli(capsys, *argv)
    assert rc == 2 and out == ""
    assert err.startswith(f"vllm-dualgpu plan: {first}") and err.count("\n") == 1


@pytest.mark.parametrize("model", [TINY, "reference"])
def test_the_printed_serve_line_plans_the_same(capsys, tmp_path, model):
    import shlex

    if model == "reference":  # the bundled hybrid (Gated DeltaNet) model with a vision tower
        from vllm_dualgpu.planner import reference_config

        cfg = reference_config()
        cfg.pop("_vllm_dualgpu")
        (tmp_path / "config.json").write_text(json.dumps(cfg))
        model = str(tmp_path)
    gpus = "RTX 5090,RTX 5090,RTX 5090,RTX 5090"
    rc = main(["plan", model, "-tp", "2", "--gpus", gpus, "--kv-cache-dtype", "fp8", "--max-model-len", "auto", "--json"])
    first = json.loads(capsys.readouterr().out)
    assert rc == 0
    words = shlex.split(first["command"])
    assert words[:2] == ["vllm", "serve"] and "--tensor-parallel-size" in words
    assert main(["plan", *words[2:], "--gpus", gpus, "--json"]) == 0
    again = json.loads(capsys.readouterr().out)
    for key in ("partition", "num_blocks", "max_model_len", "cuda_visible_devices"):
        assert again["plan"][key] == first["plan"][key], key
    assert again["tp"] == first["tp"]
