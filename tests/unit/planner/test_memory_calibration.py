"""The runtime memory model's terms calibrated on the virtual pair (vLLM 0.33.0, 2026-12-02,
benchmarks/results/2026-12-02-headline-virtual-run5): FlashInfer's workspace buffers, the CUDA
graphs of a small batch, the memory a process holds before vLLM's snapshot without NVLink, and the
pipeline's NCCL buffers over PCIe. The sizes asserted here are written out from the measurements
and from vLLM 0.33's sources, not read back from the code under test.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from vllm_dualgpu import planner as P
from vllm_dualgpu.planner import GpuFacts, MemoryModel, ModelSpec, PlanRequest, fit, reference_config
from vllm_dualgpu.planner.memory import attention_uses_flashinfer, runtime_reserve

MIB = 1 << 20
GIB = 1 << 30
# vLLM 0.33: envs.VLLM_FLASHINFER_WORKSPACE_BUFFER_SIZE's default (394 MiB), one buffer per FlashInfer
# metadata builder set (v1/worker/gpu/attn_utils.py shares one across the target's groups; the
# drafter's speculator calls init_attn_backend again: a second buffer on the last rank)
FLASHINFER_WS = 394 * MIB
ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize("kv, caps, expected", [
    ("fp8", [(8, 9), (12, 0)], True),   # the reference pair: FA2 has no fp8 KV, FA3 is SM 9.0 only
    ("fp8", [(8, 9), (9, 0)], True),    # mismatched ranks: the executor sets FlashInfer on both
    ("fp8", [(9, 0), (9, 0)], False),   # two Hopper cards: FlashAttention 3 takes fp8 KV
    ("fp8_e4m3", [(8, 9), (8, 9)], True),
    ("auto", [(8, 9), (12, 0)], False),  # bf16 KV: FlashAttention first in vLLM's list
    ("auto", [(10, 0), (10, 0)], True),  # SM 10.x lists FlashInfer first
    ("fp8", [None, None], True),        # capability unknown: charge it (the safe side)
    ("auto", [None, (8, 9)], False),
])
def test_which_pairs_run_flashinfer(kv, caps, expected):
    assert attention_uses_flashinfer(kv, caps) is expected


def _model():
    return ModelSpec.from_hf_config(reference_config(), weight_format="fp8")


def _reserve(**kw):
    base = dict(first=False, last=True, max_num_batched_tokens=1024, max_num_seqs=2, enforce_eager=False,
                vision=False, mm=MemoryModel())
    return runtime_reserve(_model(), **{**base, **kw})


def test_flashinfer_workspace_once_per_rank_and_once_more_for_the_drafter():
    plain = _reserve(first=True, last=False)
    fi = _reserve(first=True, last=False, flashinfer=True)
    assert "flashinfer_workspace" not in plain
    assert fi["flashinfer_workspace"] == FLASHINFER_WS
    assert sum(fi.values()) - sum(plain.values()) == FLASHINFER_WS
    last = _reserve(flashinfer=True, drafter_flashinfer=True)
    assert last["flashinfer_workspace"] == 2 * FLASHINFER_WS
    # a drafter's own buffer only on the last rank, where the drafter runs
    assert _reserve(first=True, last=False, flashinfer=True, drafter_flashinfer=True)["flashinfer_workspace"] \
        == FLASHINFER_WS


def test_graphs_of_a_small_batch_are_charged_half():
    """vLLM 0.33 captures up to min(max_num_seqs x decode query length x 2, 512) tokens
    (config/vllm.py, _set_cudagraph_sizes). With 2 sequences the graphs took 0.07-0.20 GiB a rank
    on the virtual pair; the flat 512 MiB stays for vLLM's serving defaults."""
    assert _reserve(decode_query_len=4)["cuda_graphs"] == 256 * MIB     # 2 x 4 x 2 = 16 tokens
    assert _reserve(decode_query_len=8)["cuda_graphs"] == 256 * MIB     # 32 tokens (DFlash, 7 drafts)
    assert _reserve(max_num_seqs=256)["cuda_graphs"] == 512 * MIB
    assert _reserve(max_num_seqs=16, decode_query_len=4)["cuda_graphs"] == 512 * MIB  # 128 tokens
    assert "cuda_graphs" not in _reserve(enforce_eager=True, decode_query_len=4)


def test_pipeline_buffers_over_pcie():
    """The worker measured 0.09 GiB of pipeline NCCL buffers on each rank of the virtual pair."""
    assert _reserve()["pp_comms"] == 128 * MIB
    assert _reserve(nvlink=True)["pp_comms"] == int(1.04 * GIB)


def _card(name, gib, cc, nvlink=False):
    return GpuFacts(0, name, gib * GIB, gib * GIB, 1000, cc, nvlink=nvlink)


def _fit(gpus, **kw):
    model = _model()
    req = PlanRequest(max_model_len=32768, kv_cache_dtype="fp8", max_num_seqs=2, max_num_batched_tokens=1024,
                      layer_partition=[20, 44], gpu_order=[0, 1], **kw)
    return fit(model, gpus, req).plan


