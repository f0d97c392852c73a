"""A rank that runs out of memory while serving (a step of execute_model, or the sampling step
vLLM runs apart from it) says so, naming itself and the fix, and ends its process: in vLLM's
multiproc executor only the output rank reports an exception, so an error raised on rank 0
would leave rank 1 waiting for its activations until VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS
(300 s). A dead worker makes vLLM shut the engine down at once (the SIGKILL fault case on the
GPU: every request failed within 9 s). Other errors keep vLLM's own handling."""

from __future__ import annotations

import pytest
import torch

from vllm_dualgpu import envs
from vllm_dualgpu.engine import worker as w
from worker_fakes import ending_rank

GiB = 1024**3
STEPS = [name for name in ("execute_model", "sample_tokens") if hasattr(w.Worker, name)]


@pytest.fixture
def rank(monkeypatch, caplog):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d: (300 * 1024**2, 16 * GiB))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d: "NVIDIA GeForce RTX 4070 Ti SUPER")
    return ending_rank(monkeypatch, caplog, 0, "NVIDIA GeForce RTX 4070 Ti SUPER", GiB, 16)


def failing(monkeypatch, name, exc):
    def step(self, *args, **kwargs):
        raise exc

    monkeypatch.setattr(w.Worker, name, step)


@pytest.mark.parametrize("name", STEPS)
def test_out_of_memory_while_serving_names_the_rank_and_ends_it(rank, monkeypatch, caplog, name):
    failing(monkeypatch, name, torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.50 GiB"))
    with pytest.raises(SystemExit) as done:
        getattr(rank, name)(None)
    assert done.value.code == 1
    msg = [r.getMessage() for r in caplog.records if "ran out of memory" in r.getMessage()][0]
    assert "rank 0 (NVIDIA GeForce RTX 4070 Ti SUPER) ran out of memory while serving" in msg
    assert "0.29 GiB free of 16.00 GiB; reserve 1.00 GiB" in msg and "Tried to allocate 1.50 GiB" in msg
    assert f"{envs.RESERVE} (e.g. 2.00 GiB)" in msg and "--max-num-batched-tokens" in msg


@pytest.mark.parametrize("name", STEPS)
def test_other_errors_while_serving_are_vllms(rank, monkeypatch, caplog, name):
    failing(monkeypatch, name, ValueError("bad request shape"))
    with pytest.raises(ValueError, match="bad request shape"):
        getattr(rank, name)(None)
    assert "ran out of memory" not in caplog.text


def test_a_step_that_succeeds_returns_vllms_output(rank, monkeypatch):
    monkeypatch.setattr(w.Worker, "execute_model", lambda self, out: ("ran", out))
    assert rank.execute_model("scheduler output") == ("ran", "scheduler output")
