"""The planner's KV arithmetic against vLLM's own, on real spec objects.

Each test builds the per-rank ``KVCacheSpec`` dicts vLLM's workers would report (real
``FullAttentionSpec`` / ``MambaSpec`` objects, Gated DeltaNet state shapes and dtypes from
vLLM's model class, hybrid block size from vLLM's ``Platform._align_hybrid_block_size``), calls
vLLM's ``get_kv_cache_configs`` with per-rank available memory, and compares block counts,
bytes per block (vLLM's ``_pool_bytes_per_block`` on its projected groups), the number of KV
cache groups, and the largest ``max_model_len`` vLLM accepts, with the planner's.
"""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

from vllm.engine.arg_utils import EngineArgs  # noqa: E402
from vllm.model_executor.models import ModelRegistry  # noqa: E402
from vllm.platforms.interface import Platform  # noqa: E402
from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend  # noqa: E402
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum  # noqa: E402
from vllm_dualgpu.patches.kv_cache_utils import kv_cache_configs, pool_bytes_per_block  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVQuantMode, MambaSpec  # noqa: E402

from vllm_dualgpu.planner import (  # noqa: E402
    DrafterSpec,
    GpuFacts,
    KVLayout,
    MemoryModel,
    ModelSpec,
    PlanRequest,
    plan,
    reference_config,
)

GIB = 1 << 30

# A Qwen3-Next-style hybrid with the 27B reference's Gated DeltaNet and attention shapes
# (16 K heads, 48 V heads, 128 dims; 4 KV heads x 256), shrunk to 16 layers.
HYBRID = {
    "architectures": ["Qwen3NextForCausalLM"],
    "model_type": "qwen3_next",
    "hidden_size": 1024,
    "intermediate_size": 2048,
    "num_hidden_layers": 16,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 48,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4,
    "layer_types": ["linear_attention"] * 3 + ["full_attention"],
    "full_attention_interval": 4,
    "vocab_size": 4096,
    "max_position_embeddings": 262144,
    "rms_norm_eps": 1e-6,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 256,
    "shared_expert_intermediate_size": 256,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "rope_theta": 10000000,
    "partial_rotary_factor": 0.25,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "mtp_num_hidden_layers": 1,
}
HYBRID["layer_types"] = HYBRID["layer_types"] * 4


def _engine_config(tmp_path_factory, name: str, cfg: dict, **kw):
    d = tmp_path_factory.mktemp(name)
    (d / "config.json").write_text(json.dumps(cfg))
    vc = EngineArgs(model=str(d), load_format="dummy", skip_tokenizer_init=True, **kw).create_engine_config()
    # The layout the engine core resolves on CUDA for FlashAttention/FlashInfer (no backend
    # declares one, so the default preference LBNHC wins).
    vc.cache_config.kv_cache_layout = "LBNHC"
    return vc


@pytest.fixture(scope="module")
def dense_vc(tmp_path_factory):
    cfg = {k: v for k, v in reference_config("qwen3-14b").items() if not k.startswith("_") and k != "quantization_config"}
    return _engine_config(tmp_path_factory, "dense", cfg, max_model_len=40960)


def _hybrid(tmp_path_factory, name, speculative=None):
    vc = _engine_config(tmp_path_factory, name, HYBRID, max_model_len=262144, kv_cache_dtype="fp8",
                        speculative_config=speculative)
    cc = vc.cache_config
    # As on CUDA: FlashAttention's preferred block size, bf16 conv state, fp32 SSM state (the
    # CPU platform would force its own values), then vLLM's hybrid alignment.
    cc.block_size = 16
    cc.user_specified_block_size = False
    cc.mamba_page_size_padded = None
    cc.mamba_cache_dtype = "auto"
    cc.mamba_ssm_cache_dtype = "float32"
    Platform._align_hybrid_block_size(vc, FlashAttentionBackend)
    return vc


