"""The ``vllm serve`` line ``plan`` prints, fed back to ``plan`` as its arguments, plans the same."""

from __future__ import annotations

import json
import shlex

import pytest

from vllm_dualgpu.cli import main
from vllm_dualgpu.planner import reference_config

PAIR = "RTX 5090,RTX 4070 Ti SUPER"
SAME = ("order", "partition", "num_blocks", "block_size", "max_model_len", "pool_tokens",
        "max_num_seqs", "max_num_batched_tokens", "kv_cache", "drafter", "passthrough")


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for var in ("VLLM_PP_LAYER_PARTITION", "VLLM_DUALGPU_OBJECTIVE", "VLLM_DUALGPU_RESERVE"):
        monkeypatch.delenv(var, raising=False)


@pytest.fixture
def models(tmp_path):
    out = {}
    for name, drop_quant in (("fp8", False), ("bf16", True)):
        cfg = reference_config()
        cfg.pop("_vllm_dualgpu")
        if drop_quant:
            cfg.pop("quantization_config")
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text(json.dumps(cfg))
        out[name] = str(d)
    return out


def _plan_json(capsys, argv):
    rc = main(["plan", *argv, "--json"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    return json.loads(out.out)


ARGSETS = [
    # the reference setup's single-user flags at the model's full 262,144 tokens (with vLLM's
    # default batch limits the pair no longer holds 262,144: both ranks hold the embedding)
    ("fp8", ["--kv-cache-dtype", "fp8", "--max-num-seqs", "2", "--max-num-batched-tokens", "1024"]),
    ("fp8", ["--kv-cache-dtype", "fp8", "--max-model-len", "auto", "--block-size", "3136"]),
    ("bf16", ["-q", "fp8", "--kv-cache-dtype", "fp8", "--max-model-len", "auto"]),
    ("bf16", ["-q", "fp8", "--kv-cache-dtype", "fp8", "--max-model-len", "131072", "--max-num-seqs", "8",
              "--max-num-batched-tokens", "4096", "--enforce-eager", "--language-model-only"]),
    ("fp8", ["--max-model-len", "65536", "--no-enable-prefix-caching", "--mamba-cache-dtype", "float32"]),
    ("fp8", ["--kv-cache-dtype", "fp8", "--layer-partition", "20,44", "--max-model-len", "100000"]),
    ("fp8", ["--kv-cache-dtype", "fp8", "--speculative-config", '{"method": "mtp", "num_speculative_tokens": 3}',
             "--objective", "pool", "--max-model-len", "131072"]),
    ("fp8", ["--kv-cache-dtype", "fp8", "--num-gpu-blocks-override", "100", "--max-model-len", "32768"]),
]


@pytest.mark.parametrize("model,args", ARGSETS)
def test_printed_command_plans_the_same(capsys, monkeypatch, models, model, args):
    first = _plan_json(capsys, [models[model], "--gpus", PAIR, *args])
    words = shlex.split(first["command"])
    while "=" in words[0]:  # VAR=value prefixes: the environment vllm serve would run with
        var, _, value = words.pop(0).partition("=")
        monkeypatch.setenv(var, value)
    assert words[:2] == ["vllm", "serve"]
    again = _plan_json(capsys, [*words[2:], "--gpus", PAIR])
    for key in SAME:
        assert again["plan"][key] == first["plan"][key], key
    assert again["command"] == first["command"]
