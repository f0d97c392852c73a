"""vLLM's second FlashInfer buffer: a rank that decodes through XQA (SM 9.0 or 12.x) allocates
``_get_trtllm_workspace_buffer()``, VLLM_FLASHINFER_WORKSPACE_BUFFER_SIZE bytes, beside the
FlashInfer workspace (v1/attention/backends/flashinfer.py, vLLM 0.30-0.34). Measured on the
virtual pair (2026-12-04, twelfth run): with XQA on (VLLM_HAS_FLASHINFER_CUBIN=1) the SM 9.0
rank's boot peak was 98 MiB above the same arm's without it (30,622 against 30,524 MiB), with the
executor's 97 MiB workspace. Expected values by hand: the configured size is 97 MiB for the
reference shape (tests/unit/planner/test_flashinfer_workspace.py), or the user's value."""

from __future__ import annotations

import dataclasses

import pytest

from vllm_dualgpu import planner as P
from vllm_dualgpu.cli import plan as cli_plan
from vllm_dualgpu.planner.memory import xqa_decode

MIB = 1 << 20
REF = P.ModelSpec.from_hf_config(P.reference_config())  # 24 query heads, 4 KV heads, head size 256
PAIR = "RTX 4070 Ti SUPER:16GiB:display=no,RTX 5090:32GiB:display=yes"


@pytest.mark.parametrize("cap, expected", [((9, 0), True), ((12, 0), True), ((12, 1), True), ((8, 9), False),
                                           ((8, 0), False), ((10, 0), False), ((9, 1), False), (None, True)])
def test_xqa_runs_on_sm90_and_sm12x(cap, expected):
    assert xqa_decode("fp8", cap, REF) is expected


def test_what_xqa_does_not_take():
    assert not xqa_decode("fp8", (12, 0), dataclasses.replace(REF, head_dim=512))  # head size past 256
    assert not xqa_decode("fp8", (12, 0), dataclasses.replace(REF, head_dim=72))  # not a multiple of 16
    assert not xqa_decode("fp8", (12, 0), dataclasses.replace(REF, num_attention_heads=10))  # 10 on 4 KV heads
    assert not xqa_decode("nvfp4", (9, 0), REF)  # FA2 reads an NVFP4 cache on SM 9.0
    assert xqa_decode("nvfp4", (12, 0), REF)


def ranks(monkeypatch, *extra, workspace=None):
    monkeypatch.delenv("VLLM_FLASHINFER_WORKSPACE_BUFFER_SIZE", raising=False)
    if workspace is not None:
        monkeypatch.setenv("VLLM_FLASHINFER_WORKSPACE_BUFFER_SIZE", str(workspace))
    q = cli_plan.ask(["--gpus", PAIR, "--max-num-seqs", "2", "--max-num-batched-tokens", "1024", *extra])
    return {r.gpu.short_name: r for r in P.fit(q.model, q.gpus, q.request).plan.ranks}


def test_the_rtx_5090_rank_holds_the_xqa_workspace_and_the_4070_rank_not(monkeypatch):
    r = ranks(monkeypatch, "--kv-cache-dtype", "fp8")
    big = next(v for k, v in r.items() if "5090" in k)
    small = next(v for k, v in r.items() if "4070" in k)
    assert big.reserve_detail["xqa_workspace"] == 97 * MIB  # the executor's size for this shape
    assert "xqa_workspace" not in small.reserve_detail  # SM 8.9: FlashInfer's own decode
    assert big.reserve_bytes == sum(big.reserve_detail.values())  # charged, not only listed


def test_a_users_workspace_size_is_the_xqa_buffers_size(monkeypatch):
    r = ranks(monkeypatch, "--kv-cache-dtype", "fp8", workspace=128 * MIB)
    big = next(v for k, v in r.items() if "5090" in k)
    assert big.reserve_detail["xqa_workspace"] == 128 * MIB


def test_no_xqa_workspace_without_flashinfer(monkeypatch):
    """A bf16 KV cache on this pair: vLLM's FlashAttention on both ranks, no FlashInfer buffer at all."""
    r = ranks(monkeypatch, "--kv-cache-dtype", "auto")
    assert all("xqa_workspace" not in v.reserve_detail and "flashinfer_workspace" not in v.reserve_detail
               for v in r.values())


def test_use_trtllm_attention_false_takes_the_xqa_workspace_away(monkeypatch):
    """vLLM's own switch (can_use_trtllm_attention checks it first, and the patch
    flashinfer-xqa-offline leaves it alone): no XQA, no second buffer; `plan` repeats the flag in
    its serve line."""
    off = '{"use_trtllm_attention": false}'
    r = ranks(monkeypatch, "--kv-cache-dtype", "fp8", "--attention-config", off)
    assert all("xqa_workspace" not in v.reserve_detail for v in r.values())
    on = ranks(monkeypatch, "--kv-cache-dtype", "fp8", "--attention-config", '{"use_trtllm_attention": true}')
    assert any("xqa_workspace" in v.reserve_detail for v in on.values())


def test_plan_repeats_the_attention_config_in_its_serve_line(monkeypatch, capsys):
    import json

    from vllm_dualgpu.cli import main

    monkeypatch.delenv("VLLM_FLASHINFER_WORKSPACE_BUFFER_SIZE", raising=False)
    rc = main(["plan", "--gpus", PAIR, "--kv-cache-dtype", "fp8", "--attention-config",
               '{"use_trtllm_attention": false}', "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and """--attention-config '{"use_trtllm_attention": false}'""" in out["command"]
    assert all("xqa_workspace" not in r["reserve_detail"] for r in out["plan"]["ranks"])
