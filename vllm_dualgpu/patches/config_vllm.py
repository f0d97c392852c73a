"""Patches of ``vllm.config.vllm``: in-flight batches under PP with async scheduling.

vLLM 0.30's ``VllmConfig.max_concurrent_batches`` returns ``pp_size + 1`` when async scheduling
runs on the V2 model runner. With a drafter (MTP) under PP that extra batch lets both GPUs spin
forever (vLLM issue #53402). Under the dualgpu executor with PP > 1 the property returns
``pp_size`` instead, which still fills every pipeline stage. The property is read by EngineCore
(batch queue depth, scheduler) and by workers (the V2 runner's default concurrency), and the
config travels to both, so the patch is applied in both and decides from the config alone.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from vllm_dualgpu.patches.spec_common import is_dualgpu_pp, uses_v2_model_runner


def capped_batches(vllm_config: object, stock: int) -> int:
    """The value the patched property returns, given the stock value."""
    if not is_dualgpu_pp(vllm_config):
        return stock
    cfg = vllm_config  # a VllmConfig (is_dualgpu_pp checked its parallel_config)
    if not (cfg.scheduler_config.async_scheduling and uses_v2_model_runner(cfg)):  # type: ignore[attr-defined]
        return stock
    return min(stock, cfg.parallel_config.pipeline_parallel_size)  # type: ignore[attr-defined]


def wrap_max_concurrent_batches(original: Callable) -> Callable:
    @functools.wraps(original)
    def max_concurrent_batches(self) -> int:
        return capped_batches(self, original(self))

    return max_concurrent_batches
