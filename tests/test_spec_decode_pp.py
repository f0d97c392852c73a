"""Speculative decoding under PP (issue #6): each patch on real vLLM objects, stock vs patched.

Every test shows the stock behaviour (vLLM's original, reached through ``__wrapped__`` or by
reverting the patch) and the patched one, so each fails without its patch.
"""

from __future__ import annotations

import functools
import pickle
import shutil
import sys
import types

import pytest
import torch
from torch import nn

from conftest import apply_registry_patch, registry_patch
from vllm_dualgpu.patching.core import ALREADY, APPLIED, SENTINEL, Patch, apply_patch, revert_patch
from vllm_dualgpu.patching.registry import for_version
from vllm_dualgpu.process import ACTIVE_ENV

from pathlib import Path

FIXTURES = Path(__file__).parent / "fixtures"


@pytest.fixture(scope="module")
def applied(vllm_version):
    """Apply one registry patch for the module; give vLLM back its original afterwards."""
    done: list[Patch] = []

    def _apply(name: str) -> Patch:
        patch = for_version(name, vllm_version)  # the entry for this vLLM (names may differ)
        if patch is None:
            pytest.skip(f"{name} is not needed on vLLM {vllm_version}")
        done.append(apply_registry_patch(patch.name, vllm_version))
        return done[-1]

    yield _apply
    for patch in done:
        revert_patch(patch)


@pytest.fixture
def active(monkeypatch):
    monkeypatch.setenv(ACTIVE_ENV, "1")


# --- core: property targets -------------------------------------------------------------------


def test_property_getter_is_wrapped_and_reverted(monkeypatch):
    mod = types.ModuleType("fake_prop_target")
    exec(
        "class C:\n"
        "    def __init__(self):\n        self._v = 3\n"
        "    @property\n    def v(self):\n        '''doc'''\n        return self._v\n"
        "    @v.setter\n    def v(self, value):\n        self._v = value\n",
        mod.__dict__,
    )
    factories = types.ModuleType("fake_prop_factories")

    def plus_ten(original):
        @functools.wraps(original)
        def getter(self):
            return original(self) + 10

        return getter

    factories.plus_ten = plus_ten
    monkeypatch.setitem(sys.modules, "fake_prop_target", mod)
    monkeypatch.setitem(sys.modules, "fake_prop_factories", factories)
    p = Patch(
        name="prop",
        target="fake_prop_target:C.v",
        processes=("engine",),
        vllm_versions=">=0.30.0,<0.31",
        why="w",
        upstream="u",
        remove_when="r",
        factory="fake_prop_factories:plus_ten",
        params=("self",),
    )
    obj = mod.C()
    assert apply_patch(p, "0.30.0").status == APPLIED
    raw = vars(mod.C)["v"]
    assert isinstance(raw, property) and raw.__doc__ == "doc"
    assert obj.v == 13
    obj.v = 5  # the setter survives
    assert obj.v == 15
    assert apply_patch(p, "0.30.0").status == ALREADY and obj.v == 15
    assert revert_patch(p) and isinstance(vars(mod.C)["v"], property) and obj.v == 5


# --- item 2: in-flight batches under PP -------------------------------------------------------


@pytest.fixture(scope="module")
def pp_configs(vllm_version, tmp_path_factory):
    """Real VllmConfigs of a tiny Qwen3 with PP=2 (dualgpu and mp) and PP=1 (dualgpu)."""
    from vllm_dualgpu.patches.arg_utils import wrap_create_engine_config
    from vllm.engine.arg_utils import EngineArgs

    d = tmp_path_factory.mktemp("tiny-qwen3")
    shutil.copy(FIXTURES / "tiny_qwen3.json", d / "config.json")
    create = getattr(EngineArgs.create_engine_config, "__wrapped__", None)
    create = wrap_create_engine_config(create or EngineArgs.create_engine_config)

    def make(backend, pp):
        args = EngineArgs(
            model=str(d),
            load_format="dummy",
            skip_tokenizer_init=True,
            pipeline_parallel_size=pp,
            distributed_executor_backend=backend,
        )
        cfg = create(args)
        # vLLM's CPU platform turns async scheduling off; on GPUs it is on by default for
        # an executor that supports it (MultiprocExecutor and its dualgpu subclass do).
        cfg.scheduler_config.async_scheduling = True
        return cfg

    return {"dualgpu": make("dualgpu", 2), "mp": make("mp", 2), "dualgpu-pp1": make("dualgpu", 1)}


