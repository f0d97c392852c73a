#!/usr/bin/env python3
"""Write a small model directory for GPU tests: config.json, a tokenizer, optionally weights.

Nothing is downloaded. ``--weights dummy`` writes only the config (run vLLM with
load_format="dummy"); ``--weights random`` saves seeded random weights with transformers so two
runs of the same model can be compared token for token.

    python scripts/gpu/make_model.py PRESET OUTDIR [--weights dummy|random] [--seed 0]
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


PRESETS = {
    # Boots in seconds; for plumbing tests.
    "tiny-dense": lambda: qwen3(4, 256, 4, 2, 64, 512, 2048),
    # Small but real enough for greedy-equality tests with random weights.
    "small-dense": lambda: qwen3(8, 512, 8, 4, 64, 1536, 4096),
    # Qwen3-14B-class shapes with block-FP8 weights (dummy): the memory benchmark's model.
    "qwen3-14b-fp8": lambda: qwen3(40, 5120, 40, 8, 128, 17408, 151936, quantization_config=FP8_BLOCK),
}


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
    model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.bfloat16)
    # Larger-than-default init keeps greedy outputs varied instead of collapsing to one token.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.05)
    model.save_pretrained(str(out), safe_serialization=True)


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
