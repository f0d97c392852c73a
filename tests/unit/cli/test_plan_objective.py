"""``vllm-dualgpu plan`` under the default objective (issue 26): the line saying what the pool
objective gives instead, and the serve line carrying ``VLLM_DUALGPU_OBJECTIVE=pool`` exactly
where the executor would otherwise plan another split."""

from __future__ import annotations

import json
import shlex

import pytest

from vllm_dualgpu.cli import main

PAIR = "RTX 5090,RTX 4070 Ti SUPER"
# The reference setup's serving flags with MTP, at 131,072 tokens: a length several splits of the
# pair hold, so the fastest split and the largest pool differ (at the model's 262,144 the pair
# holds MTP on no split, now that both ranks hold the embedding).
MTP = ["--kv-cache-dtype", "fp8", "--max-model-len", "131072", "--max-num-seqs", "2",
       "--max-num-batched-tokens", "1024", "--speculative-config", '{"method": "mtp", "num_speculative_tokens": 3}']
# A mismatched pair with room: --max-model-len auto reaches the model's 262,144 on more than one
# split (on PAIR only the largest-pool split holds the largest length that fits).
ROOMY = "RTX 5090,RTX 4080"  # (with the RTX 4090 the largest-pool split was also the fastest at 262,144)


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for var in ("VLLM_PP_LAYER_PARTITION", "VLLM_DUALGPU_OBJECTIVE", "VLLM_DUALGPU_RESERVE"):
        monkeypatch.delenv(var, raising=False)


def plan(capsys, *argv):
    rc = main(["plan", *argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def env_of(command: str) -> dict:
    words = shlex.split(command)
    return dict(w.split("=", 1) for w in words[:words.index("vllm")])


def test_the_trade_line_is_printed_when_the_objectives_differ(capsys):
    rc, out, err = plan(capsys, "--gpus", PAIR, *MTP, "--json")
    assert rc == 0, err
    d = json.loads(out)
    p, alt = d["plan"], d["plan"]["pool_alternative"]
    assert p["objective"] == "speed" and alt is not None and alt["partition"] != p["partition"]
    # the pool objective asked directly gives the alternative's split and pool
    rc, out, err = plan(capsys, "--gpus", PAIR, *MTP, "--objective", "pool", "--json")
    pool = json.loads(out)
    assert (pool["plan"]["partition"], pool["plan"]["pool_tokens"]) == (alt["partition"], alt["pool_tokens"])
    assert pool["plan"]["pool_alternative"] is None and pool["trade_line"] is None
    assert env_of(pool["command"]) == {"VLLM_DUALGPU_OBJECTIVE": "pool"}
    # the text output has the line once, as the engine logs it
    rc, out, err = plan(capsys, "--gpus", PAIR, *MTP)
    assert [x for x in out.splitlines() if x.startswith("vllm-dualgpu plan: split")] == [d["trade_line"]]
    assert env_of(d["command"]) == {}  # the default needs no variable


def test_unknown_bandwidth_plans_for_the_pool_and_the_serve_line_says_so(capsys):
    gpus = "Mystery Card:16GiB,RTX 5090"  # no bandwidth known for the first card
    rc, out, err = plan(capsys, "--gpus", gpus, *MTP, "--json")
    assert rc == 0, err
    d = json.loads(out)
    assert d["plan"]["objective"] == "pool" and d["plan"]["predicted_decode_ms"] is None
    assert any("no memory bandwidth known for GPU 0 (Mystery Card)" in n for n in d["plan"]["notes"])
    # the executor may read the card's bandwidth through NVML: the line keeps the pool rule
    assert env_of(d["command"]) == {"VLLM_DUALGPU_OBJECTIVE": "pool"}
    rc, out, err = plan(capsys, "--gpus", "Mystery Card:16GiB:bw=500,RTX 5090", *MTP, "--json")
    assert json.loads(out)["plan"]["objective"] == "speed"


def test_auto_length_keeps_the_pool_split_in_its_serve_line_only_where_needed(capsys):
    # on a roomy mismatched pair the default would plan the printed length on a faster split
    rc, out, err = plan(capsys, "--gpus", ROOMY, "--kv-cache-dtype", "fp8", "--max-model-len", "auto", "--json")
    assert rc == 0, err
    d = json.loads(out)
    assert d["plan"]["objective"] == "pool"
    length = d["plan"]["max_model_len"]
    rc, out, err = plan(capsys, "--gpus", ROOMY, "--kv-cache-dtype", "fp8", "--max-model-len", str(length), "--json")
    again = json.loads(out)["plan"]
    assert again["partition"] != d["plan"]["partition"]
    assert env_of(d["command"]) == {"VLLM_DUALGPU_OBJECTIVE": "pool"}
    # where only the largest-pool split holds the length auto found, the default plans it too
    rc, out, err = plan(capsys, "--gpus", PAIR, "--kv-cache-dtype", "fp8", "--max-model-len", "auto", "--json")
    d = json.loads(out)
    assert rc == 0 and d["plan"]["objective"] == "pool", err
    rc, out, err = plan(capsys, "--gpus", PAIR, "--kv-cache-dtype", "fp8", "--max-model-len",
                        str(d["plan"]["max_model_len"]), "--json")
    if json.loads(out)["plan"]["partition"] == d["plan"]["partition"]:
        assert env_of(d["command"]) == {}
    else:
        assert env_of(d["command"]) == {"VLLM_DUALGPU_OBJECTIVE": "pool"}
    # two equal cards: every split reads the same bytes, the default takes the largest pool too
    rc, out, err = plan(capsys, "--gpus", "RTX 5090,RTX 5090", "--kv-cache-dtype", "fp8", "--max-model-len", "auto",
                        "--json")
    d = json.loads(out)
    assert rc == 0 and d["plan"]["objective"] == "pool" and env_of(d["command"]) == {}
