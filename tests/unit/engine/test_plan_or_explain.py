"""The executor's planning step reads a short context from ``fit()``: any shortfall raises the
planner's ContextTooLong before weights load (after profiling the KV room is capped at the plan's
budget, so vLLM's measurement cannot make it fit: tests/integration/engine/
test_short_context_refused_before_load.py).

The tiny 4-layer model on a 4 MiB + 8 MiB pair holds one request of 2,784 tokens (worked out by
hand in tests/unit/planner/test_fit.py).
"""

from __future__ import annotations

import pytest

from vllm_dualgpu.engine.planning import plan_or_explain
from vllm_dualgpu.planner import ContextTooLong, GpuFacts, MemoryModel, ModelSpec, PlanRequest

MIB = 1 << 20
GIB = 1 << 30
ZERO = MemoryModel(
    cuda_context_bytes=0, workspace_bytes=0, cudagraph_bytes=0, activation_element_bytes=0, sampler_bytes_per_logit=0,
    pp_comms_first_bytes=0, pp_comms_last_bytes=0, pp_comms_pcie_bytes=0, cuda_context_nvlink_bytes=0,
    cudagraph_small_bytes=0, flashinfer_workspace_bytes=0, tp_comms_pcie_bytes=0, pp_receive_tensors=0,
)
TINY = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 256, "intermediate_size": 512,
    "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 1024,
    "max_position_embeddings": 4096, "torch_dtype": "bfloat16", "tie_word_embeddings": False,
}
PAIR = [GpuFacts(0, "A", 16 * GIB, 4 * MIB), GpuFacts(1, "B", 16 * GIB, 8 * MIB)]


@pytest.fixture
def tiny():
    return ModelSpec.from_hf_config(TINY)


def test_fits_returns_the_plan_at_the_requested_length(tiny):
    p = plan_or_explain(tiny, PAIR, PlanRequest(max_model_len=2048, memory=ZERO))
    assert p.max_model_len == 2048 and p.partition == [1, 3]


def test_just_short_is_refused_too(tiny):
    with pytest.raises(ContextTooLong, match=r"--max-model-len 2,785 does not fit: the largest that fits is 2,784 \(layer split 1/3\)"):
        plan_or_explain(tiny, PAIR, PlanRequest(max_model_len=2785, memory=ZERO))


def test_further_short_raises_context_too_long(tiny):
    with pytest.raises(ContextTooLong, match=r"--max-model-len 2,931 does not fit: the largest that fits is 2,784 \(layer split 1/3\)"):
        plan_or_explain(tiny, PAIR, PlanRequest(max_model_len=2931, memory=ZERO))


def test_a_refusal_names_the_reserve_that_fits_where_the_executor_asks_for_it(tiny):
    """The executor asks for the VLLM_DUALGPU_RESERVE hint where its cards are the visible GPUs
    (``reserve_hint``); the value it names holds the length, and without the flag none is named."""
    import dataclasses
    import re

    kept = [PAIR[0], dataclasses.replace(PAIR[1], free_bytes=8 * MIB + 64 * MIB, reserve_bytes=64 * MIB)]
    req = PlanRequest(max_model_len=2931, memory=ZERO)
    with pytest.raises(ContextTooLong) as named:
        plan_or_explain(tiny, kept, req, reserve_hint=True)
    m = re.search(r"2,931 fits with VLLM_DUALGPU_RESERVE=0MiB,(\d+)MiB\)$", str(named.value))
    assert m, str(named.value)
    assert 0 < int(m.group(1)) < 64
    again = [PAIR[0], dataclasses.replace(kept[1], reserve_bytes=int(m.group(1)) * MIB)]
    assert plan_or_explain(tiny, again, req).max_model_len == 2931
    with pytest.raises(ContextTooLong) as plain:
        plan_or_explain(tiny, kept, req)
    assert "fits with VLLM_DUALGPU_RESERVE=" not in str(plain.value)
