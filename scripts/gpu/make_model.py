#!/usr/bin/env python3
"""Write a small model directory for GPU tests: config.json, a tokenizer, optionally weights.

Nothing is downloaded. ``--weights dummy`` writes only the config (run vLLM with
load_format="dummy"); ``--weights random`` saves seeded random weights with transformers so two
runs of the same model can be compared token for token.

    python scripts/gpu/make_model.py PRESET OUTDIR [--weights dummy|random] [--seed 0]

Presets ``*-hybrid`` are Qwen3.5-style text models (``Qwen3_5ForCausalLM``, model_type
``qwen3_5_text``): three Gated DeltaNet (linear attention) layers per full-attention layer, as
in Qwen3.5 (``small-attn-mtp``: the same model with every layer full attention), plus one MTP
layer (``mtp_num_hidden_layers: 1``) so vLLM can run them with
``speculative_config={"method": "mtp", ...}``. transformers builds the main model but has no
MTP module (it ignores ``mtp.*`` keys on load), so the MTP weights (``mtp.fc``, the three MTP
norms and one full-attention decoder layer, named as in Qwen3.5 checkpoints) are written here,
seeded, to ``model-mtp.safetensors``; their shapes are taken from the main model's own
full-attention layer. A random drafter rarely agrees with the target, so most drafts are
rejected: the tokens stay the target's greedy tokens, which is what the tests compare.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

FP8_BLOCK = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
             "weight_block_size": [128, 128]}


def qwen3(layers, hidden, heads, kv_heads, head_dim, inter, vocab, **extra):
    cfg = {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
        "hidden_size": hidden, "intermediate_size": inter, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim,
        "vocab_size": vocab, "max_position_embeddings": 262144, "rms_norm_eps": 1e-6,
        "rope_theta": 1000000, "torch_dtype": "bfloat16", "tie_word_embeddings": False,
        "hidden_act": "silu", "attention_bias": False, "bos_token_id": 1, "eos_token_id": 2,
    }
    cfg.update(extra)
    return cfg


def qwen3_5(layers, hidden, heads, kv_heads, head_dim, inter, vocab, lin_k_heads, lin_v_heads,
            lin_head_dim, full_every=4, mtp_layers=1, **extra):
    """A Qwen3.5-style hybrid: Gated DeltaNet layers with a full-attention layer every
    ``full_every`` layers (the last of each group), gated attention output, partial RoPE."""
    cfg = {
        "architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text",
        "hidden_size": hidden, "intermediate_size": inter, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim,
        "layer_types": ["full_attention" if (i + 1) % full_every == 0 else "linear_attention"
                        for i in range(layers)],
        "linear_conv_kernel_dim": 4, "linear_key_head_dim": lin_head_dim,
        "linear_value_head_dim": lin_head_dim, "linear_num_key_heads": lin_k_heads,
        "linear_num_value_heads": lin_v_heads,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000000,
                            "partial_rotary_factor": 0.25},
        "vocab_size": vocab, "max_position_embeddings": 262144, "rms_norm_eps": 1e-6,
        "torch_dtype": "bfloat16", "tie_word_embeddings": False, "hidden_act": "silu",
        "attention_bias": False, "mtp_num_hidden_layers": mtp_layers,
        "bos_token_id": 1, "eos_token_id": 2,
    }
    cfg.update(extra)
    return cfg


def _small_qwen3_5(**kw):
    return qwen3_5(8, 512, 8, 2, 256, 1536, 4096, lin_k_heads=4, lin_v_heads=8, lin_head_dim=128, **kw)


PRESETS = {
    # Boots in seconds; for plumbing tests.
    "tiny-dense": lambda: qwen3(4, 256, 4, 2, 64, 512, 2048),
    # Small but real enough for greedy-equality tests with random weights.
    "small-dense": lambda: qwen3(8, 512, 8, 4, 64, 1536, 4096),
    # Qwen3-14B-class shapes with block-FP8 weights (dummy): the memory benchmark's model.
    "qwen3-14b-fp8": lambda: qwen3(40, 5120, 40, 8, 128, 17408, 151936, quantization_config=FP8_BLOCK),
    # Qwen3.5-style GDN hybrid with one MTP layer; the hybrid counterpart of small-dense
    # (head dims as in Qwen3.5: 256 for attention, 128 for the linear-attention heads).
    "small-hybrid": lambda: _small_qwen3_5(),
    # small-hybrid with every layer full attention: the same Qwen3.5 model class, attention and
    # MTP layer, but no GDN layer, so it runs in float32 (vLLM 0.30's GDN prefill does not).
    "small-attn-mtp": lambda: _small_qwen3_5(full_every=1),
}


def is_hybrid(cfg: dict) -> bool:
    return "linear_attention" in cfg.get("layer_types", ())


def has_mtp(model_dir: Path) -> bool:
    """Whether a model directory holds MTP weights vLLM's ``method: mtp`` can load."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    if not cfg.get("mtp_num_hidden_layers"):
        return False
    return any(_safetensors_names(f, prefix="mtp.") for f in Path(model_dir).glob("*.safetensors"))


