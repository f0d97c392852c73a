"""The executor prices the plan's KV cache with vLLM's own (patched) functions.

Real VllmConfigs on the CPU platform, the registry's engine-side patches applied as the
executor applies them. Where stock vLLM and the package's KV patches group alike (dense, a
hybrid with MTP), vLLM's pricing must give the pure mirror's plan exactly. Where the patches
group otherwise (a drafter with its own attention spec next to a hybrid model), the mirror prices
the patches' grouping (planner/kv_grouping.per_rank_grouping), and the executor's plan must still be the
mirror's and what vLLM's run-time ``get_kv_cache_configs`` gives for the same per-rank memory.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from vllm_dualgpu.engine import kv_pricing, planning
from vllm_dualgpu.planner import ModelSpec, parse_gpus, reference_config

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "gpu"))
import gpu_models

GPUS = "RTX 4070 Ti SUPER:16GiB,RTX 5090:32GiB"
# Qwen3-14B, the planner's bundled reference shapes (unquantized).
DENSE = {k: v for k, v in reference_config("qwen3-14b").items()
         if not k.startswith("_") and k != "quantization_config"}
# An EAGLE3 drafter whose attention spec differs from the hybrid target's (4 KV heads x 64, the
# target 2 x 128: the same bytes per token, another spec), as DFlash drafters next to Qwen3.5.
OWN_SPEC_DRAFTER = {**gpu_models.EAGLE3_CONFIG, "num_key_value_heads": 4, "head_dim": 64}
HYBRID_ARGS = {"max_model_len": 4096, "max_num_seqs": 4, "max_num_batched_tokens": 2048,
               "mamba_ssm_cache_dtype": "float32"}


@pytest.fixture(scope="module", autouse=True)
def engine_patches():
    """The engine-side patches, as DualGpuExecutor applies them before planning."""
    import vllm.platforms
    from vllm.platforms.cpu import CpuPlatform

    vllm.platforms._current_platform = CpuPlatform()
    from vllm_dualgpu import plugin
    from vllm_dualgpu.process import ENGINE

    plugin.ensure(frozenset({ENGINE}))


def priced(vllm_config):
    """(the mirror's plan, the executor's plan, vLLM's pool for it) on the reference pair."""
    model = ModelSpec.from_hf_config(vllm_config.model_config.hf_config.to_dict())
    request = planning.plan_request(vllm_config, None)
    gpus = parse_gpus(GPUS)
    mirror = planning.plan_or_explain(model, gpus, request)
    plan, pool = kv_pricing.reprice(
        vllm_config, mirror, lambda groupings: planning.plan_or_explain(model, gpus, request, kv_groupings=groupings))
    return mirror, plan, pool


def runtime_blocks(vllm_config, plan) -> tuple[int, list[int]]:
    """What vLLM's run-time planning gives the plan's split: get_kv_cache_configs on every
    rank's specs with the plan's KV memory (the patched path EngineCore takes)."""
    from vllm_dualgpu.engine.vllm_kv import pool_bytes_per_block
    from vllm_dualgpu.patches.kv_cache_utils import kv_cache_configs

    specs = kv_pricing.rank_specs(kv_pricing.layer_specs(vllm_config, plan.kv), plan.kv, plan.partition)
    with kv_pricing._layout_resolved(vllm_config):
        configs = kv_cache_configs(vllm_config, specs, [r.kv_budget_bytes for r in plan.ranks])
        return configs[0].num_blocks, [pool_bytes_per_block(vllm_config, c.kv_cache_groups) for c in configs]


def assert_agrees(mirror, plan, pool):
    assert plan is mirror, "vLLM's grouping agrees: the mirror's plan stands"
    assert pool.num_blocks == mirror.num_blocks
    assert list(pool.bytes_per_block) == [r.kv_bytes_per_block for r in mirror.ranks]
    # vLLM's estimate searches up to the configured --max-model-len.
    assert pool.max_model_len == min(mirror.kv_max_context_tokens, mirror.max_model_len)


def test_dense_fp8_agrees_with_the_mirror(engine_config, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(DENSE))
    vc = engine_config(model=str(tmp_path), load_format="dummy", skip_tokenizer_init=True,
                       pipeline_parallel_size=2, distributed_executor_backend="dualgpu",
                       max_model_len=32768, kv_cache_dtype="fp8")
    assert_agrees(*priced(vc))


def test_hybrid_with_mtp_agrees_with_the_mirror(qwen3_5_hybrid_config):
    vc = qwen3_5_hybrid_config(**HYBRID_ARGS, speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    assert_agrees(*priced(vc))


@pytest.fixture(scope="module")
def own_spec_drafter_config(qwen3_5_hybrid_config, tmp_path_factory):
    draft = gpu_models.write_config_only(OWN_SPEC_DRAFTER, tmp_path_factory.mktemp("own-spec-drafter"))
    return qwen3_5_hybrid_config(**HYBRID_ARGS, speculative_config={
        "method": "eagle3", "model": str(draft), "num_speculative_tokens": 2})


def test_drafter_with_its_own_spec_is_priced_as_vllm_runs_it(own_spec_drafter_config, caplog):
    import dataclasses

    from vllm_dualgpu.planner import plan as pure_plan

    vc = own_spec_drafter_config
    caplog.set_level(logging.INFO, logger="vllm.dualgpu")
    logging.getLogger("vllm.dualgpu").propagate = True
    mirror, plan, pool = priced(vc)
    # Stock grouping cuts every bucket to the size of the drafter's, one layer: 6 Gated
    # DeltaNet + 2 attention + 1 drafter layer make 9 groups of one. With 544-token blocks (the
    # hybrid alignment) a 4096-token request takes 8 blocks per attention group and 2 + 2
    # speculative per Gated DeltaNet group ("align" mode), so 3 x 8 + 6 x 4 = 48 there.
    model = ModelSpec.from_hf_config(vc.model_config.hf_config.to_dict())
    request = planning.plan_request(vc, None)
    stock = pure_plan(model, parse_gpus(GPUS), dataclasses.replace(request, kv_grouping="stock"))
    assert len(stock.kv.groups) == 9
    assert stock.block_size == 544
    assert stock.kv.blocks_per_request(4096) == 3 * 8 + 6 * 4
    # The mirror prices the package's grouping (fewer groups), and it is vLLM's: the plan stands
    assert mirror.kv.grouping == "dualgpu" and len(mirror.kv.groups) < 9
    assert plan is mirror
    assert not any("priced with vLLM's grouping" in r.getMessage() for r in caplog.records)
    # The executor's pool is what vLLM's run-time planning gives the same split and memory.
    blocks, bpb = runtime_blocks(vc, plan)
    assert (plan.num_blocks, [r.kv_bytes_per_block for r in plan.ranks]) == (blocks, bpb)
    assert pool.num_blocks == blocks
    # ... and a request takes fewer blocks than under the padded stock grouping.
    assert plan.kv.blocks_per_request(4096) < 48
    assert plan.max_concurrency > stock.max_concurrency


def test_layers_vllm_would_size_otherwise_keep_the_mirror(own_spec_drafter_config, caplog):
    """A state size the planner and vLLM's model class disagree on: no half-priced plan, the
    mirror's stands and a WARNING says why."""
    import dataclasses

    vc = own_spec_drafter_config
    model = ModelSpec.from_hf_config(vc.model_config.hf_config.to_dict())
    mirror = planning.plan_or_explain(model, parse_gpus(GPUS), planning.plan_request(vc, None))
    wrong = dataclasses.replace(mirror, kv=dataclasses.replace(mirror.kv, mamba_page_bytes=mirror.kv.mamba_page_bytes + 2))
    caplog.set_level(logging.WARNING, logger="vllm.dualgpu")
    logging.getLogger("vllm.dualgpu").propagate = True
    plan, pool = kv_pricing.reprice(vc, wrong, lambda groupings: pytest.fail("searched again"))
    assert plan is wrong and pool is None
    assert any("Gated DeltaNet state" in r.getMessage() and "planner's own arithmetic" in r.getMessage()
               for r in caplog.records)


def test_a_failing_vllm_function_leaves_the_whole_mirror_plan(own_spec_drafter_config, monkeypatch, caplog):
    from vllm_dualgpu.engine import vllm_kv

    vc = own_spec_drafter_config
    model = ModelSpec.from_hf_config(vc.model_config.hf_config.to_dict())
    mirror = planning.plan_or_explain(model, parse_gpus(GPUS), planning.plan_request(vc, None))

    def renamed(*a, **k):
        raise AttributeError("module has no attribute '_project_kv_cache_groups_to_worker'")

    monkeypatch.setattr(vllm_kv, "groups_for_ranks", renamed)
    caplog.set_level(logging.WARNING, logger="vllm.dualgpu")
    logging.getLogger("vllm.dualgpu").propagate = True
    plan, pool = kv_pricing.reprice(vc, mirror, lambda groupings: pytest.fail("searched again"))
    assert plan is mirror and pool is None
    assert any("planner's own arithmetic only: AttributeError" in r.getMessage() for r in caplog.records)
    assert vc.cache_config.kv_cache_layout is None  # the stand-in layout was taken back
