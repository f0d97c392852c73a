"""The CPU part of gpu_models: what the presets are and what the folders written from them hold
(the DFlash2 drafter's files too: names, shapes, dtypes, and packed values read back independently)."""

from __future__ import annotations

import pytest

import gpu_models as gm


def hybrid(cfg: dict) -> bool:
    return "linear_attention" in cfg.get("layer_types", ())


@pytest.mark.parametrize("preset", ["tiny-dense", "small-hybrid"])
def test_write_model_writes_config_and_tokenizer(preset, tmp_path):
    import transformers

    out = gm.write_model(preset, tmp_path / preset)
    hf = transformers.AutoConfig.from_pretrained(str(out))
    cfg = gm.PRESETS[preset]()
    assert hf.model_type == cfg["model_type"] and hf.num_hidden_layers == cfg["num_hidden_layers"]
    tok = transformers.AutoTokenizer.from_pretrained(str(out))
    sentence = "the sun and the moon over planet earth, 42 times!"
    ids = tok(sentence)["input_ids"]
    assert ids and max(ids) < cfg["vocab_size"] and tok.decode(ids) == sentence
    assert not gm.has_mtp(out)  # dummy: no weights at all
    with pytest.raises(ValueError, match="weights must be"):
        gm.write_model(preset, tmp_path / "x", weights="real")


def test_hybrid_preset_is_a_qwen35_gdn_model_with_mtp_and_attn_mtp_its_twin():
    cfg, attn = gm.PRESETS["small-hybrid"](), gm.PRESETS["small-attn-mtp"]()
    assert cfg["architectures"] == ["Qwen3_5ForCausalLM"] and cfg["model_type"] == "qwen3_5_text"
    kinds = cfg["layer_types"]
    assert len(kinds) == cfg["num_hidden_layers"] and kinds.count("linear_attention") == 3 * kinds.count("full_attention")
    assert cfg["mtp_num_hidden_layers"] == 1 and hybrid(cfg) and not hybrid(gm.PRESETS["small-dense"]())
    # float32's stand-in for the hybrid differs from it only in the layer kinds.
    assert set(attn["layer_types"]) == {"full_attention"} and len(attn["layer_types"]) == attn["num_hidden_layers"]
    assert {k: v for k, v in attn.items() if k != "layer_types"} == {k: v for k, v in cfg.items() if k != "layer_types"}


def test_mtp_tensors_named_and_shaped_like_qwen35():
    import torch

    cfg = gm.PRESETS["small-hybrid"]()
    full, h = cfg["layer_types"].index("full_attention"), cfg["hidden_size"]
    state = {f"model.layers.{full}.self_attn.q_proj.weight": torch.zeros(2 * 8 * 256, h),
             f"model.layers.{full}.self_attn.q_norm.weight": torch.zeros(256),
             f"model.layers.{full}.mlp.down_proj.weight": torch.zeros(h, 1536),
             "model.layers.0.linear_attn.in_proj_qkv.weight": torch.zeros(1024, h)}
    t = gm.mtp_tensors(cfg, state, seed=0)
    assert set(t) == {"mtp.fc.weight", "mtp.norm.weight", "mtp.pre_fc_norm_hidden.weight",
                      "mtp.pre_fc_norm_embedding.weight", "mtp.layers.0.self_attn.q_proj.weight",
                      "mtp.layers.0.self_attn.q_norm.weight", "mtp.layers.0.mlp.down_proj.weight"}
    assert tuple(t["mtp.fc.weight"].shape) == (h, 2 * h)
    assert tuple(t["mtp.layers.0.self_attn.q_proj.weight"].shape) == (2 * 8 * 256, h)
    assert not t["mtp.norm.weight"].any() and t["mtp.fc.weight"].float().std() > 0.01
    again, other = gm.mtp_tensors(cfg, state, seed=0), gm.mtp_tensors(cfg, state, seed=1)
    assert all(torch.equal(t[k], again[k]) for k in t)
    assert not torch.equal(t["mtp.fc.weight"], other["mtp.fc.weight"])


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["small-hybrid", "small-attn-mtp"])
def test_qwen35_random_weights_include_mtp(tmp_path, preset):
    import json

    out = tmp_path / "hy"
    out.mkdir()
    cfg = gm.PRESETS[preset]()
    cfg.update(num_hidden_layers=4, layer_types=cfg["layer_types"][:4], hidden_size=128,
               intermediate_size=256, vocab_size=512)
    gm.write_random_weights(out, cfg, seed=0)
    (out / "config.json").write_text(json.dumps(cfg))
    main_names = set().union(*(gm._safetensors_names(f) for f in out.glob("*.safetensors")
                               if f.name != "model-mtp.safetensors"))
    mtp_names = set(gm._safetensors_names(out / "model-mtp.safetensors"))
    assert ("model.layers.0.linear_attn.in_proj_qkv.weight" in main_names) == hybrid(cfg)
    assert ("model.layers.0.self_attn.q_proj.weight" in main_names) != hybrid(cfg)
    assert not any(n.startswith("mtp.") for n in main_names)
    layer = {n.split("model.layers.3.", 1)[1] for n in main_names if n.startswith("model.layers.3.")}
    assert {n.split("mtp.layers.0.", 1)[1] for n in mtp_names if n.startswith("mtp.layers.0.")} == layer
    assert gm.has_mtp(out)


