"""A DFlash2 drafter (``DFlash2DraftModel``) holds more than a DFlash drafter of the same layers:
vLLM 0.30-0.33 build it as ``qwen3_dflash2.DFlash2Qwen3ForCausalLM``, whose every decoder layer
wraps its attention and its MLP in a grouped convolution (``DFlashGroupedConv``: a
``base_kernel`` of ``2 x taps x hidden`` in the model's dtype and a ``kernel_projection`` linear
``hidden -> 2 x taps x hidden / group``, built with the checkpoint's quantization), and whose model
holds a ``CandidateSelector`` (two codebooks of ``vocab x rank`` and a ``hidden_projection``
``hidden -> rank``, both in the model's dtype, never quantized). The figures below are those
shapes worked by hand for the reference drafter (tests/fixtures/dflash2_drafter.json: hidden
5,120, 5 layers, vocabulary 248,320, taps 2, group 16, rank 256, W4A16 group 128 with bf16
scales); tests/integration/planner/test_dflash2_drafter_vllm.py counts vLLM's own parameters."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vllm_dualgpu.planner import DrafterSpec, ModelSpec, reference_config
from vllm_dualgpu.planner.errors import BadRequest

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"
DFLASH2 = json.loads((FIXTURES / "dflash2_drafter.json").read_text())

# by hand, from vLLM's module shapes (qwen3_dflash2.py) and the fixture's figures
BASE_KERNELS = 5 * 2 * (2 * 2 * 5120 * 2)  # 5 layers x 2 convs x (2 x taps x hidden) bf16
# kernel_projection: out 2 x 2 x (5120 / 16) = 1,280, in 5,120; int4 packed + one bf16 scale per 128 inputs
KERNEL_PROJECTIONS = 5 * 2 * (1280 * 5120 // 2 + 1280 * (5120 // 128) * 2)
CODEBOOKS = 2 * 248320 * 256 * 2  # predecessor and successor, vocab x rank, bf16
HIDDEN_PROJECTION = 256 * 5120 * 2  # bf16: vLLM builds it without the quantization config
EXTRA = BASE_KERNELS + KERNEL_PROJECTIONS + CODEBOOKS + HIDDEN_PROJECTION


def drafter(cfg: dict) -> DrafterSpec:
    model = ModelSpec.from_hf_config(reference_config("qwen3.8-27b"))
    return DrafterSpec.from_speculative({"method": "dflash", "num_speculative_tokens": 7, "draft_config": cfg}, model)


def as_dflash1(cfg: dict) -> dict:
    """The same layers as a DFlash drafter: vLLM builds no convolution or selector for it."""
    return {**cfg, "architectures": ["DFlashDraftModel"]}


def test_the_convolutions_and_the_selector_are_priced():
    assert EXTRA == 291_102_720  # 277.6 MiB, on the rank that holds the drafter
    assert drafter(DFLASH2).weight_bytes - drafter(as_dflash1(DFLASH2)).weight_bytes == EXTRA


def test_the_drafter_says_what_it_is():
    assert "DFlash2" in drafter(DFLASH2).name
    assert "DFlash2" not in drafter(as_dflash1(DFLASH2)).name


def test_each_draft_pass_reads_the_convolutions_and_the_selectors_projection():
    # the codebooks are read by rows (the top-K candidates), the rest whole
    extra_read = drafter(DFLASH2).decode_read_bytes - drafter(as_dflash1(DFLASH2)).decode_read_bytes
    assert extra_read == BASE_KERNELS + KERNEL_PROJECTIONS + HIDDEN_PROJECTION + 7 * 16 * 2 * 256 * 2


def test_a_bf16_dflash2_drafter():
    cfg = {k: v for k, v in DFLASH2.items() if k != "quantization_config"}
    projections = 5 * 2 * 1280 * 5120 * 2
    diff = drafter(cfg).weight_bytes - drafter(as_dflash1(cfg)).weight_bytes
    assert diff == BASE_KERNELS + projections + CODEBOOKS + HIDDEN_PROJECTION


@pytest.mark.parametrize("key", ["conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"])
def test_a_dflash2_config_without_its_figures_is_refused_with_the_key(key):
    cfg = {**DFLASH2, "dflash_config": {k: v for k, v in DFLASH2["dflash_config"].items() if k != key}}
    with pytest.raises(BadRequest, match=rf"dflash_config.*{key}"):
        drafter(cfg)


def test_a_group_that_does_not_divide_the_hidden_size_is_refused_as_vllm_refuses_it():
    cfg = {**DFLASH2, "dflash_config": {**DFLASH2["dflash_config"], "conv_group_size": 48}}
    with pytest.raises(BadRequest, match="conv_group_size=48 must divide hidden_size=5120"):
        drafter(cfg)


# --- the fc over the target's states, in the checkpoint's format --------------------------------

STANDIN = json.loads((FIXTURES / "dflash2_drafter_standin.json").read_text())  # DFlashDraftModel, W4A16


def test_a_quantized_drafters_fc_is_priced_in_its_format():
    """vLLM builds the DFlash ``fc`` (5 target states x hidden -> hidden, qwen3_dflash.py) with the
    checkpoint's quantization config: under W4A16 (targets Linear) it is packed int4 with a bf16
    scale per 128 inputs, not bf16. The planner had priced it in bf16: 194.6 MB (186 MiB) more
    than vLLM holds, on the rank that holds the drafter. Left out of the quantization (the
    checkpoint's ``ignore``), it is bf16 again and nothing else changes."""
    fc_w4a16 = 5120 * (5 * 5120) // 2 + 5120 * (5 * 5120 // 128) * 2
    fc_bf16 = 5120 * (5 * 5120) * 2
    q = STANDIN["quantization_config"]
    fc_kept = {**STANDIN, "quantization_config": {**q, "ignore": [*q["ignore"], "model.fc"]}}
    assert drafter(fc_kept).weight_bytes - drafter(STANDIN).weight_bytes == fc_bf16 - fc_w4a16 == 194_560_000
