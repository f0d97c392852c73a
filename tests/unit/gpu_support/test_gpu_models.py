"""The CPU part of gpu_models: what the presets are and what the folders written from them hold."""

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
