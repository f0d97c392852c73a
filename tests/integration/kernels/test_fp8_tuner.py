"""The tuner's CPU side: weight shapes of a model, candidates, the plan, vLLM's kernel contract,
the file format."""

from __future__ import annotations

import ast
import inspect
import json
from pathlib import Path

import pytest
import torch

from conftest import SEED_SHAPES, qwen35_27b
from vllm_dualgpu.kernels import fp8_configs as fc
from vllm_dualgpu.kernels import fp8_tuner as ft

ROOT = Path(__file__).resolve().parents[3]
def shapes_of(cfg, tp=1):
    return [s.key for s in ft.model_weight_shapes(cfg, tp).shapes]


# ---- shapes ---------------------------------------------------------------------------------


def test_qwen35_27b_yields_the_seed_shapes():
    ignore = [f"model.language_model.layers.{i}.linear_attn.in_proj_{x}" for i in range(64) for x in "ab"]
    r = ft.model_weight_shapes(qwen35_27b(ignore + ["lm_head", "model.visual.blocks.0.mlp.down_proj"]))
    assert [s.key for s in r.shapes] == SEED_SHAPES
    assert r.block == (128, 128)
    by_shape = {s.key: s.layers for s in r.shapes}
    assert by_shape[(5120, 6144)] == ["self_attn.o_proj", "linear_attn.out_proj"]
    assert by_shape[(14336, 5120)] == ["self_attn.qkv_proj"]
    assert any("in_proj_ba" in x and "ignored" in x for x in r.skipped)
    # The shipped files are exactly these shapes.
    shipped = {(k.N, k.K) for k, _ in fc.list_config_files(ROOT / "kernel_configs")}
    assert shipped == set(SEED_SHAPES)


def test_in_proj_ba_cannot_be_block_fp8_even_if_not_ignored():
    r = ft.model_weight_shapes(qwen35_27b())
    assert [s.key for s in r.shapes] == SEED_SHAPES
    assert any("in_proj_ba" in x and "do not fit block" in x for x in r.skipped)


def test_tensor_parallel_splits_match_vllms_tp4_shapes():
    # vLLM PR #52752 lists these five for Qwen3.8-27B-FP8 at TP=4.
    assert sorted(shapes_of(qwen35_27b(), tp=4)) == sorted(
        [(3584, 5120), (4096, 5120), (8704, 5120), (5120, 1536), (5120, 4352)])
    with pytest.raises(ValueError, match="--tp 5"):
        ft.model_weight_shapes(qwen35_27b(), tp=5)


def test_output_gate_and_layer_types_matter():
    no_gate = shapes_of(qwen35_27b(attn_output_gate=False))
    assert (24 * 256 + 2 * 4 * 256, 5120) in no_gate and (14336, 5120) not in no_gate
    all_full = qwen35_27b()
    all_full["text_config"]["layer_types"] = ["full_attention"] * 64
    assert (16384, 5120) not in shapes_of(all_full)  # no Gated-DeltaNet layer, no qkvz
    no_types = qwen35_27b()
    del no_types["text_config"]["layer_types"]  # derived from full_attention_interval
    assert shapes_of(no_types) == SEED_SHAPES


def test_ignored_projections_drop_out_only_when_ignored_everywhere():
    mlp_all = [f"model.language_model.layers.{i}.mlp.{p}" for i in range(64) for p in ("gate_proj", "up_proj")]
    assert (34816, 5120) not in shapes_of(qwen35_27b(mlp_all))
    assert (34816, 5120) in shapes_of(qwen35_27b(mlp_all[:-2]))  # layer 63 still quantized
    assert (5120, 17408) not in shapes_of(qwen35_27b(["down_proj"]))  # a layer-less pattern
    assert (5120, 17408) not in shapes_of(qwen35_27b(["re:.*mlp\\.down_proj$"]))
    assert (5120, 17408) in shapes_of(qwen35_27b(["model.visual.blocks.3.mlp.down_proj"]))


