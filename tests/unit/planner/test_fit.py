"""``fit()``: "fits / falls short, and the largest that fits" as a result, not an exception.

The hand-worked cases use the 4-layer tiny Qwen3 with a zero runtime-memory model (the numbers
of test_search.py's docstring):

  layer weights 1,180,928 B; embedding = lm_head = 524,288 B; final norm 512 B;
  one block = 16 tokens = 8,192 B per layer; a pool of n blocks holds one request of
  (n - 1) x 16 tokens (vLLM keeps one null block).

On GPU 0 with 4 MiB (4,194,304 B) free and GPU 1 with 8 MiB (8,388,608 B), GPU 1 (more memory)
goes last, and the split 1/3 gives the largest pool:
  rank 0: 4,194,304 - 1,180,928 - 524,288 = 2,489,088 B / 8,192 = 303 blocks
  rank 1: 8,388,608 - 3 x 1,180,928 - 524,288 - 512 = 4,321,024 B / 24,576 = 175 blocks
so 175 blocks, one request of 174 x 16 = 2,784 tokens. (2/2: rank 0 holds 1,308,160 / 16,384 =
79 blocks; 3/1: 127,232 / 24,576 = 5 blocks.)

One GPU with 8 MiB holding all 4 layers, the embedding, the head and the norm:
  8,388,608 - 4 x 1,180,928 - 2 x 524,288 - 512 = 2,615,808 B / 32,768 = 79 blocks: 78 x 16 = 1,248 tokens.
"""

from __future__ import annotations

import dataclasses

import pytest

from vllm_dualgpu.planner import (
    BadRequest,
    ContextTooLong,
    Fit,
    GpuFacts,
    MemoryModel,
    ModelDoesNotFit,
    ModelSpec,
    PlanRequest,
    check_stock,
    fit,
    fit_stock,
    plan,
    reference_config,
    reference_pair,
)

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
LARGEST = 174 * 16  # the 1/3 split's 175 blocks less the null block (docstring)
STOCK_LARGEST = 78 * 16


def message(requested: int, largest: int, where: str = "") -> str:
    """ContextTooLong's text, written out here so a change to it shows."""
    return (
        f"--max-model-len {requested:,} does not fit: the largest that fits is {largest:,}{where}; lower "
        f"--max-model-len to at most {largest}, or use --kv-cache-dtype fp8, a smaller weight format, or free GPU memory"
    )


@pytest.fixture
def tiny():
    return ModelSpec.from_hf_config(TINY)


def pair(a=4 * MIB, b=8 * MIB):
    return [GpuFacts(0, "A", 16 * GIB, a), GpuFacts(1, "B", 16 * GIB, b)]


def req(**kw):
    kw.setdefault("memory", ZERO)
    return PlanRequest(**kw)


def test_falls_short_with_the_plan_at_the_largest_that_fits(tiny):
    f = fit(tiny, pair(), req(max_model_len=4096))
    assert isinstance(f, Fit) and f.fits is False
    assert f.requested_max_model_len == 4096 and f.largest_max_model_len == LARGEST
    assert f.plan.max_model_len == LARGEST and f.plan.partition == [1, 3] and f.plan.order == [0, 1]
    assert f.plan.num_blocks == 175 and f.plan.max_context_tokens == LARGEST
    assert isinstance(f.error, ContextTooLong)
    assert str(f.error) == message(4096, LARGEST, " (layer split 1/3)")
    assert (f.error.largest_fitting_max_model_len, f.error.requested) == (LARGEST, 4096)


def test_the_largest_fits_and_one_more_token_does_not(tiny):
    at = fit(tiny, pair(), req(max_model_len=LARGEST))
    assert at.fits and at.error is None
    assert at.plan.max_model_len == LARGEST and at.largest_max_model_len == LARGEST and at.plan.partition == [1, 3]
    past = fit(tiny, pair(), req(max_model_len=LARGEST + 1))
    assert not past.fits and past.largest_max_model_len == LARGEST and past.plan.max_model_len == LARGEST
    assert str(past.error) == message(LARGEST + 1, LARGEST, " (layer split 1/3)")


def test_a_shorter_request_fits_and_still_reports_the_largest(tiny):
    f = fit(tiny, pair(), req(max_model_len=1024))
    assert f.fits and f.plan.max_model_len == 1024 and f.requested_max_model_len == 1024
    assert f.largest_max_model_len == LARGEST


def test_auto_always_fits_at_the_largest(tiny):
    f = fit(tiny, pair(), req(max_model_len=-1))
    assert f.fits and f.requested_max_model_len is None and f.error is None
    assert f.plan.max_model_len == LARGEST == f.largest_max_model_len


