"""``vllm-dualgpu plan``: every printed line right (issue 17, item 2).

Each test here failed before its fix: one GPU too small exiting 0, the serve command dropping
-q fp8, --max-model-len auto predicting decode at the model's maximum, VLLM_ALLOW_LONG_MAX_MODEL_LEN
ignored, empty --gpus entries accepted, an unknown --kv-cache-dtype exiting 1.
"""

from __future__ import annotations

import json

import pytest

from vllm_dualgpu.cli import main
from vllm_dualgpu.planner import reference_config

PAIR = "RTX 5090,RTX 4070 Ti SUPER"


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for var in ("VLLM_PP_LAYER_PARTITION", "VLLM_ALLOW_LONG_MAX_MODEL_LEN", "VLLM_DUALGPU_OBJECTIVE",
                "VLLM_DUALGPU_RESERVE"):
        monkeypatch.delenv(var, raising=False)


def run_cli(capsys, *argv):
    rc = main(["plan", *argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.fixture
def bf16_model(tmp_path):
    """The reference shapes as a 16-bit checkpoint (54 GB of weights: needs -q fp8 on the pair)."""
    cfg = reference_config()
    cfg.pop("quantization_config")
    cfg.pop("_vllm_dualgpu")
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return str(tmp_path)


@pytest.mark.parametrize("card", ["RTX 4070 Ti SUPER", "RTX 5090"])
def test_one_gpu_too_small_exits_1_with_the_shortfall(capsys, card):
    rc, out, err = run_cli(capsys, "--gpus", card)
    assert rc == 1
    assert "does not fit" in err and f"rank 0 ({card}) is short by" in err
    assert "KV budget" not in out and "-" not in out.split("KV budget")[-1][:1]


def test_one_gpu_that_holds_it_prints_a_stock_command(capsys):
    rc, out, err = run_cli(capsys, "--gpus", "H200")
    assert rc == 0, err
    assert "Serve it as stock vLLM" in out
    assert "vllm serve MODEL --max-model-len 262144 --kv-cache-dtype fp8" in out
    assert "--distributed-executor-backend" not in out


def test_one_gpu_auto_gives_the_largest_that_fits(capsys):
    # 36 GiB free on an H200: the weights fit, not the whole context.
    rc, out, err = run_cli(capsys, "--gpus", "H200:141GiB:36GiB", "--max-model-len", "auto", "--json")
    assert rc == 0, err
    p = json.loads(out)["plan"]
    assert 0 < p["max_model_len"] < 262144
    assert p["max_model_len"] <= p["kv_max_context_tokens"]
    rc, _, err = run_cli(capsys, "--gpus", "H200:141GiB:36GiB", "--max-model-len", "262144")
    assert rc == 1 and f"the largest that fits is {p['max_model_len']:,}" in err


def test_serve_command_keeps_quantization(capsys, bf16_model):
    argv = (bf16_model, "--gpus", PAIR, "-q", "fp8", "--kv-cache-dtype", "fp8", "--max-model-len", "auto")
    rc, out, err = run_cli(capsys, *argv)
    assert rc == 0, err
    # (after VLLM_DUALGPU_OBJECTIVE=pool: --max-model-len auto is planned for the largest pool)
    line = next(x for x in out.splitlines() if "vllm serve " in x)
    assert "--quantization fp8" in line
    rc, out, _ = run_cli(capsys, *argv, "--json")
    assert "--quantization fp8" in json.loads(out)["command"]
    # without it the same model does not fit: the flag is what makes the plan true
    rc, _, err = run_cli(capsys, bf16_model, "--gpus", PAIR, "--kv-cache-dtype", "fp8")
    assert rc == 1 and "does not fit" in err


def test_auto_predicts_decode_at_the_context_it_fitted(capsys):
    # 23 GiB free on the 5090: auto fits less than the model's 262,144.
    rc, out, err = run_cli(capsys, "--gpus", "RTX 5090:32607MiB:23GiB,RTX 4070 Ti SUPER", "--max-model-len", "auto")
    assert rc == 0, err
    fitted = int(out.split("--max-model-len auto: ")[1].split(" ")[0].replace(",", ""))
    assert fitted < 262144
    assert f"at {fitted:,} tokens of context" in out
    assert "at 262,144 tokens of context" not in out


def test_allow_long_max_model_len_is_honoured(capsys, monkeypatch):
    rc, _, err = run_cli(capsys, "--max-model-len", "300000")
    assert rc == 2 and "VLLM_ALLOW_LONG_MAX_MODEL_LEN=1" in err
    monkeypatch.setenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")
    # an H200 holds 300,000 tokens of fp8 KV (16 attention layers x 2,048 bytes: 9.2 GiB) beside
    # some 30 GiB of weights and fixed costs on its 140 GiB: planned at that length, not refused as
    # over the model's maximum
    rc, out, err = run_cli(capsys, "--gpus", "H200", "--max-model-len", "300000", "--json")
    assert rc == 0, err
    assert json.loads(out)["plan"]["max_model_len"] == 300000
    # on the pair, 300,000 is planned or refused for memory only (--json puts the refusal in stdout)
    rc, out, err = run_cli(capsys, "--max-model-len", "300000", "--json")
    assert rc in (0, 1), err
    d = json.loads(out)
    if rc == 0:
        assert d["plan"]["max_model_len"] == 300000
    else:
        assert d["error"] == "ContextTooLong" and d["requested"] == 300000
        assert "VLLM_ALLOW_LONG_MAX_MODEL_LEN" not in d["message"] and "does not fit" in d["message"]
    rc, _, err = run_cli(capsys, "--max-model-len", "10000000")
    assert rc == 1 and "larger than the model's maximum" not in err
    largest = int(err.split("the largest that fits is ")[1].split(" ")[0].replace(",", ""))
    assert largest > 262144  # no longer capped at the model's maximum


@pytest.mark.parametrize("spec", ["RTX 5090,", "", " ", ",RTX 5090", "RTX 5090,,RTX 4070 Ti SUPER"])
def test_empty_gpus_entries_are_bad_arguments(capsys, spec):
    rc, out, err = run_cli(capsys, "--gpus", spec)
    assert rc == 2
    assert "--gpus" in err and "write" in err
    assert out == ""


def test_unknown_kv_cache_dtype_exits_2_with_what_to_write(capsys):
    rc, _, err = run_cli(capsys, "--kv-cache-dtype", "fp9")
    assert rc == 2 and "write auto, bfloat16, float16, fp8" in err


def test_kv_cache_dtype_vllm_knows_but_the_planner_does_not_size_exits_1(capsys):
    rc, _, err = run_cli(capsys, "--kv-cache-dtype", "nvfp4")
    assert rc == 1 and "does not size" in err