def test_inflight_batches_capped_at_pp_size(applied, pp_configs, monkeypatch):
    from vllm.config import VllmConfig

    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    applied("pp-inflight-batches")
    stock = VllmConfig.max_concurrent_batches.fget.__wrapped__
    cfg = pp_configs["dualgpu"]
    assert cfg.use_v2_model_runner and cfg.scheduler_config.async_scheduling
    assert stock(cfg) == 3  # vLLM 0.30: pp_size + 1
    assert cfg.max_concurrent_batches == 2
    # Workers unpickle the config and read the same property.
    assert pickle.loads(pickle.dumps(cfg)).max_concurrent_batches == 2
    # max_in_flight_tokens derives from it (scheduler reservations).
    assert cfg.max_in_flight_tokens == 2 * cfg.scheduler_config.max_num_batched_tokens


def test_inflight_batches_stock_elsewhere(applied, pp_configs, monkeypatch):
    from vllm.config import VllmConfig

    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    applied("pp-inflight-batches")
    stock = VllmConfig.max_concurrent_batches.fget.__wrapped__
    for key in ("mp", "dualgpu-pp1"):
        cfg = pp_configs[key]
        assert cfg.max_concurrent_batches == stock(cfg), key
    cfg = pp_configs["dualgpu"]
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")  # V1 runner: vLLM returns pp_size
    assert cfg.max_concurrent_batches == stock(cfg) == 2
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    cfg.scheduler_config.async_scheduling = False
    try:
        assert cfg.max_concurrent_batches == stock(cfg) == 2
    finally:
        cfg.scheduler_config.async_scheduling = True


def test_inflight_batches_revert_restores_stock(vllm_version, pp_configs, monkeypatch):
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    patch = registry_patch("pp-inflight-batches")
    assert apply_patch(patch, vllm_version).status in (APPLIED, ALREADY)
    assert pp_configs["dualgpu"].max_concurrent_batches == 2
    assert revert_patch(patch)
    assert pp_configs["dualgpu"].max_concurrent_batches == 3


# --- a Mamba/GDN spec (item 6 needs no patch in vLLM 0.30: tests/test_mamba_hit_flow.py) ------


def mamba_spec(block_size: int):
    from vllm.v1.kv_cache_interface import MambaSpec

    return MambaSpec(
        block_size=block_size,
        shapes=((2, 4), (2, 4, 4)),
        dtypes=(torch.bfloat16, torch.bfloat16),
        mamba_cache_mode="align",
    )


# --- item 1: the drafter shares the target's embedding under PP --------------------------------


class FakeDraft(nn.Module):
    """Stands in for an MTP drafter: ``.model.embed_tokens``, no has_own_embed_tokens."""

    def __init__(self, vocab=32, hidden=8):
        super().__init__()
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(vocab, hidden)


@pytest.fixture
def pp_group(pp_stage):
    """A two-stage PP group seen from the last rank (the drafter lives there)."""
    return pp_stage(1, 2)


def test_drafter_shares_target_embedding_under_pp(applied, active, pp_group):
    from vllm.v1.worker.gpu.spec_decode.dflash import utils as dflash_utils
    from vllm.v1.worker.gpu.spec_decode.eagle import utils as eagle_utils

    patch = applied("drafter-shares-target-embed")
    share = eagle_utils.maybe_share_target_embed
    assert getattr(share, SENTINEL) == patch.name
    assert dflash_utils.maybe_share_target_embed is share  # the from-import copy is rebound

    target_inner = nn.Module()
    target_inner.embed_tokens = nn.Embedding(32, 8)

    stock_draft = FakeDraft()
    own = stock_draft.model.embed_tokens
    share.__wrapped__(stock_draft, stock_draft.model, target_inner)
    assert stock_draft.model.embed_tokens is own  # vLLM 0.30 keeps the drafter's own copy

    draft = FakeDraft()
    share(draft, draft.model, target_inner)
    assert draft.model.embed_tokens is target_inner.embed_tokens
    params = {id(p) for p in draft.parameters()} | {id(p) for p in target_inner.parameters()}
    assert len(params) == 1  # one embedding weight left for target and drafter