@pytest.fixture(scope="module")
def hybrid_vc(tmp_path_factory):
    return _hybrid(tmp_path_factory, "hybrid")


@pytest.fixture(scope="module")
def hybrid_mtp_vc(tmp_path_factory):
    return _hybrid(tmp_path_factory, "hybrid_mtp", {"method": "mtp", "num_speculative_tokens": 2})


# ---- vLLM side: real specs ---------------------------------------------------------------------


def _attn(block_size, heads, head, fp8):
    if fp8:
        return FullAttentionSpec(
            block_size=block_size, num_kv_heads=heads, head_size=head, dtype=torch.uint8,
            kv_quant_mode=KVQuantMode.FP8_PER_TENSOR,
        )
    return FullAttentionSpec(block_size=block_size, num_kv_heads=heads, head_size=head, dtype=torch.bfloat16)


def dense_specs(partition, fp8=False, drafter=None):
    specs, start = [], 0
    for n in partition:
        specs.append({f"model.layers.{i}.self_attn.attn": _attn(16, 8, 128, fp8) for i in range(start, start + n)})
        start += n
    if drafter:
        specs[-1].update(drafter)
    return specs


def hybrid_specs(vc, partition, drafter=None):
    cc = vc.cache_config
    model_cls, _ = ModelRegistry.resolve_model_cls(vc.model_config.architecture, model_config=vc.model_config)
    mamba = MambaSpec(
        shapes=tuple(model_cls.get_mamba_state_shape_from_config(vc)),
        dtypes=tuple(model_cls.get_mamba_state_dtype_from_config(vc)),
        block_size=cc.mamba_block_size,
        page_size_padded=cc.mamba_page_size_padded,
        mamba_type=MambaAttentionBackendEnum.GDN_ATTN,
        mamba_cache_mode=cc.mamba_cache_mode,
        num_speculative_blocks=vc.num_speculative_tokens,
    )
    attn = _attn(cc.block_size, 4, 256, fp8=True)
    specs, start = [], 0
    for n in partition:
        d = {}
        for i in range(start, start + n):
            if HYBRID["layer_types"][i] == "full_attention":
                d[f"model.layers.{i}.self_attn.attn"] = attn
            else:
                d[f"model.layers.{i}.linear_attn"] = mamba
        specs.append(d)
        start += n
    if drafter:
        specs[-1].update(drafter)
    return specs


def vllm_result(vc, specs, available, max_model_len=1):
    vc.model_config.max_model_len = max_model_len
    # vLLM's own planning, called as this release's EngineCore calls it (0.33 groups first).
    cfgs = kv_cache_configs(vc, [dict(s) for s in specs], list(available))
    return cfgs[0].num_blocks, [pool_bytes_per_block(vc, c.kv_cache_groups) for c in cfgs], len(cfgs[0].kv_cache_groups)


def vllm_accepts(vc, specs, available, max_model_len) -> bool:
    try:
        vllm_result(vc, specs, available, max_model_len)
        return True
    except ValueError:
        return False


# ---- planner side ------------------------------------------------------------------------------