def test_qwen3_dense_and_moe():
    qwen3_32b = {"model_type": "qwen3", "hidden_size": 5120, "intermediate_size": 25600, "num_hidden_layers": 64,
                 "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 128,
                 "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}
    assert shapes_of(qwen3_32b) == [(10240, 5120), (5120, 8192), (51200, 5120), (5120, 25600)]
    moe = {**qwen3_32b, "num_experts": 128, "moe_intermediate_size": 768}
    r = ft.model_weight_shapes(moe)
    assert [s.key for s in r.shapes] == [(10240, 5120), (5120, 8192)]
    assert any("fused-MoE" in n for n in r.notes)
    moe_shared = {**moe, "shared_expert_intermediate_size": 512}
    assert (1024, 5120) in shapes_of(moe_shared) and (5120, 512) in shapes_of(moe_shared)


def test_not_block_fp8_is_refused_with_a_hint():
    cfg = qwen35_27b()
    del cfg["quantization_config"]["weight_block_size"]
    with pytest.raises(ValueError, match="--shapes"):
        ft.model_weight_shapes(cfg)
    assert ft.model_weight_shapes(cfg, block=(128, 128)).block == (128, 128)


def test_read_model_config(tmp_path):
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"a": 1}))
    assert ft.read_model_config(str(d)) == {"a": 1}
    assert ft.read_model_config(str(d / "config.json")) == {"a": 1}
    with pytest.raises(FileNotFoundError):
        ft.read_model_config(str(tmp_path / "missing"))


@pytest.mark.parametrize("text,expected", [("14336,5120;5120,6144", [(14336, 5120), (5120, 6144)]),
                                           (" 14336x5120 ; 14336,5120;", [(14336, 5120)])])
def test_parse_shapes(text, expected):
    assert ft.parse_shapes(text) == expected


@pytest.mark.parametrize("text", ["", ";", "14336", "a,b", "1,2,3", "0,5", "-1,4"])
def test_parse_shapes_rejects(text):
    with pytest.raises(ValueError):
        ft.parse_shapes(text)


# ---- candidates and plan -----------------------------------------------------------------------


@pytest.mark.parametrize("M", ft.DEFAULT_BATCH_SIZES)
def test_candidates_are_valid_and_include_vllms_default(M):
    cands = ft.candidate_configs(M, 128, 128)
    assert 15 <= len(cands) <= 40
    assert ft.vllm_default_config(128, 128) in cands
    keys = [tuple(c[k] for k in fc.CONFIG_KEYS) for c in cands]
    assert len(keys) == len(set(keys))
    fc.validate_configs({str(i): c for i, c in enumerate(cands)}, 128)
    for c in cands:
        assert ft.smem_bytes(c) <= ft.H200_SMEM
        if c != ft.vllm_default_config(128, 128):
            assert c["BLOCK_SIZE_M"] <= max(16, 2 * M)  # no tile far larger than the batch


def test_small_cards_get_fewer_candidates():
    for M in (32, 512, 4096):
        small = ft.candidate_configs(M, 128, 128, smem_limit=101376)
        assert small and all(ft.smem_bytes(c) <= 101376 for c in small)
        assert len(small) < len(ft.candidate_configs(M, 128, 128))
    assert all(c["BLOCK_SIZE_K"] == 64 for c in ft.candidate_configs(8, 64, 64))


def test_default_config_is_vllms_literal():
    """The default dict inside w8a8_triton_block_scaled_mm, read from vLLM's source."""
    from vllm.model_executor.layers.quantization.utils import fp8_utils

    tree = ast.parse(inspect.getsource(fp8_utils.w8a8_triton_block_scaled_mm))
    dicts = [n for n in ast.walk(tree) if isinstance(n, ast.Dict)
             and any(isinstance(k, ast.Constant) and k.value == "BLOCK_SIZE_M" for k in n.keys)]
    assert len(dicts) == 1
    env = {"block_size": [96, 160]}
    literal = {k.value: eval(compile(ast.Expression(v), "<vllm>", "eval"), env)  # noqa: S307
               for k, v in zip(dicts[0].keys, dicts[0].values)}
    assert literal == ft.vllm_default_config(96, 160)


def test_kernel_parameters_are_vllms():
    from vllm.model_executor.layers.quantization.utils import fp8_utils

    kernel = getattr(fp8_utils, ft.KERNEL_NAMES[0])
    assert tuple(inspect.signature(getattr(kernel, "fn", kernel)).parameters) == ft.KERNEL_PARAMS


