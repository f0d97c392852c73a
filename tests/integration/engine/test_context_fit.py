"""The context-fit check after profiling: every rank, vLLM's arithmetic, the limiting rank named."""

from __future__ import annotations

import pytest
import torch

from conftest import FIXTURES


@pytest.fixture(scope="module")
def vllm_config(tmp_path_factory):
    import shutil
    from pathlib import Path

    import vllm.platforms
    from vllm.platforms.cpu import CpuPlatform

    vllm.platforms._current_platform = CpuPlatform()
    from vllm.engine.arg_utils import EngineArgs

    d = tmp_path_factory.mktemp("tiny")
    shutil.copy(FIXTURES / "tiny_qwen3.json", d / "config.json")
    cfg = EngineArgs(model=str(d), load_format="dummy", skip_tokenizer_init=True,
                     max_model_len=4096, pipeline_parallel_size=2,
                     distributed_executor_backend="mp").create_engine_config()
    # EngineCore resolves the physical layout before sizing the cache; do what it does.
    from vllm.v1.kv_cache_layout import KVCacheLayout

    cfg.cache_config.kv_cache_layout = next(iter(KVCacheLayout)).name
    return cfg


def specs(layers: range, block_size: int = 16):
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    return {f"model.layers.{i}.self_attn.attn": spec for i in layers}


# One token of one layer: K and V, 2 heads x 64 dims x 2 bytes each.
PER_TOKEN_LAYER = 2 * 2 * 64 * 2


def test_limiting_rank_is_named_with_the_largest_length_that_fits(vllm_config):
    from vllm_dualgpu.engine.context_fit import ContextDoesNotFit, check_context_fits

    # Rank 0: 1 layer and lots of memory; rank 1: 3 layers and room for ~1000 tokens of them.
    per_block_r1 = 3 * PER_TOKEN_LAYER * 16
    avail = [10 * 1024**3, per_block_r1 * 64]  # 64 blocks on rank 1, one of them the null block
    with pytest.raises(ContextDoesNotFit) as err:
        check_context_fits(vllm_config, [specs(range(0, 1)), specs(range(1, 4))], avail)
    # 63 usable blocks of 16 tokens on rank 1 (vLLM keeps one null block).
    assert err.value.largest == 63 * 16
    msg = str(err.value)
    assert "rank 1 has room for 1,008 tokens" in msg
    # each rank's block as vLLM prices it (3 layers x 16 tokens x 512 bytes on rank 1)
    assert "rank 1: 1,008 tokens in 0.00 GiB, 24 KiB a block of 16 tokens" in msg
    assert "--max-model-len 1008" in msg


def test_fits_when_every_rank_holds_the_context(vllm_config):
    from vllm_dualgpu.engine.context_fit import check_context_fits, per_rank_max_len

    big = 4096 * 4 * PER_TOKEN_LAYER  # more than enough for 4096 tokens on every rank
    check_context_fits(vllm_config, [specs(range(0, 2)), specs(range(2, 4))], [big, big])
    limits = per_rank_max_len(vllm_config, [specs(range(0, 2)), specs(range(2, 4))], [big, big])
    assert all(lim >= 4096 for lim in limits)


def test_agrees_with_vllms_own_check(vllm_config):
    """Where our check says a length does not fit, vLLM's get_kv_cache_configs refuses too."""
    from vllm_dualgpu.engine.context_fit import ContextDoesNotFit, check_context_fits
    from vllm_dualgpu.patches.kv_cache_utils import kv_cache_configs as get_kv_cache_configs

    per_block = 2 * PER_TOKEN_LAYER * 16
    rank_specs = [specs(range(0, 2)), specs(range(2, 4))]
    avail = [per_block * 300, per_block * 100]
    with pytest.raises(ContextDoesNotFit) as err:
        check_context_fits(vllm_config, rank_specs, avail)
    with pytest.raises(ValueError, match="estimated maximum model length is"):
        get_kv_cache_configs(vllm_config, rank_specs, avail)
    # ...and at the length we report, vLLM accepts it.
    vllm_config.model_config.max_model_len = err.value.largest
    try:
        configs = get_kv_cache_configs(vllm_config, rank_specs, avail)
        assert min(c.num_blocks for c in configs) == 100
    finally:
        vllm_config.model_config.max_model_len = 4096


def _applied(kv_budgets: list[int], tp: int = 1):
    from types import SimpleNamespace

    from vllm_dualgpu.engine.planning import AppliedPlan

    plan = SimpleNamespace(ranks=[SimpleNamespace(kv_budget_bytes=b) for b in kv_budgets])
    return AppliedPlan(plan=plan, gpus=[], tp_size=tp)


def test_the_pool_is_sized_from_the_plans_budget_where_vllms_profile_leaves_more(vllm_config, monkeypatch):
    """vLLM's profile runs no attention and comes before FlashInfer's workspaces: where it leaves a
    rank more KV room than the plan (whose peak prediction was checked on the virtual pair), the
    plan's budget is what the rank gets; where it leaves less, vLLM's stands."""
    from vllm_dualgpu.engine.context_fit import cap_to_plan

    G = 1024**3
    assert cap_to_plan(vllm_config, [5 * G, 2 * G], _applied([4 * G, 3 * G])) == [4 * G, 2 * G]
    # a TP group per stage: workers 0-1 are stage 0, 2-3 stage 1
    assert cap_to_plan(vllm_config, [5 * G, 5 * G, 5 * G, 1 * G], _applied([4 * G, 3 * G], tp=2)) \
        == [4 * G, 4 * G, 3 * G, 1 * G]
    # the user's pool is left alone
    monkeypatch.setattr(vllm_config.cache_config, "num_gpu_blocks_override", 100)
    assert cap_to_plan(vllm_config, [5 * G, 2 * G], _applied([4 * G, 3 * G])) == [5 * G, 2 * G]
    monkeypatch.setattr(vllm_config.cache_config, "num_gpu_blocks_override", None)
    monkeypatch.setattr(vllm_config.cache_config, "kv_cache_memory_bytes", 5 * G)
    assert cap_to_plan(vllm_config, [5 * G, 5 * G], _applied([4 * G, 3 * G])) == [5 * G, 5 * G]
    monkeypatch.setattr(vllm_config.cache_config, "kv_cache_memory_bytes", None)
    assert cap_to_plan(vllm_config, [5 * G], None) == [5 * G]  # a stock run


def test_the_executor_caps_before_it_checks_the_context(monkeypatch):
    """PlannedExecutor.determine_available_memory: vLLM's figures, capped, then the context check
    on the capped figures (what vLLM then sizes the pool from)."""
    from types import SimpleNamespace

    from vllm_dualgpu.engine import context_fit
    from vllm_dualgpu.engine.planned_executor import PlannedExecutor

    G = 1024**3

    class Base:
        def determine_available_memory(self):
            return [5 * G, 2 * G]

    class Executor(PlannedExecutor, Base):
        pass

    checked = []
    monkeypatch.setattr(context_fit, "check_context_fits", lambda cfg, specs, available, applied: checked.append(available))
    ex = Executor()
    ex.vllm_config = SimpleNamespace(cache_config=SimpleNamespace(num_gpu_blocks_override=None, kv_cache_memory_bytes=None))
    ex.get_kv_cache_specs = lambda: []
    ex.dualgpu = _applied([4 * G, 3 * G])
    assert ex.determine_available_memory() == [4 * G, 2 * G] and checked == [[4 * G, 2 * G]]