def test_context_before_the_snapshot_by_link():
    """1.06 GiB a process before vLLM's snapshot on the virtual pair (16 - 14.94 and 32 - 30.94 GiB
    free, both ranks); the NVLink H200 calibration's 1.4 GiB stays where every card has NVLink."""
    pcie = [dataclasses.replace(_card("A", 16, (8, 9)), index=0), dataclasses.replace(_card("B", 32, (9, 0)), index=1)]
    nvl = [dataclasses.replace(g, nvlink=True) for g in pcie]
    assert _fit(pcie).ranks[0].fixed_detail["cuda_context"] == int(1.06 * GIB)
    assert _fit(nvl).ranks[0].fixed_detail["cuda_context"] == int(1.4 * GIB)


def test_the_plan_charges_flashinfer_on_the_reference_pair_with_fp8_kv():
    pair = [dataclasses.replace(_card("RTX 4070 Ti SUPER", 16, (8, 9)), index=0),
            dataclasses.replace(_card("RTX 5090", 32, (12, 0)), index=1)]
    p = _fit(pair, speculative={"method": "mtp", "num_speculative_tokens": 3})
    assert p.ranks[0].reserve_detail["flashinfer_workspace"] == FLASHINFER_WS
    assert p.ranks[1].reserve_detail["flashinfer_workspace"] == 2 * FLASHINFER_WS  # target + MTP drafter
    # a drafter whose attention backend is chosen (the DFlash2 launchers' TRITON_ATTN) has no buffer of its own
    q = _fit(pair, speculative={"method": "mtp", "num_speculative_tokens": 3, "attention_backend": "TRITON_ATTN"})
    assert q.ranks[1].reserve_detail["flashinfer_workspace"] == FLASHINFER_WS


def test_the_budget_a_worker_hands_vllm_leaves_out_what_vllm_allocates_after_sizing():
    from vllm_dualgpu.planner.gpus import rank_budget

    assert rank_budget(16 * GIB, GIB) == 15 * GIB
    assert rank_budget(16 * GIB, GIB, after_profile_bytes=FLASHINFER_WS) == 15 * GIB - FLASHINFER_WS
    assert rank_budget(16 * GIB, GIB, cap_bytes=10 * GIB, after_profile_bytes=FLASHINFER_WS) == 10 * GIB - FLASHINFER_WS


@pytest.mark.parametrize("caps", [[(8, 9), (9, 0)], [(8, 9), (12, 0)], [(9, 0), (12, 0)], [(9, 0), (9, 0)],
                                  [(8, 9), (8, 9)]])
@pytest.mark.parametrize("kv", ["fp8", "auto"])
def test_where_the_executor_sets_flashinfer_the_plan_charges_its_workspace(caps, kv):
    """The planner's rule and the executor's (engine/attention_backend.py) are two answers to one
    fact: wherever the executor puts FlashInfer on every rank, the plan charges its workspace."""
    from vllm_dualgpu.engine.attention_backend import COMMON_BACKEND, decide_common_backend

    backend, _ = decide_common_backend(caps, kv, None, specs_carry_alignment=True)
    if backend == COMMON_BACKEND:
        assert attention_uses_flashinfer(kv, caps)


@pytest.mark.parametrize("spec,target_flashinfer,expected", [
    ({"method": "dflash"}, True, "TRITON_ATTN"),  # the reference launchers' DRAFT_ATTN
    ({"method": "dflash"}, False, None),  # the target's backend, as in vLLM
    ({"method": "dflash", "attention_backend": "FLASHINFER"}, True, "FLASHINFER"),  # the user's
    ({"method": "dflash", "attention_backend": "flash_attn"}, True, "FLASH_ATTN"),
    ({"method": "mtp"}, True, None),  # MTP shares the target's attention KV layout
    ({"method": "eagle3"}, True, None),
    (None, True, None),
])
def test_the_drafters_backend(spec, target_flashinfer, expected):
    from vllm_dualgpu.planner.memory import drafter_attention_backend

    assert drafter_attention_backend(spec, target_flashinfer) == expected


def test_a_dflash_drafter_off_flashinfer_holds_no_second_workspace():
    """Zero flags on the reference pair (fp8 KV, mismatched cards: the target on FlashInfer): the
    DFlash drafter runs on TRITON_ATTN, the last rank holds one FlashInfer workspace; a drafter the
    user puts on FlashInfer holds its own as well."""
    drafter = json.loads((ROOT / "tests" / "fixtures" / "dflash2_drafter_standin.json").read_text())
    model = P.ModelSpec.from_hf_config(P.reference_config(), weight_format="fp8")
    gpus = P.parse_gpus("RTX 4070 Ti SUPER:display=no,RTX 5090:display=yes")

    def last_rank(spec):
        req = P.PlanRequest(max_model_len=131_072, kv_cache_dtype="fp8", max_num_seqs=2, max_num_batched_tokens=1024,
                            speculative={"method": "dflash", "num_speculative_tokens": 7, "draft_config": drafter, **spec},
                            enable_prefix_caching=True, layer_partition=[19, 45], gpu_order=[0, 1])
        return P.fit(model, gpus, req).plan

    plain, on_fi = last_rank({}), last_rank({"attention_backend": "FLASHINFER"})
    assert plain.ranks[1].reserve_detail["flashinfer_workspace"] == FLASHINFER_WS
    assert on_fi.ranks[1].reserve_detail["flashinfer_workspace"] == 2 * FLASHINFER_WS
    assert any("TRITON_ATTN" in n for n in plain.notes) and not any("TRITON_ATTN" in n for n in on_fi.notes)