def test_launch_ints_are_the_strides_vllm_passes():
    M, N, K = 24, 384, 640
    A = torch.empty(M, K)
    B = torch.empty(N, K)
    C = torch.empty(M, N)
    As = torch.empty(M, -(-K // 128))
    Bs = torch.empty(-(-N // 128), -(-K // 128))
    expected = (M, N, K, 128, 128, A.stride(-2), A.stride(-1), B.stride(1), B.stride(0), C.stride(-2),
                C.stride(-1), As.stride(-2), As.stride(-1), Bs.stride(1), Bs.stride(0))
    assert ft.launch_ints(M, N, K, 128, 128) == expected


def test_launch_passes_vllms_argument_order():
    calls = []

    class FakeKernel:
        def __getitem__(self, grid):
            return lambda *a, **k: calls.append((grid, a, k))

    M, N, K = 5, 300, 640
    A, B = torch.empty(M, K), torch.empty(N, K)
    As, Bs = torch.empty(M, 5), torch.empty(3, 5)
    C = torch.empty(M, N)
    c = ft.cfg(16, 64, 128, 1, 4, 3)
    ft.launch(FakeKernel(), A, B, As, Bs, C, 128, 128, c)
    grid, args, kwargs = calls[0]
    assert grid == (1 * 5,)  # cdiv(5,16) * cdiv(300,64)
    assert args[:5] == (A, B, C, As, Bs) and args[5:] == ft.launch_ints(M, N, K, 128, 128)
    assert kwargs == c


def test_plan_counts_compiles_by_specialization():
    plan = ft.make_plan(SEED_SHAPES, (128, 128))
    assert plan.benchmarks == 5 * sum(len(ft.candidate_configs(M, 128, 128)) for M in ft.DEFAULT_BATCH_SIZES)
    # M=16..4096 share one specialization per config; M=1 and M=8 add their own; K=6144 differs
    # from K=5120/17408 in the scale strides (48 vs 40/136), the N values do not matter.
    c = ft.cfg(16, 64, 128, 1, 4, 3)
    assert ft.spec_key(16, 5120, 5120, 128, 128, c) == ft.spec_key(4096, 34816, 17408, 128, 128, c)
    assert ft.spec_key(16, 5120, 5120, 128, 128, c) != ft.spec_key(1, 5120, 5120, 128, 128, c)
    assert ft.spec_key(8, 5120, 5120, 128, 128, c) != ft.spec_key(16, 5120, 5120, 128, 128, c)
    assert ft.spec_key(16, 5120, 6144, 128, 128, c) != ft.spec_key(16, 5120, 5120, 128, 128, c)
    assert 150 <= plan.variants <= 300  # what the parallel compile step has to build
    one = ft.make_plan(SEED_SHAPES[:1], (128, 128))
    assert one.variants < plan.variants


# ---- files ------------------------------------------------------------------------------------


def test_written_file_is_byte_identical_to_vllms_format():
    """A shipped seed file (written by vLLM's tuner) survives load + write unchanged."""
    seed = ROOT / "kernel_configs" / fc.config_file_name(5120, 6144, "NVIDIA_GeForce_RTX_4070_Ti_SUPER")
    configs = fc.load_config_file(seed, 128)
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        out = ft.write_config_file(d, 5120, 6144, "NVIDIA_GeForce_RTX_4070_Ti_SUPER", (128, 128), configs)
        assert out.name == seed.name
        assert out.read_bytes() == seed.read_bytes()


def test_write_refuses_configs_the_kernel_cannot_run(tmp_path):
    bad = {1: ft.cfg(16, 64, 256, 1, 4, 3)}
    with pytest.raises(fc.ConfigFileError):
        ft.write_config_file(tmp_path, 1, 2, "X", (128, 128), bad)
    assert not list(tmp_path.iterdir())


def test_bundle_round_trip(tmp_path):
    files = sorted((ROOT / "kernel_configs").glob("N=*.json"))
    bundle = json.loads(json.dumps(ft.bundle_config_files(files)))
    written = ft.unpack_config_bundle(bundle, tmp_path / "out")
    assert sorted(p.name for p in written) == [f.name for f in files]
    for f in files:
        assert (tmp_path / "out" / f.name).read_bytes() == f.read_bytes()
    with pytest.raises(ValueError):
        ft.unpack_config_bundle({"../evil.json": {}}, tmp_path / "x")


def test_bench_table_rows():
    rows = [{"N": 1, "K": 2, "M": 8, "default_us": 10.0, "tuned_us": 5.0, "speedup": 2.0,
             "tuned_config": ft.cfg(16, 64, 128, 1, 4, 3)}, {"N": 1, "K": 2, "M": 64, "skipped": "time cap"}]
    table = ft.bench_table(rows)
    assert "| 1 | 2 | 8 | 10.0 | 5.0 | 2.00x | 16,64,128,1,4,3 |" in table
    assert "| 1 | 2 | 64 | - | - | - | time cap |" in table
