"""A later pipeline stage holds the hidden states it receives beside its own forward pass, and
vLLM's profile never receives any: the stage's KV room leaves room for them.

Seen on the GPU (vLLM 0.33.0, PP=2 on the virtual pair, 2026-12-02, the float32 identity test's
``small-dense``, hidden 512): rank 1 ran out of memory on its first step, a batch of 29,935 prompt
tokens ("Tried to allocate 176.00 MiB", an MLP activation, with a 0.25 GiB reserve); the two tensors
it had received held 2 x 29,935 x 512 x 4 bytes = 117 MiB of that reserve. ``Worker.execute_model``
(vllm/v1/worker/gpu_worker.py) receives a batch's ``hidden_states`` and ``residual`` into new
tensors (``GroupCoordinator.irecv_tensor_dict`` allocates them with ``torch.empty``) and keeps them
until the step returns; the profile pass reads the runner's persistent ``intermediate_tensors``
instead, which vLLM sized for the largest batch. So a step of a full batch needs that buffer's
size again, on top of what the profile measured.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch
from vllm.sequence import IntermediateTensors
from vllm.v1.worker.gpu_worker import Worker

from vllm_dualgpu import rank_summary
from vllm_dualgpu.engine import worker as w

GiB = 1024**3
MiB = 1024**2


def runner_buffers(tokens: int, hidden: int, dtype) -> IntermediateTensors:
    """What vLLM's runner keeps on a later stage: one tensor per key, sized for the largest batch
    (vllm/v1/worker/gpu/model_runner.py, ``make_empty_intermediate_tensors``)."""
    return IntermediateTensors({k: torch.empty(tokens, hidden, dtype=dtype) for k in ("hidden_states", "residual")})


def test_the_receive_buffers_are_the_runners_persistent_ones_again():
    # 2 tensors x 8,192 tokens x 64 x 4 bytes
    runner = SimpleNamespace(intermediate_tensors=runner_buffers(8192, 64, torch.float32))
    assert w.pp_receive_bytes(runner) == 2 * 8192 * 64 * 4
    assert w.pp_receive_bytes(SimpleNamespace(intermediate_tensors=None)) == 0  # the first stage
    assert w.pp_receive_bytes(SimpleNamespace()) == 0


@pytest.fixture
def stage(monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="vllm.dualgpu")
    logging.getLogger("vllm.dualgpu").propagate = True
    rank_summary.clear()
    monkeypatch.setattr(Worker, "determine_available_memory", lambda self: int(7.0 * GiB))
    monkeypatch.setattr(w.DualGpuWorker, "_warm_pp_communicators", lambda self: None)
    monkeypatch.setattr(w.profile_pass, "first_profile_pass", lambda self: None)
    r = object.__new__(w.DualGpuWorker)
    r.rank, r.device = 1, "cuda:1"
    r.vllm_config = None
    r.cache_config = SimpleNamespace(kv_cache_memory_bytes=None)
    r.requested_memory = int(8.0 * GiB)
    r._dualgpu_rank = None
    yield r
    rank_summary.clear()


def test_a_later_stage_keeps_the_receive_buffers_out_of_its_kv_room(stage, caplog):
    stage.model_runner = SimpleNamespace(model_memory_usage=GiB,
                                         intermediate_tensors=runner_buffers(8192, 1024, torch.bfloat16))
    assert stage.determine_available_memory() == int(7.0 * GiB) - 2 * 8192 * 1024 * 2  # 32 MiB less
    line = next(r.getMessage() for r in caplog.records if "profiled" in r.getMessage())
    assert "less 32 MiB for the hidden states it receives" in line


def test_the_first_stage_keeps_vllms_figure(stage):
    stage.model_runner = SimpleNamespace(model_memory_usage=GiB, intermediate_tensors=None)
    assert stage.determine_available_memory() == int(7.0 * GiB)


def test_a_tp_stage_receives_twice_the_buffer():
    """Each TP rank receives its slice into a full-size tensor and all-gathers it into another
    (``irecv_tensor_dict`` with ``all_gather_group``); both live through the step."""
    runner = SimpleNamespace(intermediate_tensors=runner_buffers(1024, 64, torch.bfloat16))
    assert w.pp_receive_bytes(runner, tp_size=2) == 2 * w.pp_receive_bytes(runner) == 2 * 2 * 1024 * 64 * 2


def test_a_tp_stages_kv_room(stage):
    stage.parallel_config = SimpleNamespace(tensor_parallel_size=2)
    stage.model_runner = SimpleNamespace(model_memory_usage=GiB,
                                         intermediate_tensors=runner_buffers(8192, 1024, torch.bfloat16))
    assert stage.determine_available_memory() == int(7.0 * GiB) - 2 * 32 * MiB