def planner_result(layout: KVLayout, partition, available):
    bpbs, start = [], 0
    for r, n in enumerate(partition):
        bpbs.append(layout.bytes_per_block(start, start + n, r == len(partition) - 1))
        start += n
    blocks = min(a // b for a, b in zip(available, bpbs))
    return blocks, bpbs, len(layout.groups)


def check(vc, specs, layout, partition, available):
    got = vllm_result(vc, specs, available)
    want = planner_result(layout, partition, available)
    assert want == got
    # The largest max_model_len vLLM accepts is the planner's, and one more token is refused.
    L = layout.max_len_for_blocks(want[0])
    assert L > 0
    assert vllm_accepts(vc, specs, available, L)
    assert not vllm_accepts(vc, specs, available, L + 1)
    return want


# ---- dense -------------------------------------------------------------------------------------

DENSE_SPLITS = [[20, 20], [12, 28], [1, 39], [33, 7], [10, 13, 17]]
# Per-rank KV memory; not multiples of a block, so the floor division matters.
AVAIL = [3 * GIB + 12_345, 9 * GIB + 777, 5 * GIB + 1]


@pytest.mark.parametrize("partition", DENSE_SPLITS, ids=lambda p: "/".join(map(str, p)))
@pytest.mark.parametrize("kv", ["auto", "fp8"])
def test_dense_matches_vllm(dense_vc, partition, kv):
    model = ModelSpec.from_hf_config(reference_config("qwen3-14b"))
    layout = KVLayout.build(model, kv_cache_dtype=kv)
    available = AVAIL[: len(partition)]
    blocks, bpbs, groups = check(dense_vc, dense_specs(partition, fp8=kv == "fp8"), layout, partition, available)
    # By hand: one page = 16 tokens x 8 heads x (128 + 128) x 2 bytes (bf16) or 1 byte (fp8).
    page = 16 * 8 * 256 * (1 if kv == "fp8" else 2)
    assert bpbs == [n * page for n in partition]
    assert groups == 1


@pytest.mark.parametrize("partition", [[12, 28], [30, 10]], ids=lambda p: "/".join(map(str, p)))
def test_dense_with_a_different_drafter_matches_vllm(dense_vc, partition):
    """A drafter layer with its own head shape: vLLM's UniformTypeKVCacheSpecs path."""
    model = ModelSpec.from_hf_config(reference_config("qwen3-14b"))
    drafter = DrafterSpec("eagle", 3, kv_layers=2, kv_heads=4, head_dim=64, kv_cache_dtype="bfloat16")
    layout = KVLayout.build(model, kv_cache_dtype="fp8", drafter=drafter)
    assert layout.grouping == "uniform-type"
    vspecs = {f"drafter.layers.{j}.self_attn.attn": _attn(16, 4, 64, fp8=False) for j in range(2)}
    _, bpbs, _ = check(dense_vc, dense_specs(partition, True, vspecs), layout, partition, AVAIL[:2])
    # By hand: the last rank pays its fp8 pages (16 x 8 x 256 x 1) plus two drafter pages (16 x 4 x 128 x 2).
    assert bpbs[1] == partition[1] * 32768 + 2 * 16384


# ---- hybrid (Gated DeltaNet + full attention) ------------------------------------------------------

HYBRID_SPLITS = [[4, 12], [5, 11], [7, 9], [13, 3], [3, 6, 7], [1, 1, 14]]


def test_hybrid_block_size_matches_vllm(hybrid_vc, hybrid_mtp_vc):
    model = ModelSpec.from_hf_config(HYBRID)
    for vc, k in ((hybrid_vc, 0), (hybrid_mtp_vc, 2)):
        layout = KVLayout.build(model, kv_cache_dtype="fp8", num_speculative_tokens=k, mamba_ssm_cache_dtype="float32")
        assert layout.block_size == vc.cache_config.block_size
        assert layout.mamba_page_padded == vc.cache_config.mamba_page_size_padded
    # By hand, no drafter: state = conv 10240 x 3 x 2 B + SSM 48 x 128 x 128 x 4 B = 3,207,168 B;
    # 2,048 B per token per attention layer (fp8), so 16 x cdiv(3,207,168, 16 x 2,048) = 1,568 tokens.
    assert hybrid_vc.cache_config.block_size == 1568
    # With 2 speculative tokens the conv state has 5 columns: 3,248,128 B -> 16 x 100 = 1,600 tokens.
    assert hybrid_mtp_vc.cache_config.block_size == 1600


@pytest.mark.parametrize("partition", HYBRID_SPLITS, ids=lambda p: "/".join(map(str, p)))
def test_hybrid_matches_vllm(hybrid_vc, partition):
    model = ModelSpec.from_hf_config(HYBRID)
    layout = KVLayout.build(model, kv_cache_dtype="fp8", mamba_ssm_cache_dtype="float32")
    available = [2 * GIB + 99, 3 * GIB + 5, 1 * GIB + 7][: len(partition)]
    check(hybrid_vc, hybrid_specs(hybrid_vc, partition), layout, partition, available)


@pytest.mark.parametrize("partition", [[4, 12], [5, 11], [14, 2]], ids=lambda p: "/".join(map(str, p)))
def test_hybrid_with_mtp_drafter_matches_vllm(hybrid_mtp_vc, partition):
    """The MTP layer joins the attention layers on the last rank (17 attention layers -> groups of 4)."""
    model = ModelSpec.from_hf_config(HYBRID)
    drafter = DrafterSpec.from_speculative({"method": "mtp", "num_speculative_tokens": 2}, model)
    layout = KVLayout.build(model, kv_cache_dtype="fp8", drafter=drafter, mamba_ssm_cache_dtype="float32")
    cc = hybrid_mtp_vc.cache_config
    mtp = {"mtp.layers.16.self_attn.attn": _attn(cc.block_size, 4, 256, fp8=True)}
    check(hybrid_mtp_vc, hybrid_specs(hybrid_mtp_vc, partition, mtp), layout, partition, [2 * GIB + 3, 3 * GIB + 1])


@pytest.mark.parametrize(
    "heads,head,dtype",
    [(8, 128, "bfloat16"), (3, 128, "bfloat16"), (2, 64, "fp8")],
    ids=["bigger-page-by-ratio", "smaller-page-padded", "smaller-page-by-ratio"],
)
def test_hybrid_with_foreign_drafter_matches_vllm(hybrid_vc, heads, head, dtype):
    """A drafter (DFlash/EAGLE-like) whose pages differ: vLLM's page-size unification."""
    model = ModelSpec.from_hf_config(HYBRID)
    drafter = DrafterSpec("dflash", 1, kv_layers=5, kv_heads=heads, head_dim=head, kv_cache_dtype=dtype)
    # hybrid_vc has no speculative config, so its state has no speculative columns: plan the same.
    layout = KVLayout.build(
        model, kv_cache_dtype="fp8", drafter=drafter, num_speculative_tokens=0, mamba_ssm_cache_dtype="float32"
    )
    bs = hybrid_vc.cache_config.block_size
    dspec = _attn(bs, heads, head, fp8=dtype == "fp8")
    vd = {f"drafter.layers.{j}.self_attn.attn": dspec for j in range(5)}
    for partition in ([4, 12], [6, 10]):
        check(hybrid_vc, hybrid_specs(hybrid_vc, partition, vd), layout, partition, [2 * GIB + 3, 3 * GIB + 1])


def test_full_plan_numbers_match_vllm(hybrid_vc):
    """End to end: feed vLLM each rank's KV budget from a plan; it lands on the plan's pool."""
    model = ModelSpec.from_hf_config(HYBRID)
    gpus = [GpuFacts(0, "small", 8 * GIB, 7 * GIB + 123, 600), GpuFacts(1, "big", 16 * GIB, 15 * GIB + 45, 1800)]
    req = PlanRequest(kv_cache_dtype="fp8", mamba_ssm_cache_dtype="float32", max_model_len=65536,
                      memory=MemoryModel(cuda_context_bytes=GIB // 2))
    p = plan(model, gpus, req)
    specs = hybrid_specs(hybrid_vc, p.partition)
    blocks, bpbs, _ = vllm_result(hybrid_vc, specs, [r.kv_budget_bytes for r in p.ranks])
    assert blocks == p.num_blocks
    assert bpbs == [r.kv_bytes_per_block for r in p.ranks]
    assert vllm_accepts(hybrid_vc, specs, [r.kv_budget_bytes for r in p.ranks], p.kv_max_context_tokens)
