"""kv-groups-know-ranks: vLLM's ``get_kv_cache_configs`` records every rank's layers and memory
for the grouping while it runs (dualgpu with PP > 1 only); what it returns is vLLM's own."""

from __future__ import annotations

import pytest
import torch

from conftest import apply_registry_patch
from spec_pp import kv_layout, pp_configs  # noqa: F401  (shared fixtures)
from vllm_dualgpu.patches import kv_cache_utils as kvp
from vllm_dualgpu.patching.core import revert_patch


@pytest.fixture
def know_ranks(vllm_version, monkeypatch):
    from vllm_dualgpu.patching.registry import for_version

    if for_version("kv-groups-know-ranks", vllm_version).name != "kv-groups-know-ranks":
        pytest.skip(f"vLLM {vllm_version} has its own entry (test_patch_kv_groups_know_ranks_033.py)")
    from vllm.v1.core import kv_cache_utils as ku

    patch = apply_registry_patch("kv-groups-know-ranks", vllm_version)
    seen = []
    stock_groups = ku.get_kv_cache_groups

    def spy(*a, **kw):  # what the grouping sees while the patched function runs
        seen.append(kvp._WORKERS.get())
        return stock_groups(*a, **kw)

    monkeypatch.setattr(ku, "get_kv_cache_groups", spy)
    yield ku, seen
    revert_patch(patch)


def specs():
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    attn = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    return [{"model.layers.0.attn": attn}, {"model.layers.1.attn": attn}]


def test_ranks_known_during_the_call_and_result_is_vllms(know_ranks, kv_layout):
    ku, seen = know_ranks
    cfg = kv_layout["dualgpu"]
    memory = [1 << 30, 1 << 29]
    got = ku.get_kv_cache_configs(cfg, specs(), memory)
    stock = ku.get_kv_cache_configs.__wrapped__(cfg, specs(), memory)
    assert seen and seen[0] is not None, "the grouping did not see the ranks"
    assert seen[0].memory == tuple(memory)
    assert [set(s) for s in seen[0].specs] == [{"model.layers.0.attn"}, {"model.layers.1.attn"}]
    assert seen[-1] is None  # the stock call after it saw nothing: recorded only for the call
    assert [c.num_blocks for c in got] == [c.num_blocks for c in stock]
    assert kvp._WORKERS.get() is None  # reset afterwards


def test_other_executors_record_nothing(know_ranks, kv_layout):
    ku, seen = know_ranks
    ku.get_kv_cache_configs(kv_layout["mp"], specs(), [1 << 30, 1 << 30])
    assert seen == [None]