def test_plan_returns_fit_plan_or_raises_the_same_message_without_a_plan_inside(tiny):
    with pytest.raises(ContextTooLong) as e:
        plan(tiny, pair(), req(max_model_len=4096))
    assert str(e.value) == message(4096, LARGEST, " (layer split 1/3)")
    assert not hasattr(e.value, "best_plan")
    p = plan(tiny, pair(), req(max_model_len=LARGEST))
    f = fit(tiny, pair(), req(max_model_len=LARGEST))
    assert (p.partition, p.order, p.num_blocks, p.max_model_len) == (f.plan.partition, f.plan.order, 175, LARGEST)


def test_fit_is_a_frozen_value(tiny):
    f = fit(tiny, pair(), req(max_model_len=4096))
    with pytest.raises(dataclasses.FrozenInstanceError):
        f.fits = True  # type: ignore[misc]


def test_other_refusals_still_raise(tiny):
    with pytest.raises(ModelDoesNotFit):  # 1 MiB cannot hold even one layer and the embedding
        fit(tiny, pair(a=1 * MIB, b=2 * MIB), req(max_model_len=1024))
    with pytest.raises(BadRequest, match="larger than the model's maximum"):
        fit(tiny, pair(), req(max_model_len=5000))
    with pytest.raises(BadRequest, match="layer partition"):
        fit(tiny, pair(), req(max_model_len=1024, layer_partition=[2, 3]))


def test_a_user_split_that_holds_less_falls_short_at_its_own_largest(tiny):
    # 2/2: rank 0 holds 79 blocks (docstring): 78 x 16 tokens.
    f = fit(tiny, pair(), req(max_model_len=2048, layer_partition=[2, 2]))
    assert not f.fits and f.largest_max_model_len == 78 * 16 and f.plan.partition == [2, 2]
    assert str(f.error) == message(2048, 78 * 16, " (layer split 2/2)")


def test_passthrough_fits_unchecked(tiny):
    f = fit(tiny, pair(), req(max_model_len=4096, pp_size=1))
    assert f.fits and f.plan.passthrough and f.requested_max_model_len == 4096


def test_stock_check_falls_short_on_one_gpu(tiny):
    one = [GpuFacts(1, "B", 16 * GIB, 8 * MIB)]
    f = fit_stock(tiny, one, req(max_model_len=2048))
    assert not f.fits and f.largest_max_model_len == STOCK_LARGEST and f.plan.max_model_len == STOCK_LARGEST
    assert str(f.error) == message(2048, STOCK_LARGEST)  # one rank: no layer split named
    with pytest.raises(ContextTooLong) as e:
        check_stock(tiny, one, req(max_model_len=2048))
    assert str(e.value) == str(f.error)
    ok = fit_stock(tiny, one, req(max_model_len=STOCK_LARGEST))
    assert ok.fits and ok.plan.passthrough and ok.plan.notes[0].startswith("one GPU: vLLM runs as stock")
    assert not fit_stock(tiny, one, req(max_model_len=STOCK_LARGEST + 1)).fits


def test_reference_on_the_reference_pair_with_model_dtype_kv():
    """The bundled reference at its 262,144 tokens with a bf16 KV cache falls short on the
    5090 + 4070 Ti SUPER; the largest it reports fits, one token more does not."""
    model = ModelSpec.from_hf_config(reference_config())
    request = PlanRequest(max_model_len=262_144, kv_cache_dtype="auto")
    f = fit(model, reference_pair(), request)
    assert not f.fits and f.requested_max_model_len == 262_144
    largest = f.largest_max_model_len
    assert 0 < largest < 262_144 and f.plan.max_model_len == largest
    assert f"(layer split {f.plan.partition[0]}/{f.plan.partition[1]})" in str(f.error)
    with pytest.raises(ContextTooLong) as e:
        plan(model, reference_pair(), request)
    assert str(e.value) == str(f.error)

    at = fit(model, reference_pair(), dataclasses.replace(request, max_model_len=largest))
    assert at.fits and at.plan.max_model_len == largest and at.plan.max_context_tokens >= largest
    past = fit(model, reference_pair(), dataclasses.replace(request, max_model_len=largest + 1))
    assert not past.fits and past.largest_max_model_len == largest
    # fp8 halves the KV bytes per token: the same request then fits (the bundled table's case).
    assert fit(model, reference_pair(), dataclasses.replace(request, kv_cache_dtype="fp8")).fits


def test_a_longer_context_than_the_model_is_the_requests_choice_not_the_environments(tiny, monkeypatch):
    """The planner reads its inputs, never the environment: VLLM_ALLOW_LONG_MAX_MODEL_LEN in
    os.environ changes nothing; the request's allow_long_max_model_len does."""
    monkeypatch.setenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")
    with pytest.raises(BadRequest, match="larger than the model's maximum"):
        fit(tiny, pair(), req(max_model_len=5000))
    monkeypatch.delenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN")
    assert fit(tiny, pair(), req(max_model_len=5000, allow_long_max_model_len=True)).requested_max_model_len == 5000
