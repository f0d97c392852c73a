"""vLLM 0.34's extensible KV cache under the dualgpu worker.

vLLM 0.34 sizes the KV cache from memory measured after warm-up and graph capture (on by default
on CUDA) unless a worker says it cannot: ``EngineCore._initialize_kv_caches`` asks the executor,
which asks every worker, and then turns the feature off on all of them, with a warning naming the
reason. The dualgpu worker sizes each rank from its own budget through vLLM's profile (the plan's
model), so it answers; vLLM's ``Worker.disable_extensible_kv_cache`` then recomputes
``requested_memory`` from the start snapshot, which would drop the rank's budget.
Here: vLLM's real executor methods and vLLM's real worker method, on a worker with no device.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
from vllm.v1.worker.gpu_worker import Worker

if not hasattr(Worker, "disable_extensible_kv_cache"):
    pytest.skip("vLLM's extensible KV cache is new in 0.34", allow_module_level=True)

from vllm.config import CacheConfig  # noqa: E402
from vllm.model_executor.model_loader.weight_cache.utils import ExternalWeightCharges  # noqa: E402
from vllm.v1.executor.abstract import Executor  # noqa: E402

from vllm_dualgpu.engine import worker as w  # noqa: E402

GiB = 1024**3
TOTAL = 16 * GiB
BUDGET = 13 * GiB + 123 * 2**20  # free - reserve: not a whole share of the card


def rank() -> w.DualGpuWorker:
    """A rank after init_device: its budget set, vLLM's utilization the budget's share of the card."""
    r = object.__new__(w.DualGpuWorker)
    r.cache_config = CacheConfig(enable_extensible_kv_cache=True, gpu_memory_utilization=0.5)
    r.vllm_config = SimpleNamespace(cache_config=r.cache_config)
    r.init_snapshot = SimpleNamespace(total_memory=TOTAL, free_memory=15 * GiB, device_="cuda:0")
    r._external_weight_charges = ExternalWeightCharges()
    r.requested_memory = BUDGET
    return r


class Engine:
    """vLLM's executor methods, their collective RPC answered by dualgpu ranks in this process."""

    def __init__(self, ranks):
        self.ranks = ranks
        self.vllm_config = SimpleNamespace(cache_config=CacheConfig(enable_extensible_kv_cache=True),
                                           kv_transfer_config=None)

    def collective_rpc(self, method, args=()):
        return [getattr(r, method)(*args) for r in self.ranks]


def test_vllm_turns_the_extensible_kv_cache_off_on_every_rank_and_says_why(caplog):
    ranks = [rank(), rank()]
    engine = Engine(ranks)
    specs = [{"layer.0": object()}, {"layer.1": object()}]  # both ranks hold KV layers
    reason = Executor.extensible_kv_cache_unsupported_reason(engine, specs)
    assert reason is not None and reason.startswith("vllm-dualgpu sizes each rank's KV cache")
    with caplog.at_level(logging.WARNING):
        Executor.disable_extensible_kv_cache(engine, reason)
    assert engine.vllm_config.cache_config.enable_extensible_kv_cache is False
    assert all(r.cache_config.enable_extensible_kv_cache is False for r in ranks)
    assert f"Disabling the extensible KV cache: {reason}" in caplog.text


def test_the_rank_keeps_its_budget_where_vllm_recomputes_it():
    stock, ours = rank(), rank()
    Worker.disable_extensible_kv_cache(stock)  # vLLM's: utilization x total, from the snapshot
    assert stock.requested_memory == TOTAL // 2 != BUDGET
    ours.disable_extensible_kv_cache()
    assert ours.requested_memory == BUDGET
    assert ours.cache_config.enable_extensible_kv_cache is False
