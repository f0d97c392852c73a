"""When the executor sets one attention backend for every rank (engine/attention_backend.py)."""

from __future__ import annotations

import pytest

from vllm_dualgpu.engine.attention_backend import decide_common_backend

ADA, HOPPER, BLACKWELL = (8, 9), (9, 0), (12, 0)


@pytest.mark.parametrize("caps", [[ADA, HOPPER], [ADA, BLACKWELL], [HOPPER, ADA, ADA]])
def test_mixed_capabilities_with_fp8_kv_get_flashinfer_everywhere(caps):
    backend, why = decide_common_backend(caps, "fp8", None, True)
    assert backend == "FLASHINFER"
    assert "--attention-backend" in why


@pytest.mark.parametrize("caps,kv,user,aligned,reason", [
    ([ADA, HOPPER], "fp8", "TRITON_ATTN", True, "was chosen"),
    ([ADA, ADA], "fp8", None, True, "one compute capability"),
    ([ADA, HOPPER], "auto", None, True, "the KV cache is auto"),
    ([ADA, HOPPER], "fp8", None, False, "do not carry"),
    ([ADA, None], "fp8", None, True, "one compute capability"),
])
def test_otherwise_vllm_chooses(caps, kv, user, aligned, reason):
    backend, why = decide_common_backend(caps, kv, user, aligned)
    assert backend is None
    assert reason in why


def test_an_mla_model_keeps_vllms_choice():
    backend, why = decide_common_backend([ADA, HOPPER], "fp8", None, True, uses_mla=True)
    assert backend is None and "MLA" in why