def test_drafter_keeps_its_embedding_when_the_stage_has_none(applied, active, pp_group):
    from vllm.model_executor.models.utils import PPMissingLayer
    from vllm.v1.worker.gpu.spec_decode.eagle import utils as eagle_utils

    applied("drafter-shares-target-embed")
    target_inner = nn.Module()
    target_inner.embed_tokens = PPMissingLayer()
    draft = FakeDraft()
    own = draft.model.embed_tokens
    eagle_utils.maybe_share_target_embed(draft, draft.model, target_inner)  # no RuntimeError
    assert draft.model.embed_tokens is own


def test_drafter_embedding_stock_without_dualgpu_or_with_own_flag(applied, pp_group, monkeypatch):
    from vllm.v1.worker.gpu.spec_decode.eagle import utils as eagle_utils

    applied("drafter-shares-target-embed")
    target_inner = nn.Module()
    target_inner.embed_tokens = nn.Embedding(32, 8)
    monkeypatch.delenv(ACTIVE_ENV, raising=False)
    draft = FakeDraft()
    own = draft.model.embed_tokens
    eagle_utils.maybe_share_target_embed(draft, draft.model, target_inner)
    assert draft.model.embed_tokens is own
    # A drafter that trained its own embedding keeps it under dualgpu too (vLLM's rule).
    monkeypatch.setenv(ACTIVE_ENV, "1")
    trained = FakeDraft()
    trained.has_own_embed_tokens = True
    own = trained.model.embed_tokens
    eagle_utils.maybe_share_target_embed(trained, trained.model, target_inner)
    assert trained.model.embed_tokens is own


def test_drafter_with_own_table_beside_a_quantized_target(applied, active, pp_group, monkeypatch):
    """A packed target embedding has no .weight: vLLM's comparison raises, the patch keeps the
    drafter's own table (qwen3-next-embed-quant-config makes Qwen3.5 embeddings packed)."""
    from vllm.v1.worker.gpu.spec_decode.eagle import utils as eagle_utils

    applied("drafter-shares-target-embed")
    target_inner = nn.Module()
    target_inner.embed_tokens = nn.Module()
    target_inner.embed_tokens.weight_packed = nn.Parameter(torch.zeros(32, 2, dtype=torch.int32),
                                                           requires_grad=False)
    drafter = FakeDraft()
    drafter.has_own_embed_tokens = True
    own = drafter.model.embed_tokens
    with pytest.raises(AttributeError, match="weight"):
        eagle_utils.maybe_share_target_embed.__wrapped__(drafter, drafter.model, target_inner)
    eagle_utils.maybe_share_target_embed(drafter, drafter.model, target_inner)
    assert drafter.model.embed_tokens is own
    monkeypatch.delenv(ACTIVE_ENV, raising=False)  # other executors: vLLM's behaviour
    with pytest.raises(AttributeError, match="weight"):
        eagle_utils.maybe_share_target_embed(drafter, drafter.model, target_inner)


# --- item 7: hybrid KV cache groups without padding under PP ----------------------------------


