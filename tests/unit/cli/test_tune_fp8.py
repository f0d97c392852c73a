"""`vllm-dualgpu tune-fp8`: arguments, dry run, output names and where files go."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import SEED_SHAPES, qwen35_27b
from vllm_dualgpu.cli import main
from vllm_dualgpu.kernels import fp8_configs as fc
from vllm_dualgpu.kernels import fp8_tuner as ft


ROOT = Path(__file__).resolve().parents[3]
RTX = "NVIDIA GeForce RTX 4070 Ti SUPER"


@pytest.fixture
def model_dir(write_config):
    return write_config(qwen35_27b(), "qwen35-27b-fp8")


def test_needs_a_model_or_shapes(capsys):
    assert main(["tune-fp8", "--dry-run"]) == 2
    assert "MODEL" in capsys.readouterr().err


@pytest.mark.parametrize("argv,message", [
    (["--shapes", "14336"], "N,K"),
    (["--shapes", "1,2", "--block", "128"], "--block"),
    (["--shapes", "1,2", "--batch-sizes", "1,x"], "batch sizes"),
    (["--shapes", "1,2", "--batch-sizes", "0,8"], "positive"),
    (["--shapes", "1,2", "--tp", "0"], "--tp"),
    (["/nonexistent/model"], "config.json"),
])
def test_bad_arguments_exit_2_with_a_reason(capsys, argv, message):
    assert main(["tune-fp8", *argv, "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("vllm-dualgpu tune-fp8: ") and message in err


def test_dry_run_from_a_model_names_the_seed_files(model_dir, capsys, tmp_path):
    out = tmp_path / "cfgs"
    assert main(["tune-fp8", str(model_dir), "--dry-run", "--device-name", RTX, "--out", str(out)]) == 0
    text = capsys.readouterr().out
    for N, K in SEED_SHAPES:
        name = fc.config_file_name(N, K, "NVIDIA_GeForce_RTX_4070_Ti_SUPER")
        assert str(out / name) in text
        assert (ROOT / "kernel_configs" / name).exists()  # the same names the seed files have
    assert "self_attn.qkv_proj" in text and "linear_attn.in_proj_ba" in text  # shown as skipped
    assert "nothing measured or written" in text and not out.exists()


def test_dry_run_with_tp_and_extra_shapes(model_dir, capsys):
    assert main(["tune-fp8", str(model_dir), "--tp", "4", "--shapes", "96,5120;3584,5120",
                 "--batch-sizes", "1,64", "--dry-run"]) == 0
    text = capsys.readouterr().out
    assert "N=3584,K=5120: self_attn.qkv_proj" in text
    assert "N=96,K=5120: from --shapes" in text
    assert text.count("N=3584,K=5120:") == 1  # from the model and --shapes: listed once
    assert text.count(fc.config_file_name(3584, 5120, "<this GPU>")) == 1
    assert "batch sizes 1,64" in text and "<this GPU>" in text


def test_block_from_the_command_line(capsys):
    assert main(["tune-fp8", "--shapes", "256,512", "--block", "64,64", "--dry-run", "--device-name", "X Y"]) == 0
    assert "N=256,K=512,device_name=X_Y,dtype=fp8_w8a8,block_shape=[64,64].json" in capsys.readouterr().out


def test_output_folder_defaults(monkeypatch, tmp_path):
    from vllm_dualgpu.cli import build_parser, tune_fp8

    args = build_parser().parse_args(["tune-fp8", "--shapes", "1,2"])
    monkeypatch.delenv(fc.ENV_USER_DIR, raising=False)
    assert tune_fp8.output_dir(args) == Path(tune_fp8.DEFAULT_OUT)
    monkeypatch.setenv(fc.ENV_USER_DIR, f"{tmp_path / 'a'}:{tmp_path / 'b'}")
    assert tune_fp8.output_dir(args) == tmp_path / "a"
    args = build_parser().parse_args(["tune-fp8", "--shapes", "1,2", "--out", str(tmp_path / "c")])
    assert tune_fp8.output_dir(args) == tmp_path / "c"


def test_no_gpu_is_a_clear_error(monkeypatch, capsys):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["tune-fp8", "--shapes", "1,2"]) == 1
    assert "no CUDA GPU" in capsys.readouterr().err


def test_run_writes_files_named_for_the_card_and_says_where(monkeypatch, tmp_path, capsys, model_dir):
    """The real tune(); only the GPU steps are fakes: torch's device queries (device 1 is the
    RTX card, device 0 another), the kernel lookup, the precompile workers and the timing of one
    shape. The file names come from the tuner's own reading of the selected card."""
    import types

    import torch

    seen = {"timed": []}
    names = {0: "NVIDIA H200", 1: RTX}
    props = types.SimpleNamespace(shared_memory_per_block_optin=101376, L2_cache_size=48 << 20,
                                  multi_processor_count=66)

    def fake_tune_shape(kernel, N, K, block, batch_sizes, smem_limit, **kw):
        seen["timed"].append((N, K))
        seen.update(block=block, batch_sizes=list(batch_sizes), kernel=kernel)
        configs = {m: ft.candidate_configs(m, *block)[0] for m in batch_sizes}
        return ft.ShapeResult(N, K, configs, {m: 1.0 for m in batch_sizes}, {}, {})

    monkeypatch.setattr(torch.cuda, "init", lambda: None)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: seen["device"])
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=None: names[i])
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i=None: props)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=None: (8, 9))
    monkeypatch.setattr(ft, "find_kernel", lambda: "kernel")
    monkeypatch.setattr(ft, "precompile",
                        lambda plan, jobs, index, timeout, log: seen.update(jobs=jobs, index=index))
    monkeypatch.setattr(ft, "tune_shape", fake_tune_shape)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", lambda i: seen.setdefault("device", i))
    out = tmp_path / "mine"
    rc = main(["tune-fp8", str(model_dir), "--out", str(out), "--batch-sizes", "1,8,64", "--jobs", "3",
               "--device", "1", "--no-progress"])
    assert rc == 0
    assert seen == {"timed": SEED_SHAPES, "block": (128, 128), "batch_sizes": [1, 8, 64], "jobs": 3,
                    "index": 1, "kernel": "kernel", "device": 1}
    written = sorted(p.name for p in out.glob("N=*.json"))
    assert written == sorted(fc.config_file_name(N, K, "NVIDIA_GeForce_RTX_4070_Ti_SUPER") for N, K in SEED_SHAPES)
    for name in written:
        assert list(json.loads((out / name).read_text())) == ["1", "8", "64"]
    text = capsys.readouterr().out
    assert f"wrote 5 config file(s) to {out.resolve()}" in text
    assert f"VLLM_DUALGPU_KERNEL_CONFIGS={out.resolve()}" in text
    assert json.loads((out / "tune-fp8-log.json").read_text())["files"]


def test_help_lists_the_subcommand(capsys):
    with pytest.raises(SystemExit):
        main(["tune-fp8", "--help"])
    assert "--shapes" in capsys.readouterr().out
