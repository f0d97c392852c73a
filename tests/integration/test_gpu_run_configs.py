"""Every GPU run's real VllmConfig, built on the CPU (what the GPU scripts' ``--dry-run`` checked):
the e2e runs in bf16 and float32, MTP and EAGLE3 under PP=2 and stock vLLM's EAGLE3 refusal, the
vision model, and the checkpoints with an INT8-packed embedding. The runs' settings come from
tests/gpu (gpu_runs, gpu_tokens, gpu_models), so a GPU test cannot boot something these did not
build."""

from __future__ import annotations

import json

import pytest
import torch

import gpu_models as gm
import gpu_runs
import gpu_tokens as tok
from vllm_dualgpu.engine import preflight


def executor(cfg) -> str:
    backend = cfg.parallel_config.distributed_executor_backend
    return getattr(backend, "__name__", str(backend))


# --- e2e: stock on one GPU vs the plugin on two ------------------------------------------------------


def test_e2e_engine_settings_per_run(tmp_path, monkeypatch):
    monkeypatch.delenv("GDN_PREFILL_BACKEND", raising=False)
    ks = tok.engine_kwargs("dense", tmp_path, 1, "bfloat16")
    kp = tok.engine_kwargs("hybrid", tmp_path, 2, "bfloat16", mtp=True)
    assert "distributed_executor_backend" not in ks and "pipeline_parallel_size" not in ks
    assert kp["distributed_executor_backend"] == "dualgpu" and kp["pipeline_parallel_size"] == 2
    assert kp["speculative_config"] == tok.MTP and "speculative_config" not in ks
    for k in (ks, kp):
        assert k["enforce_eager"] and k["dtype"] == "bfloat16" and k["max_model_len"] == tok.MAX_MODEL_LEN
        assert k["skip_tokenizer_init"] and not k["disable_log_stats"]
    # Hybrid runs name their GDN prefill kernel (the same in every run); dense ones do not.
    assert kp["additional_config"] == gm.gdn_prefill_config() == {"gdn_prefill_backend": "triton"}
    assert "additional_config" not in ks
    # bf16: vLLM picks the attention backend; Triton's float32 default is untouched.
    assert "attention_backend" not in ks and "attention_backend" not in kp
    es, ep = tok.run_env("bfloat16", gpu="0"), tok.run_env("bfloat16")
    assert es["CUDA_VISIBLE_DEVICES"] == "0" and "CUDA_VISIBLE_DEVICES" not in ep
    assert es["CUBLAS_WORKSPACE_CONFIG"] == ep["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"
    assert "VLLM_BATCH_INVARIANT" not in es and "TRITON_F32_DEFAULT" not in ep
    assert tok.run_env("float32")["TRITON_F32_DEFAULT"] == "ieee"


def test_e2e_rejects_an_unknown_dtype(monkeypatch):
    monkeypatch.setenv("E2E_DTYPE", "float16")
    with pytest.raises(ValueError, match="E2E_DTYPE='float16': must be one of bfloat16, float32"):
        tok.e2e_dtype()


@pytest.mark.slow
@pytest.mark.parametrize("dtype", tok.DTYPES)
def test_e2e_engine_configs(engine_config, tmp_path, dtype):
    """Each run of test_gpu_e2e_correctness builds; float32 runs get float32 configs with Triton
    attention, the drafter in float32 too; the MTP model in float32 is the all-attention twin."""
    mtp_model = tok.mtp_model(dtype)
    assert mtp_model == ("attn" if dtype == "float32" else "hybrid")
    for model, mtp in (("dense", False), (mtp_model, True)):
        folder = gm.write_config_only(gm.PRESETS[tok.PRESETS[model]](), tmp_path / model)
        for pp in (1, 2):
            cfg = engine_config(**tok.engine_kwargs(model, folder, pp, dtype, mtp))
            name = f"{model} pp={pp} {dtype}"
            assert str(cfg.model_config.dtype) == f"torch.{dtype}", name
            assert cfg.parallel_config.pipeline_parallel_size == pp, name
            if pp == 2:
                assert executor(cfg) == "DualGpuExecutor", name
            assert cfg.cache_config.enable_prefix_caching, name
            backend = getattr(cfg.attention_config.backend, "name", None)
            assert backend == ("TRITON_ATTN" if dtype == "float32" else None), (name, backend)
            spec = cfg.speculative_config
            assert (spec is not None) == mtp, name
            if mtp:
                assert str(spec.draft_model_config.dtype) == f"torch.{dtype}", name


# --- speculative decoding under PP=2 -----------------------------------------------------------------


@pytest.fixture(scope="module")
def spec_dirs(tmp_path_factory):
    d = tmp_path_factory.mktemp("spec")
    return gm.write_config_only(gm.SPEC_HYBRID, d / "model"), gm.write_config_only(gm.EAGLE3_CONFIG, d / "drafter")


def test_spec_runs_keep_vllms_stat_loggers(tmp_path):
    """The speculative-decoding tests record vLLM's acceptance counters (LLM.get_metrics()), which
    raise "Stat logging disabled" unless the run keeps its stat loggers."""
    for kw in (gpu_runs.spec_kwargs(tmp_path), gpu_runs.spec_kwargs(tmp_path, "eagle3", tmp_path / "d")):
        assert kw.get("disable_log_stats", True) is False, kw["speculative_config"]


@pytest.mark.slow
def test_mtp_config(engine_config, spec_dirs):
    cfg = engine_config(**gpu_runs.spec_kwargs(spec_dirs[0]))
    spec = cfg.speculative_config
    assert cfg.model_config.architectures == ["Qwen3_5ForCausalLM"] and cfg.model_config.is_hybrid
    assert spec.draft_model_config.architectures == ["Qwen3_5MTP"] and spec.method == "mtp"
    assert spec.num_speculative_tokens == gpu_runs.NUM_SPEC
    assert executor(cfg) == "DualGpuExecutor" and cfg.parallel_config.pipeline_parallel_size == 2
    assert cfg.cache_config.mamba_cache_mode == "align"
    assert max(map(len, gpu_runs.spec_prompts())) + 128 <= cfg.model_config.max_model_len
    layers = gm.SPEC_HYBRID["num_hidden_layers"]
    assert layers // gm.SPEC_HYBRID["full_attention_interval"] >= 2 and layers % 2 == 0  # attention on both ranks


@pytest.mark.slow
def test_eagle3_config_with_the_plugin(engine_config, spec_dirs):
    from vllm.distributed.utils import get_pp_indices
    from vllm.model_executor.models.registry import ModelRegistry
    from vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils import get_eagle3_aux_layers_from_config

    model, drafter = spec_dirs
    cfg = engine_config(**gpu_runs.spec_kwargs(model, "eagle3", drafter))  # the plugin's preflight inside
    spec = cfg.speculative_config
    draft = spec.draft_model_config
    entry = ModelRegistry.models.get(draft.architecture)
    assert spec.method == "eagle3" and spec.num_speculative_tokens == 2 and not spec.parallel_drafting
    assert f"{entry.module_name}.{entry.class_name}" == gm.EAGLE3_DRAFTER_CLASS
    assert draft.hf_config.hidden_size == cfg.model_config.get_hidden_size()
    assert (getattr(draft.hf_config, "draft_vocab_size", None) or draft.get_vocab_size()) == cfg.model_config.get_vocab_size()
    aux = get_eagle3_aux_layers_from_config(spec)
    assert list(aux) == gm.EAGLE3_AUX_LAYERS
    assert draft.hf_config.eagle_config["eagle_aux_hidden_state_layer_ids"] == gm.EAGLE3_AUX_LAYERS  # sizes the fc
    pp, n = cfg.parallel_config.pipeline_parallel_size, cfg.model_config.get_total_num_hidden_layers()
    assert gm.aux_layer_ranks(aux, [get_pp_indices(n, r, pp) for r in range(pp)]) == {2: 0, 4: 0, 5: 1}
    assert executor(cfg) == "DualGpuExecutor" and pp == 2
    assert cfg._get_v2_model_runner_unsupported_features() == []
    assert preflight.check(cfg, 2) == []  # as with two GPUs visible
    assert preflight.aux_relay_problem(cfg.model_config.architectures) == ""


def test_aux_layer_ranks():
    assert gm.aux_layer_ranks([2, 4, 5], [(0, 4), (4, 8)]) == {2: 0, 4: 0, 5: 1}
    assert gm.aux_layer_ranks([0, 3, 8], [(0, 3), (3, 8)]) == {0: 0, 3: 0, 8: 1}


@pytest.mark.slow
def test_stock_accepts_eagle3_config_and_its_worker_check_refuses(engine_config, spec_dirs, qwen3_5):
    """Stock ("mp") accepts the config; the refusal is the V2 runner's load-time check
    (``verify_supports_aux_hidden_states_over_pp``), run here on vLLM's stock decoder."""
    from torch import nn
    from vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils import verify_supports_aux_hidden_states_over_pp

    cfg = engine_config(**gpu_runs.spec_kwargs(spec_dirs[0], "eagle3", spec_dirs[1], backend="mp"))
    assert str(cfg.parallel_config.distributed_executor_backend) == "mp"
    assert cfg.speculative_config.method == "eagle3"
    model = qwen3_5.Qwen3_5ForCausalLM.__new__(qwen3_5.Qwen3_5ForCausalLM)
    nn.Module.__init__(model)
    decoder = qwen3_5.Qwen3_5Model.__new__(qwen3_5.Qwen3_5Model)
    nn.Module.__init__(decoder)
    model.model = decoder
    with pytest.raises(ValueError, match="Qwen3_5ForCausalLM does not support eagle3 with pipeline parallelism"):
        verify_supports_aux_hidden_states_over_pp(model, "eagle3")


# --- the vision tower on the first rank only ---------------------------------------------------------


@pytest.mark.slow
def test_vision_configs(engine_config, tmp_path):
    from transformers import AutoConfig, AutoTokenizer
    from vllm.model_executor.models.registry import ModelRegistry

    from vllm_dualgpu.patches.spec_common import is_dualgpu_pp

    model = gm.write_vision_model(tmp_path / "vision")
    cfg_json = json.loads((model / "config.json").read_text())
    hf, tk = AutoConfig.from_pretrained(str(model)), AutoTokenizer.from_pretrained(str(model))
    ids = {k: tk.convert_tokens_to_ids(t) for k, t in zip(gm.TOKEN_KEYS, gm.VISION_TOKENS)}
    assert all(cfg_json[k] == v for k, v in ids.items()) and all(0 < v < hf.text_config.vocab_size for v in ids.values())
    assert hf.vision_config.depth == 2 and cfg_json["vision_config"]["out_hidden_size"] == cfg_json["text_config"]["hidden_size"]
    assert all(max(p) < min(ids.values()) for p in gpu_runs.vision_prompts())
    for name in ("preprocessor_config.json", "video_preprocessor_config.json", "tokenizer.json"):
        assert (model / name).exists(), name
    for backend in ("dualgpu", "mp"):
        cfg = engine_config(**gpu_runs.vision_kwargs(model, backend))
        mc = cfg.model_config
        cls, _ = ModelRegistry.resolve_model_cls(mc.architectures, mc)
        assert cls.__name__ == "Qwen3_5ForConditionalGeneration" and mc.is_multimodal_model and mc.is_hybrid
        assert mc.uses_mrope and cfg.parallel_config.pipeline_parallel_size == 2
        assert mc.get_multimodal_config().get_limit_per_prompt("image") == 1  # stock builds the tower everywhere
        assert cfg._get_v2_model_runner_unsupported_features() == []
        assert executor(cfg) == ("DualGpuExecutor" if backend == "dualgpu" else "mp")
        if backend == "dualgpu":
            assert preflight.check(cfg, 2) == [] and is_dualgpu_pp(cfg)


# --- an INT8-packed embedding --------------------------------------------------------------------------


def test_pack_layout_is_the_kernels():
    """Value c at bits 8 * (c % 4) of word c // 4, stored + 128 (compressed-tensors' pack_to_int32)."""
    q = torch.tensor([[1, 2, -128, 127]], dtype=torch.int32)
    word = 129 | 130 << 8 | 0 << 16 | 255 << 24
    assert gm.pack(q).tolist() == [[word - 2**32]]
    assert torch.equal(gm.unpack(gm.pack(q), 4), q)


def test_quantize_round_trips_and_dequantizes_exactly():
    g = torch.Generator().manual_seed(1)
    w = (torch.randn(64, 256, generator=g) * 0.05).to(torch.bfloat16)
    q, scale = gm.quantize(w)
    assert scale.shape == (64, 256 // gm.GROUP) and scale.dtype == torch.bfloat16
    assert int(q.abs().max()) <= gm.QMAX
    packed = gm.pack(q)
    assert packed.dtype == torch.int32 and packed.shape == (64, 256 // gm.PACK)
    assert torch.equal(gm.unpack(packed, 256), q)
    table = gm.dequantize(packed, scale, 256)
    assert table.dtype == torch.bfloat16
    # Power-of-two scales: the float32 product is already a bf16 value, so no rounding mode matters.
    exact = q.float() * scale.float().repeat_interleave(gm.GROUP, dim=1)
    assert torch.equal(table.float(), exact)
    assert (table.float() - w.float()).abs().max() <= scale.float().max()  # a quantization, not noise


@pytest.fixture(scope="module")
def embed_checkpoints(tmp_path_factory):
    return gm.write_embed_checkpoints(tmp_path_factory.mktemp("embedq"))


def kernel_rows(packed, scale, ids):
    """vLLM's ``_dequant_gather_kernel`` source, run by Triton's interpreter on the CPU (vLLM
    itself disables Triton without a GPU driver), for the rows ``ids``."""
    import ast
    import os
    from pathlib import Path

    import vllm.model_executor.layers.quantization.compressed_tensors as ct

    path = Path(ct.__file__).parent / "compressed_tensors_embedding.py"
    fn = next(n for n in ast.parse(path.read_text()).body
              if isinstance(n, ast.FunctionDef) and n.name == "_dequant_gather_kernel")
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"  # read when triton.jit wraps the function
    try:
        import triton
        import triton.language as tl

        ns = {"triton": triton, "tl": tl}
        exec(compile(ast.Module([fn], []), str(path), "exec"), ns)
    finally:
        if old is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = old
    hidden, groups = packed.shape[1] * gm.PACK, scale.shape[1]
    out = torch.empty(len(ids), hidden, dtype=scale.dtype)
    ns["_dequant_gather_kernel"][(len(ids), 1)](  # the arguments _dequant_gather_triton passes
        ids, packed, scale, out, hidden, packed.shape[1], groups, NUM_BITS=gm.BITS, PACK_FACTOR=gm.PACK,
        GROUP_SIZE=0 if groups == 1 else hidden // groups, BLOCK=min(1 << (hidden - 1).bit_length(), 1024))
    return out


@pytest.mark.slow
def test_embed_checkpoints_pack_what_the_kernel_unpacks(embed_checkpoints):
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
    from safetensors.torch import load_file

    qt = load_file(str(embed_checkpoints["quantized"] / "model.safetensors"))
    dn = load_file(str(embed_checkpoints["dense"] / "model.safetensors"))
    packed, scale = qt[f"{gm.EMBED}.weight_packed"], qt[f"{gm.EMBED}.weight_scale"]
    hidden = int(qt[f"{gm.EMBED}.weight_shape"][1])
    q = gm.unpack(packed, hidden)
    table = dn[f"{gm.EMBED}.weight"]
    assert torch.equal(gm.pack(q), packed) and int(q.min()) >= -gm.OFFSET
    assert torch.equal(pack_to_int32(q.to(torch.int8), gm.BITS), packed)
    assert torch.equal(table.view(torch.int16), gm.dequantize(packed, scale, hidden).view(torch.int16))
    same = sorted(k for k in dn if k in qt and torch.equal(dn[k], qt[k]))
    assert len(same) == len(dn) - 1 == len(qt) - 3  # only the embedding differs
    ids = torch.tensor(sorted({0, 1, len(table) - 1, *range(5, len(table), 97)}))
    assert torch.equal(kernel_rows(packed, scale, ids).view(torch.int16), table[ids].view(torch.int16))
    expected = gm.embed_expected(embed_checkpoints)
    assert expected["param_bytes"]["weight_packed"] * 2 == expected["bf16_table_bytes"]  # int8: half a bf16 table
    assert expected["embedding_bytes"] < expected["bf16_table_bytes"]
    for name in ("model.safetensors", "model-mtp.safetensors"):
        assert (embed_checkpoints["quantized"] / name).exists() and (embed_checkpoints["dense"] / name).exists()
    qcfg = json.loads((embed_checkpoints["quantized"] / "config.json").read_text())
    dcfg = json.loads((embed_checkpoints["dense"] / "config.json").read_text())
    assert qcfg.pop("quantization_config") == gm.EMBED_QUANT_CONFIG and qcfg == dcfg
    assert dcfg["mtp_num_hidden_layers"] == 1


@pytest.mark.slow
def test_embed_engine_configs(engine_config, embed_checkpoints, monkeypatch):
    from torch import nn
    from vllm.config import VllmConfig
    from vllm.model_executor.layers.linear import ColumnParallelLinear, QKVParallelLinear
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

    for k, v in gpu_runs.EMBEDQ_ENV.items():  # the arms' split, for preflight
        monkeypatch.setenv(k, v)
    arms = {"plugin-quantized": ("quantized", "dualgpu"), "plugin-dense": ("dense", "dualgpu"),
            "stock-quantized": ("quantized", "mp")}
    cfgs = {a: engine_config(**gpu_runs.embedq_kwargs(embed_checkpoints[ck], b)) for a, (ck, b) in arms.items()}
    assert [executor(c) for c in cfgs.values()] == ["DualGpuExecutor", "DualGpuExecutor", "mp"]
    assert [c.model_config.quantization for c in cfgs.values()] == ["compressed-tensors", None, "compressed-tensors"]
    for c in cfgs.values():
        assert c.parallel_config.pipeline_parallel_size == 2 and c.speculative_config.method == "mtp"
    for a in ("plugin-quantized", "plugin-dense"):
        assert preflight.check(cfgs[a], 2) == [], a
    dense = cfgs["plugin-dense"].model_config
    assert all(max(x) < dense.get_vocab_size() for x in gpu_runs.embedq_prompts())
    assert max(map(len, gpu_runs.embedq_prompts())) + 32 + gpu_runs.NUM_SPEC <= dense.max_model_len
    cfg = cfgs["plugin-quantized"]
    assert cfg.speculative_config.draft_model_config.quantization == "compressed-tensors"
    qc = VllmConfig._get_quantization_config(cfg.model_config, cfg.load_config)  # as the workers build it
    assert type(qc).__name__ == "CompressedTensorsConfig"

    def method(cls, prefix):
        layer = cls.__new__(cls)  # get_quant_method looks at the class and the prefix only
        nn.Module.__init__(layer)
        m = qc.get_quant_method(layer, prefix)
        return type(m).__name__ if m is not None else None

    assert method(VocabParallelEmbedding, gm.EMBED) == method(VocabParallelEmbedding, "mtp.embed_tokens") \
        == "CompressedTensorsEmbeddingWNA16Int"
    assert method(ParallelLMHead, "lm_head") is None
    assert method(QKVParallelLinear, "model.layers.3.self_attn.qkv_proj") == "UnquantizedLinearMethod"
    assert method(ColumnParallelLinear, "mtp.fc") == "UnquantizedLinearMethod"
