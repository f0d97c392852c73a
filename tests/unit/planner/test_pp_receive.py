"""A later pipeline stage holds the batch it receives beside its own forward pass (vLLM 0.33's
``Worker.execute_model`` receives ``hidden_states`` and ``residual`` into new tensors and keeps them
through the step; the profile pass uses the runner's persistent buffer instead). The plan charges
it to every stage but the first, as the worker takes it out of the KV room
(tests/integration/engine/test_worker_pp_receive.py): two tensors of the largest batch x the hidden
size, in the model's dtype. Expected sizes are written out from the config's figures."""

from __future__ import annotations

import dataclasses

from vllm_dualgpu.planner import MemoryModel, ModelSpec, reference_config
from vllm_dualgpu.planner.memory import runtime_reserve

MIB = 1 << 20


def _reserve(model, **kw):
    base = dict(first=False, last=True, max_num_batched_tokens=1024, max_num_seqs=2, enforce_eager=False,
                vision=False, mm=MemoryModel())
    return runtime_reserve(model, **{**base, **kw})


def test_a_later_stage_is_charged_the_batch_it_receives():
    model = ModelSpec.from_hf_config(reference_config(), weight_format="fp8")
    assert model.hidden_size == 5120 and model.dtype == "bfloat16"
    # 2 tensors x 1,024 tokens x 5,120 x 2 bytes = 20 MiB (the reference launchers' batch)
    assert _reserve(model)["pp_receive"] == 20 * MIB
    assert _reserve(model, first=False, last=False)["pp_receive"] == 20 * MIB  # a middle stage receives too
    # vLLM's default batch for an LLM on a large card
    assert _reserve(model, max_num_batched_tokens=8192)["pp_receive"] == 160 * MIB


def test_the_first_stage_receives_nothing():
    model = ModelSpec.from_hf_config(reference_config(), weight_format="fp8")
    assert "pp_receive" not in _reserve(model, first=True, last=False)
    assert "pp_receive" not in _reserve(model, first=True, last=True)


def test_float32_doubles_it():
    model = dataclasses.replace(ModelSpec.from_hf_config(reference_config(), weight_format="fp8"), dtype="float32")
    assert _reserve(model)["pp_receive"] == 40 * MIB


def test_the_dtype_vllm_runs_not_the_configs():
    """--dtype float32 on a bf16 checkpoint (the float32 identity runs): four bytes an element."""
    model = ModelSpec.from_hf_config(reference_config(), weight_format="fp8")
    assert _reserve(model, dtype="float32")["pp_receive"] == 40 * MIB
    assert _reserve(model, dtype="auto")["pp_receive"] == 20 * MIB


def test_a_tp_stage_holds_a_second_copy():
    """With TP, vLLM receives each rank's slice into a full-size tensor and all-gathers it into
    another (``irecv_tensor_dict``): the stage's extra reserve carries one more batch."""
    from vllm_dualgpu.planner.topology_shard import shard_config, tp_extra_reserve

    cfg = reference_config()
    full = ModelSpec.from_hf_config(cfg, weight_format="fp8")
    half = ModelSpec.from_hf_config(shard_config(cfg, 2), weight_format="fp8")
    without = tp_extra_reserve(full, half, 2, 2, MemoryModel())
    assert tp_extra_reserve(full, half, 2, 2, MemoryModel(), max_num_batched_tokens=1024) - without == 20 * MIB
    assert tp_extra_reserve(full, half, 1, 2, MemoryModel(), max_num_batched_tokens=1024) == 0


def _dflash_plan(partition):
    import json
    from pathlib import Path

    from vllm_dualgpu.planner import PlanRequest, fit, reference_pair

    drafter = json.loads((Path(__file__).resolve().parents[2] / "fixtures" / "dflash2_drafter_standin.json").read_text())
    model = ModelSpec.from_hf_config(reference_config(), weight_format="int8")
    spec = {"method": "dflash", "num_speculative_tokens": 7, "draft_config": drafter}
    req = PlanRequest(max_model_len=65536, max_num_seqs=2, max_num_batched_tokens=1024, kv_cache_dtype="fp8",
                      enable_prefix_caching=True, speculative=spec, layer_partition=partition, pp_size=2)
    return fit(model, reference_pair(), req).plan


def test_a_dflash_drafters_relayed_hidden_states_are_received_too():
    """The stand-in DFlash2 drafter reads target layers 1, 16, 31, 46 and 61, which vLLM 0.33 names
    2, 17, 32, 47 and 62 (``target_layer_ids`` + 1); a stage starting at layer 19 receives the
    first two beside the batch, one 1,024 x 5,120 bf16 tensor (10 MiB) each
    (``reserve_aux_intermediate_tensor_slots``: ``bisect_right(layers, start_layer)``)."""
    p = _dflash_plan([19, 45])
    assert p.ranks[1].reserve_detail["pp_receive_aux"] == 2 * 10 * MIB
    assert "pp_receive_aux" not in p.ranks[0].reserve_detail
    q = _dflash_plan([13, 51])  # layer 13: only layer 2's
    assert q.ranks[1].reserve_detail["pp_receive_aux"] == 10 * MIB
