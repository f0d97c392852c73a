"""The size of vLLM's FlashInfer workspace comes from vLLM's own variable
(VLLM_FLASHINFER_WORKSPACE_BUFFER_SIZE, bytes; vLLM 0.33 envs.py:1817, default 394 MiB): the plan
charges what vLLM will allocate, on every rank that runs FlashInfer. Where the user did not set
it, a dualgpu run sets its own size (planner/memory.py plugin_flashinfer_workspace)."""

from __future__ import annotations

import pytest

from vllm_dualgpu import envs
from vllm_dualgpu import planner as P
from vllm_dualgpu.patching.runtime import runtime_assumptions

MIB = 1 << 20


def test_unset_is_sized_by_the_executor(monkeypatch):
    monkeypatch.delenv("VLLM_FLASHINFER_WORKSPACE_BUFFER_SIZE", raising=False)
    assert envs.flashinfer_workspace_bytes() is None
    memory = runtime_assumptions().request_fields()["memory"]
    assert memory.flashinfer_workspace_sized
    assert memory.cuda_context_bytes == P.MemoryModel().cuda_context_bytes  # nothing else moves
    assert P.MemoryModel().flashinfer_workspace_bytes == 394 * MIB  # vLLM's default, where no plan sets it
    assert "sized by the executor" in runtime_assumptions().describe()


@pytest.mark.parametrize("value,expected", [("134217728", 128 * MIB), (" 67108864 ", 64 * MIB)])
def test_set_is_what_the_plan_charges(monkeypatch, value, expected):
    monkeypatch.setenv("VLLM_FLASHINFER_WORKSPACE_BUFFER_SIZE", value)
    assert envs.flashinfer_workspace_bytes() == expected
    memory = runtime_assumptions().request_fields()["memory"]
    assert memory.flashinfer_workspace_bytes == expected and not memory.flashinfer_workspace_sized
    assert memory.cuda_context_bytes == P.MemoryModel().cuda_context_bytes  # nothing else moves
    assert "FlashInfer workspace" in runtime_assumptions().describe()


def test_a_value_vllm_cannot_read_is_not_planned(monkeypatch):
    """vLLM's own int() would fail on it when FlashInfer starts, with its own error; the plan keeps
    the default rather than guess."""
    monkeypatch.setenv("VLLM_FLASHINFER_WORKSPACE_BUFFER_SIZE", "128MiB")
    assert envs.flashinfer_workspace_bytes() is None


def test_the_plan_of_the_reference_moves_by_the_workspaces(monkeypatch):
    """FP8 + MTP on the reference pair: the last rank (the RTX 5090, SM 12.0, which decodes through
    XQA) holds three FlashInfer buffers of the configured size (the target's workspace, the MTP
    drafter's, and XQA's), the first one one; 128 MiB instead of 394 gives each back 266 MiB."""
    gpus = P.parse_gpus("RTX 4070 Ti SUPER,RTX 5090")
    base = dict(max_model_len=65_536, kv_cache_dtype="fp8", max_num_seqs=2, max_num_batched_tokens=1024,
                speculative={"method": "mtp", "num_speculative_tokens": 3}, layer_partition=[20, 44],
                gpu_order=[0, 1], enable_prefix_caching=True)
    model = P.ModelSpec.from_hf_config(P.reference_config())
    monkeypatch.setenv("VLLM_FLASHINFER_WORKSPACE_BUFFER_SIZE", str(394 * MIB))
    a = P.fit(model, gpus, P.PlanRequest(**base, **runtime_assumptions().request_fields())).plan
    monkeypatch.setenv("VLLM_FLASHINFER_WORKSPACE_BUFFER_SIZE", str(128 * MIB))
    b = P.fit(model, gpus, P.PlanRequest(**base, **runtime_assumptions().request_fields())).plan
    assert [x.reserve_bytes - y.reserve_bytes for x, y in zip(a.ranks, b.ranks)] == [266 * MIB, 3 * 266 * MIB]
