"""A refusal of the plan inside EngineCore (it needs the GPUs' free memory, so it cannot be made
in the front end) is logged as one ERROR line before vLLM's own failure report."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest


def test_plan_refusal_is_logged_first(monkeypatch):
    from vllm.platforms import current_platform

    from vllm_dualgpu.engine import executor as ex
    from vllm_dualgpu.engine import planning

    message = "vllm-dualgpu: --max-model-len 262,144 does not fit: the largest that fits is 191,168"

    def refuse(cfg):
        raise ValueError(message)

    monkeypatch.setattr(type(current_platform), "is_cuda", lambda self=None: True)
    monkeypatch.setattr(planning, "apply_plan", refuse)
    monkeypatch.setattr(ex.MultiprocExecutor, "_init_executor", lambda self: pytest.fail("spawned workers"))
    records = []
    handler = logging.Handler(logging.ERROR)
    handler.emit = records.append
    ex.logger.addHandler(handler)
    e = object.__new__(ex.DualGpuExecutor)
    e.parallel_config = SimpleNamespace(pipeline_parallel_size=2, tensor_parallel_size=1,
                                        data_parallel_size=1, nnodes=1)
    e.vllm_config = SimpleNamespace()
    try:
        with pytest.raises(ValueError, match="does not fit"):
            e._init_executor()
    finally:
        ex.logger.removeHandler(handler)
    assert [(r.levelname, r.getMessage()) for r in records] == [("ERROR", message)]