def _safetensors_names(path: Path, prefix: str = "") -> list[str]:
    """Tensor names in a safetensors file, read from its JSON header (no torch needed)."""
    import struct

    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    return [k for k in header if k != "__metadata__" and k.startswith(prefix)]


def write_tokenizer(out: Path, vocab_size: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    words = ("the a of to and in is it you that he was for on are with as I his they be at one "
             "have this from or had by hot word but what some we can out other were all there "
             "when up use your how said an each she which do their time if will way about many "
             "then them write would like so these her long make thing see him two has look more "
             "day could go come did number sound no most people my over know water than call "
             "first who may down side been now find any new work part take get place made live "
             "where after back little only round man year came show every good me give our under "
             "planet mercury venus earth mars jupiter saturn uranus neptune sun moon star").split()
    corpus = [" ".join(words[i:] + words[:i]) for i in range(len(words))] * 4
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=min(vocab_size, 1000), special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")
    fast.save_pretrained(str(out))


def write_random_weights(out: Path, cfg: dict, seed: int) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    config = AutoConfig.for_model(**{k: v for k, v in cfg.items() if k != "architectures"})
    if cfg["model_type"] == "qwen3_5_text":
        # transformers resolves qwen3_5_text to its CausalLM; make sure it did not pick a
        # multimodal class that would save the weights under another prefix.
        assert type(config).__name__ == "Qwen3_5TextConfig", type(config).__name__
    model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.bfloat16)
    # Larger-than-default init keeps greedy outputs varied instead of collapsing to one token.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.05)
    model.save_pretrained(str(out), safe_serialization=True)
    if cfg.get("mtp_num_hidden_layers"):
        write_mtp_weights(out, cfg, model.state_dict(), seed)


def mtp_tensors(cfg: dict, state: dict, seed: int) -> dict:
    """Seeded MTP weights named as in Qwen3.5 checkpoints (``mtp.*``), shaped from ``state``.

    Each MTP decoder layer copies the shapes of the main model's first full-attention layer
    (the MTP layer is a full-attention layer); ``mtp.fc`` maps [embedding; hidden] (2 x hidden)
    to hidden. Norms are Gemma-style (1 + weight) and start at zero, as transformers
    initialises them; matrices get the same N(0, 0.05) as the main model.
    """
    import torch

    full = cfg["layer_types"].index("full_attention")
    src = f"model.layers.{full}."
    template = {k[len(src):]: v for k, v in state.items() if k.startswith(src)}
    if not template:
        raise ValueError(f"no weights under {src!r} to shape the MTP layer from")
    hidden = cfg["hidden_size"]
    gen = torch.Generator().manual_seed(seed + 1)

    def randn(shape):
        return (torch.randn(shape, generator=gen) * 0.05).to(torch.bfloat16)

    out = {"mtp.fc.weight": randn((hidden, 2 * hidden))}
    for norm in ("mtp.norm.weight", "mtp.pre_fc_norm_hidden.weight", "mtp.pre_fc_norm_embedding.weight"):
        out[norm] = torch.zeros(hidden, dtype=torch.bfloat16)
    for i in range(cfg["mtp_num_hidden_layers"]):
        for name, t in sorted(template.items()):
            key = f"mtp.layers.{i}.{name}"
            out[key] = randn(tuple(t.shape)) if t.dim() >= 2 else torch.zeros(tuple(t.shape), dtype=torch.bfloat16)
    return out


def write_mtp_weights(out: Path, cfg: dict, state: dict, seed: int) -> None:
    from safetensors.torch import save_file

    tensors = mtp_tensors(cfg, state, seed)
    name = "model-mtp.safetensors"
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / name), metadata={"format": "pt"})
    index = out / "model.safetensors.index.json"
    if index.exists():  # sharded checkpoint: loaders follow the index, so list the MTP file
        data = json.loads(index.read_text())
        data.setdefault("weight_map", {}).update({k: name for k in tensors})
        index.write_text(json.dumps(data, indent=1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("preset", choices=sorted(PRESETS))
    ap.add_argument("outdir", type=Path)
    ap.add_argument("--weights", choices=["dummy", "random"], default="dummy")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    cfg = PRESETS[args.preset]()
    args.outdir.mkdir(parents=True, exist_ok=True)
    if args.weights == "random":
        write_random_weights(args.outdir, cfg, args.seed)
    (args.outdir / "config.json").write_text(json.dumps(cfg, indent=1))
    write_tokenizer(args.outdir, cfg["vocab_size"])
    print(f"wrote {args.preset} ({args.weights} weights) to {args.outdir}")


if __name__ == "__main__":
    main()