def hybrid_rank_specs(drafter_layers: int, drafter_same_spec: bool):
    """Per-rank KV specs shaped like the reference 27B (64 layers, every 4th full attention,
    GDN elsewhere, split 32/32) plus drafter layers on the last rank. Pages are equal, as
    vLLM's platform makes them for hybrid models (Mamba page padded to the attention page)."""
    import dataclasses

    from vllm.v1.kv_cache_interface import FullAttentionSpec

    bs = 64
    attn = FullAttentionSpec(block_size=bs, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    gdn = dataclasses.replace(mamba_spec(bs), page_size_padded=attn.page_size_bytes)
    # A drafter spec that differs from the target's but has the same page (e.g. DFlash).
    draft = attn if drafter_same_spec else FullAttentionSpec(
        block_size=bs, num_kv_heads=4, head_size=32, dtype=torch.bfloat16
    )
    assert draft.page_size_bytes == attn.page_size_bytes == gdn.page_size_bytes
    ranks: list[dict] = [{}, {}]
    for i in range(64):
        kind = attn if (i + 1) % 4 == 0 else gdn
        ranks[i // 32][f"model.layers.{i}.{'attn' if kind is attn else 'gdn'}"] = kind
    for j in range(drafter_layers):
        ranks[1][f"draft.layers.{j}.attn"] = draft
    return ranks, attn.page_size_bytes


def kv_plan(cfg, ranks, memory):
    from vllm_dualgpu.patches import kv_cache_utils as kvp

    configs = kvp.kv_cache_configs(cfg, [dict(r) for r in ranks], [memory, memory])
    # The global groups: each rank's config holds the same groups projected onto its layers.
    groups = [
        (sorted(a.layer_names + b.layer_names), a.kv_cache_spec)
        for a, b in zip(configs[0].kv_cache_groups, configs[1].kv_cache_groups)
    ]
    per_rank_bytes = [kvp.pool_bytes_per_block(cfg, c.kv_cache_groups) for c in configs]
    need = max(kvp.max_memory_usage_bytes(cfg, c.kv_cache_groups) for c in configs)
    return groups, per_rank_bytes, configs[0].num_blocks, need


@pytest.fixture
def kv_layout(pp_configs):
    for cfg in pp_configs.values():
        cfg.cache_config.kv_cache_layout = "LBNHC"  # resolved by EngineCore from the backends
    return pp_configs


def test_kv_groups_without_padding_for_a_drafter_bucket(applied, kv_layout, vllm_version):
    from vllm.v1.kv_cache_interface import MambaSpec

    applied("kv-groups-know-ranks")
    patch = applied("kv-groups-without-padding")
    cfg = kv_layout["dualgpu"]
    ranks, page = hybrid_rank_specs(drafter_layers=5, drafter_same_spec=False)
    memory = 4 * 2**30

    patched, patched_bpb, patched_blocks, patched_need = kv_plan(cfg, ranks, memory)
    assert revert_patch(patch)
    try:
        stock, stock_bpb, stock_blocks, stock_need = kv_plan(cfg, ranks, memory)
    finally:
        assert apply_patch(patch, vllm_version).status == APPLIED

    def attention_sizes(groups):
        return sorted(len(names) for names, spec in groups if not isinstance(spec, MambaSpec))

    # vLLM 0.30: group size 5 (the drafter bucket): 16 attention layers in 4 groups of 4, each
    # block sized for 5 layers; the drafter's rank pays 5 pages per block.
    assert attention_sizes(stock) == [4, 4, 4, 4, 5]
    assert stock_bpb[1] == 5 * page
    # Patched: every layer in exactly one group, no more groups than vLLM, less memory for a
    # max_model_len request on the tightest rank, more blocks for the same memory.
    names = [n for group, _ in patched for n in group]
    assert sorted(names) == sorted(n for r in ranks for n in r)
    assert len(patched) <= len(stock)
    assert patched_need < stock_need
    assert patched_blocks > stock_blocks
    assert max(patched_bpb) < max(stock_bpb)


def test_kv_groups_unchanged_when_vllm_has_no_padding(applied, kv_layout):
    """Qwen3.5 + MTP: the MTP layer shares the target's attention spec; vLLM's grouping is
    already exact (one attention group of 17, GDN groups of 16), so the patch keeps it."""
    from vllm_dualgpu.patches.kv_cache_utils import planning_module

    ku = planning_module()
    applied("kv-groups-know-ranks")
    applied("kv-groups-without-padding")
    ranks, page = hybrid_rank_specs(drafter_layers=1, drafter_same_spec=True)
    patched, bpb, _, _ = kv_plan(kv_layout["dualgpu"], ranks, 2**30)
    stock = ku._get_kv_cache_groups_uniform_page_size.__wrapped__(
        {n: s for r in ranks for n, s in r.items()}
    )
    assert [names for names, _ in patched] == [sorted(g.layer_names) for g in stock]
    assert sorted(len(names) for names, _ in patched) == [16, 16, 16, 17]
    assert bpb == [8 * page, 9 * page]  # exactly the attention layers each rank holds


def test_kv_groups_stock_for_other_executors(applied, kv_layout):
    from vllm_dualgpu.patches.kv_cache_utils import planning_module

    ku = planning_module()
    applied("kv-groups-know-ranks")
    applied("kv-groups-without-padding")
    ranks, _ = hybrid_rank_specs(drafter_layers=5, drafter_same_spec=False)
    groups, _, _, _ = kv_plan(kv_layout["mp"], ranks, 2**30)
    stock = ku._get_kv_cache_groups_uniform_page_size.__wrapped__(
        {n: s for r in ranks for n, s in r.items()}
    )
    assert [names for names, _ in groups] == [sorted(g.layer_names) for g in stock]


# --- item 3: the vision tower only on the first PP rank ----------------------------------------


def toy_vl_class():
    """A multimodal model built the way vLLM's Qwen3-VL/Qwen3.5 build theirs."""
    from vllm.model_executor.models.interfaces import SupportsMultiModal

    class ToyVL(nn.Module, SupportsMultiModal):
        def __init__(self, vllm_config):
            super().__init__()
            with self._mark_tower_model(vllm_config, {"image", "video"}):
                self.visual = nn.Linear(64, 64)
            self.lm = nn.Linear(8, 8)

    return ToyVL


def vl_config(pp_config, limit: int | None = None):
    from vllm.config.multimodal import MultiModalConfig

    mm = MultiModalConfig(limit_per_prompt={} if limit is None else {"image": limit, "video": limit})
    model_config = types.SimpleNamespace(get_multimodal_config=lambda: mm)
    return types.SimpleNamespace(
        model_config=model_config,
        parallel_config=pp_config.parallel_config,
        use_v2_model_runner=True,
    )


@pytest.mark.parametrize("first_rank", [False, True])
def test_vision_tower_only_on_the_first_rank(applied, pp_configs, monkeypatch, first_rank):
    import vllm
    from vllm.distributed import parallel_state
    from vllm.model_executor.models.interfaces import SupportsMultiModal
    from vllm.model_executor.models.utils import StageMissingLayer

    name = "vision-tower-first-rank-only"
    patch = applied(name) if for_version(name, vllm.__version__) else None  # fixed in 0.33
    group = types.SimpleNamespace(world_size=2, is_first_rank=first_rank, is_last_rank=not first_rank)
    monkeypatch.setattr(parallel_state, "_PP", group)
    ToyVL = toy_vl_class()
    cfg = vl_config(pp_configs["dualgpu"])

    model = ToyVL(cfg)
    vision_params = sum(p.numel() for n, p in model.named_parameters() if n.startswith("visual"))
    if first_rank:
        assert isinstance(model.visual, nn.Linear) and vision_params == 64 * 64 + 64
    else:
        assert isinstance(model.visual, StageMissingLayer) and vision_params == 0
        assert model.visual.stage_name == "vision_tower"
    assert model._tower_model_names == ["visual"]
    if patch is None:
        return  # vLLM itself built the tower on the first rank only (upstream fix)

    # vLLM 0.30 builds the tower on every rank.
    assert revert_patch(patch)
    try:
        stock = ToyVL(cfg)
        assert isinstance(stock.visual, nn.Linear)
        assert isinstance(vars(SupportsMultiModal)["_mark_tower_model"], types.FunctionType)
    finally:
        import vllm

        assert apply_patch(patch, vllm.__version__).status == APPLIED


def test_vision_tower_stock_for_other_executors_and_disabled_modalities(applied, pp_configs, monkeypatch):
    from vllm.distributed import parallel_state
    from vllm.model_executor.models.utils import StageMissingLayer

    applied("vision-tower-first-rank-only")  # vLLM 0.33 does it itself: skipped there
    group = types.SimpleNamespace(world_size=2, is_first_rank=False, is_last_rank=True)
    monkeypatch.setattr(parallel_state, "_PP", group)
    ToyVL = toy_vl_class()
    assert isinstance(ToyVL(vl_config(pp_configs["mp"])).visual, nn.Linear)
    v1 = vl_config(pp_configs["dualgpu"])
    v1.use_v2_model_runner = False  # the V1 runner may run the encoder on any rank
    assert isinstance(ToyVL(v1).visual, nn.Linear)
    # vLLM's own rule still applies: no images or videos, no tower, on every rank.
    monkeypatch.setattr(group, "is_first_rank", True)
    assert isinstance(ToyVL(vl_config(pp_configs["dualgpu"], limit=0)).visual, StageMissingLayer)