# --- the DFlash drafter's files -------------------------------------------------------------------


def unpack_int4(words, cols: int):
    """The test's own reading of compressed-tensors' W4A16 layout: value c of a row at bits
    4 * (c % 8) of word c // 8, stored as q + 8."""
    import torch

    col = torch.arange(cols)
    nibbles = (words.to(torch.int64)[:, col // 8] >> (4 * (col % 8))) & 0xF
    return nibbles - 8


@pytest.fixture(scope="module")
def dflash_drafter(tmp_path_factory):
    return gm.write_dflash_drafter(tmp_path_factory.mktemp("dflash") / "drafter", seed=3)


def test_dflash_drafter_files_hold_what_vllms_loader_maps(dflash_drafter):
    """Names without "model." (vLLM's load_weights adds it), q/k/v and gate/up as separate
    tensors (its loader stacks them), no embedding and no lm_head (the target's are used), every
    linear layer vLLM quantizes (the convolutions' kernel projections too) as weight_packed int32
    [out, in/8], weight_scale bf16 [out, in/128] and weight_shape int64 [out, in]; the norms,
    the base kernels and the selector (codebooks, projection) bf16."""
    import json

    import torch
    from safetensors.torch import load_file

    files = load_file(str(dflash_drafter / "model.safetensors"))
    cfg = json.loads((dflash_drafter / "config.json").read_text())
    assert cfg == gm.dflash_drafter_config()
    h, inter, hd = 1024, 2048, 128  # spec-hybrid's width and MLP; heads 8 (q) and 2 (k, v) of 128
    per_layer = {"self_attn.q_proj": (8 * hd, h), "self_attn.k_proj": (2 * hd, h), "self_attn.v_proj": (2 * hd, h),
                 "self_attn.o_proj": (h, 8 * hd), "mlp.gate_proj": (inter, h), "mlp.up_proj": (inter, h),
                 "mlp.down_proj": (h, inter),
                 # 2 x taps (2) x hidden / group (16) = 256 per-token kernel coefficients
                 "attention_conv.kernel_projection": (256, h), "mlp_conv.kernel_projection": (256, h)}
    linears = {f"layers.{i}.{n}": s for i in range(5) for n, s in per_layer.items()}
    linears["fc"] = (h, 5 * h)  # the 5 target states, concatenated
    norms = {f"layers.{i}.{n}.weight": d for i in range(5) for n, d in
             (("input_layernorm", h), ("post_attention_layernorm", h), ("self_attn.q_norm", hd), ("self_attn.k_norm", hd))}
    norms.update({"hidden_norm.weight": h, "norm.weight": h})
    dense = {f"layers.{i}.{c}.base_kernel": (2, 2, h) for i in range(5) for c in ("attention_conv", "mlp_conv")}
    selector = {"predecessor_codebook": (8192, 32), "successor_codebook": (8192, 32),  # vocabulary x rank
                "hidden_projection.weight": (32, h)}
    dense.update({f"candidate_selector.{n}": shape for n, shape in selector.items()})
    expected = {f"{n}.{s}" for n in linears for s in ("weight_packed", "weight_scale", "weight_shape")}
    assert set(files) == expected | set(norms) | set(dense)
    for name, (out, inp) in linears.items():
        packed, scale, shape = (files[f"{name}.{s}"] for s in ("weight_packed", "weight_scale", "weight_shape"))
        assert packed.dtype == torch.int32 and tuple(packed.shape) == (out, inp // 8), name
        assert scale.dtype == torch.bfloat16 and tuple(scale.shape) == (out, inp // 128), name
        assert shape.dtype == torch.int64 and shape.tolist() == [out, inp], name
    for name, dim in norms.items():
        t = files[name]
        assert t.dtype == torch.bfloat16 and tuple(t.shape) == (dim,) and bool((t == 1).all()), name
    for name, shape in dense.items():  # seeded, small: N(0, 0.05) as the other weights
        t = files[name].float()
        assert files[name].dtype == torch.bfloat16 and tuple(t.shape) == shape, name
        assert 0.03 < float(t.std()) < 0.07 and float(t.abs().max()) < 0.5, (name, float(t.std()))
    assert not any("embed_tokens" in n or "lm_head" in n or n.startswith("model.") for n in files)


def test_dflash_drafter_packs_what_was_quantized(dflash_drafter):
    """The packed words unpack (the test's own reading, and compressed-tensors' unpack_from_int32)
    to the quantized values of the drafter's seeded bf16 weights: q in [-8, 7] with q * scale
    within half a step of the weight, which is quantize_w4's q."""
    import torch
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32
    from safetensors.torch import load_file

    files = load_file(str(dflash_drafter / "model.safetensors"))
    dense = gm.dflash_drafter_tensors(gm.dflash_drafter_config(), seed=3)
    for name in ("layers.0.self_attn.q_proj", "layers.4.self_attn.v_proj", "layers.2.mlp.down_proj", "fc",
                 "layers.0.attention_conv.kernel_projection", "layers.4.mlp_conv.kernel_projection"):
        w = dense[f"{name}.weight"].float()
        packed, scale = files[f"{name}.weight_packed"], files[f"{name}.weight_scale"].float()
        q = unpack_int4(packed, w.shape[1])
        assert int(q.min()) >= -8 and int(q.max()) <= 7 and int(q.abs().max()) >= 6, name
        assert torch.equal(q.to(torch.int8), unpack_from_int32(packed, 4, torch.Size(w.shape)))
        assert torch.equal(pack_to_int32(q.to(torch.int8), 4), packed)
        step = scale.repeat_interleave(128, dim=1)
        err = (q.float() * step - w).abs()
        assert bool((err <= step / 2 * (1 + 2**-7)).all()), (name, float((err / step).max()))
        assert torch.equal(q.to(torch.int8), gm.quantize_w4(dense[f"{name}.weight"])[0]), name
    # the dense tensors are written as generated
    for name in ("layers.1.mlp_conv.base_kernel", "candidate_selector.successor_codebook",
                 "candidate_selector.hidden_projection.weight"):
        assert torch.equal(files[name], dense[name]), name
    # the same seed writes the same weights; another seed others
    again, other = (gm.dflash_drafter_tensors(gm.dflash_drafter_config(), seed=s) for s in (3, 4))
    for name in ("fc.weight", "candidate_selector.predecessor_codebook", "layers.0.attention_conv.base_kernel"):
        assert torch.equal(dense[name], again[name]) and not torch.equal(dense[name], other[name]), name


def test_dflash_drafter_in_bf16_has_no_quantization(tmp_path):
    import json

    import torch
    from safetensors.torch import load_file

    out = gm.write_dflash_drafter(tmp_path / "bf16", packed=False)
    files = load_file(str(out / "model.safetensors"))
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    assert files["fc.weight"].dtype == torch.bfloat16 and tuple(files["fc.weight"].shape) == (1024, 5 * 1024)
    kp = files["layers.0.attention_conv.kernel_projection.weight"]
    assert kp.dtype == torch.bfloat16 and tuple(kp.shape) == (256, 1024)
    assert not any(n.endswith(("weight_packed", "weight_scale", "weight_shape")) for n in files)


def test_dflash_target_preset_is_spec_hybrid_with_its_layer_kinds():
    cfg = gm.PRESETS["dflash-hybrid"]()
    assert {k: v for k, v in cfg.items() if k != "layer_types"} == gm.SPEC_HYBRID
    assert cfg["layer_types"] == (["linear_attention"] * 3 + ["full_attention"]) * 2


@pytest.mark.slow
def test_write_dflash_models_writes_both_folders_once(tmp_path):
    """The GPU test's models: the target with seeded weights (mtp_tensors reads the preset's
    layer kinds) and a tokenizer, the W4A16 drafter; a second call keeps them."""
    import json

    dirs = gm.write_dflash_models(tmp_path)
    target, drafter = dirs["target"], dirs["drafter"]
    assert json.loads((target / "config.json").read_text()) == gm.DFLASH_TARGET
    names = set().union(*(gm._safetensors_names(f) for f in target.glob("*.safetensors")))
    assert "model.layers.0.linear_attn.in_proj_qkv.weight" in names and "model.layers.3.self_attn.q_proj.weight" in names
    assert "model.embed_tokens.weight" in names and "lm_head.weight" in names  # what the drafter shares
    assert (target / "tokenizer.json").exists() and gm.has_mtp(target)
    assert json.loads((drafter / "config.json").read_text()) == gm.dflash_drafter_config()
    stamps = {p: p.stat().st_mtime_ns for p in (target / "model.safetensors", drafter / "model.safetensors")}
    assert gm.write_dflash_models(tmp_path) == dirs
    assert {p: p.stat().st_mtime_ns for p in stamps} == stamps
