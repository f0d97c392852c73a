"""The small models of the GPU tests and benchmarks: presets, and folders written from them.

Nothing is downloaded. ``write_model(preset, dir)`` writes config.json and a tokenizer (for
load_format="dummy"); ``weights="random"`` also saves seeded weights, so two runs can be compared
token for token. ``*-hybrid`` presets are Qwen3.5-style text models (three Gated DeltaNet layers
per full-attention layer) with one MTP layer; transformers has no MTP module, so its weights
(named as in Qwen3.5 checkpoints, shaped from the model's own full-attention layer) are written
here to ``model-mtp.safetensors``. A random drafter rarely agrees with the target: the tokens stay
the target's greedy tokens. Also the EAGLE3 drafter, the vision model, the checkpoint pair with
an INT8-packed embedding, and a scaled-down DFlash2 drafter (W4A16 packed, seeded weights) next to
the hybrid. Importable without torch (CPU tests build vLLM configs from these).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
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


def gdn_prefill_config() -> dict:
    """``additional_config`` for hybrid (GDN) models: the same GDN prefill kernel in every run.

    vLLM picks FlashInfer's on SM 9.0, which needs the CuTe DSL (nvidia-cutlass-dsl); Triton's
    runs wherever vLLM does. ``GDN_PREFILL_BACKEND`` overrides.
    """
    return {"gdn_prefill_backend": os.environ.get("GDN_PREFILL_BACKEND", "triton")}


def write_model(preset: str, out: Path, weights: str = "dummy", seed: int = 0) -> Path:
    """A model folder for ``preset``: config.json, a tokenizer, and with weights="random" seeded
    weights (MTP weights too for presets with an MTP layer). Returns ``out``."""
    cfg = PRESETS[preset]()
    out.mkdir(parents=True, exist_ok=True)
    if weights == "random":
        write_random_weights(out, cfg, seed)
    elif weights != "dummy":
        raise ValueError(f"weights must be 'dummy' or 'random', not {weights!r}")
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    write_tokenizer(out, cfg["vocab_size"])
    return out


# --- speculative decoding under PP: the target and an EAGLE3 drafter -----------------------------

SPEC_HYBRID = {
    "architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text", "vocab_size": 8192,
    "hidden_size": 1024, "intermediate_size": 2048,
    "num_hidden_layers": 8,  # 6 Gated DeltaNet + 2 full attention; 4 layers per PP rank
    "full_attention_interval": 4, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 128,
    "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
    "linear_num_key_heads": 4, "linear_num_value_heads": 8, "mtp_num_hidden_layers": 1,
    "max_position_embeddings": 8192, "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1000000, "partial_rotary_factor": 0.25},
    "hidden_act": "silu", "attention_bias": False, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "bos_token_id": 1, "eos_token_id": 2,
}
PRESETS["spec-hybrid"] = lambda: dict(SPEC_HYBRID)

# EAGLE3 (vLLM 0.30.0 file:line under site-packages/vllm/): ``LlamaForCausalLMEagle3`` maps to
# llama_eagle3.Eagle3LlamaForCausalLM (model_executor/models/registry.py:663); hidden size and
# vocabulary are the target's (the first layer concatenates its embedding with the target's
# states, llama_eagle3.py:82 and :270; no d2t table, :339); the runner reads the target's layers
# from ``eagle_aux_hidden_state_layer_ids`` (v1/worker/gpu/spec_decode/eagle/eagle3_utils.py:106),
# the drafter sizes its fc from ``eagle_config`` (llama_eagle3.py:213-221). [2, 4, 5] is vLLM's
# default for 8 layers ((2, n//2, n-3), interfaces.py:1733): with the 4/4 split ids 2 and 4 are
# captured on rank 0 and relayed to rank 1, id 5 on rank 1.
EAGLE3_AUX_LAYERS = [2, 4, 5]
_FROM_TARGET = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                "head_dim", "vocab_size", "max_position_embeddings", "rms_norm_eps", "hidden_act",
                "attention_bias", "tie_word_embeddings", "torch_dtype", "bos_token_id", "eos_token_id")
EAGLE3_CONFIG = {
    "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
    **{k: SPEC_HYBRID[k] for k in _FROM_TARGET},
    "num_hidden_layers": 1, "draft_vocab_size": SPEC_HYBRID["vocab_size"],
    "rope_parameters": {"rope_type": "default", "rope_theta": 1000000},
    "eagle_aux_hidden_state_layer_ids": EAGLE3_AUX_LAYERS,
    "eagle_config": {"eagle_aux_hidden_state_layer_ids": EAGLE3_AUX_LAYERS, "use_aux_hidden_state": True},
}
EAGLE3_DRAFTER_CLASS = "vllm.model_executor.models.llama_eagle3.Eagle3LlamaForCausalLM"


def write_config_only(cfg: dict, out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    return out


def aux_layer_ranks(layer_ids, bounds: list[tuple[int, int]]) -> dict[int, int]:
    """The PP rank that captures each auxiliary state, given each rank's layers [start, end)
    (vLLM's ``get_pp_indices``). Id L is the state after layer L - 1 (id 0, the input, on the
    first rank), so a rank captures the ids in (start, end]."""
    ranks = {}
    for layer in layer_ids:
        for rank, (lo, hi) in enumerate(bounds):
            if (layer == 0 and rank == 0) or lo < layer <= hi:
                ranks[int(layer)] = rank
                break
    return ranks


# --- a Qwen3.5 multimodal model (the vision tower on the first rank only) ------------------------

VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
TOKEN_KEYS = ("vision_start_token_id", "vision_end_token_id", "image_token_id", "video_token_id")
VISION_TEXT_CONFIG = {
    **{k: v for k, v in SPEC_HYBRID.items() if k not in ("architectures", "model_type", "mtp_num_hidden_layers")},
    "model_type": "qwen3_5_text",
    "head_dim": 256,  # rotary dim 256 * 0.25 = 64 = 2 * sum(mrope_section), as in Qwen3.5
    "rope_parameters": {**SPEC_HYBRID["rope_parameters"], "mrope_section": [11, 11, 10], "mrope_interleaved": True},
}
VISION_CONFIG = {  # Qwen3_VisionTransformer (qwen3_vl.py:564-665); head_dim 256 / 4 = 64
    "model_type": "qwen3_5", "depth": 2, "hidden_size": 256, "intermediate_size": 512, "num_heads": 4,
    "in_channels": 3, "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2,
    "num_position_embeddings": 2304, "out_hidden_size": VISION_TEXT_CONFIG["hidden_size"],
    "deepstack_visual_indexes": [], "hidden_act": "gelu_pytorch_tanh",
}
IMAGE_PROCESSOR = {  # as Qwen3.5's own file, with at most 512x512 pixels per image
    "size": {"longest_edge": 512 * 512, "shortest_edge": 64 * 64}, "patch_size": 16, "temporal_patch_size": 2,
    "merge_size": 2, "image_mean": [0.5] * 3, "image_std": [0.5] * 3, "processor_class": "Qwen3VLProcessor",
    "image_processor_type": "Qwen2VLImageProcessorFast",
}
VIDEO_PROCESSOR = {**{k: v for k, v in IMAGE_PROCESSOR.items() if k != "image_processor_type"},
                   "video_processor_type": "Qwen3VLVideoProcessor", "fps": 2, "min_frames": 4, "max_frames": 8}


def write_vision_model(out: Path) -> Path:
    """``Qwen3_5ForConditionalGeneration``: the spec-hybrid text model without MTP and a 2-block
    vision encoder, dummy weights; a tokenizer with the four vision tokens (their ids in
    config.json) and the HF processor files vLLM's profiling needs offline."""
    ids = write_vision_files(out, VISION_TEXT_CONFIG["vocab_size"])
    config = {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
              "text_config": VISION_TEXT_CONFIG, "vision_config": VISION_CONFIG, **ids,
              "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
    (out / "config.json").write_text(json.dumps(config, indent=1))
    return out


def write_vision_files(out: Path, vocab_size: int, max_pixels: int = 512 * 512) -> dict[str, int]:
    """A tokenizer with the four vision tokens and the HF processor files vLLM's profiling needs
    offline (images up to ``max_pixels``); returns the tokens' ids under their config.json keys."""
    from transformers import AutoTokenizer

    out.mkdir(parents=True, exist_ok=True)
    write_tokenizer(out, vocab_size)
    tok = AutoTokenizer.from_pretrained(str(out))
    tok.add_special_tokens({"additional_special_tokens": list(VISION_TOKENS)})
    tok.save_pretrained(str(out))
    size = {"size": {**IMAGE_PROCESSOR["size"], "longest_edge": max_pixels}}
    (out / "preprocessor_config.json").write_text(json.dumps({**IMAGE_PROCESSOR, **size}, indent=1))
    (out / "video_preprocessor_config.json").write_text(json.dumps({**VIDEO_PROCESSOR, **size}, indent=1))
    return {key: tok.convert_tokens_to_ids(t) for key, t in zip(TOKEN_KEYS, VISION_TOKENS)}


# --- the bundled 27B reference shapes in the reference setup's weight formats (dummy weights) ---

# W8A16 as the reference setup's checkpoint most likely is (its config.json is not here; from what
# is public): compressed-tensors int8 weights in groups of 128 with bf16 scales (its family's model
# card: "group size 128, RTN"; the reference's docs: "INT8 group weights"), and the input embedding
# INT8-packed in the same scheme (the reference's patch 08 passes quant_config to the embedding "so
# the INT8 embed_tokens.weight_packed loads"), skipping what the bundled FP8 config skips (lm_head,
# the vision tower, the GDN in_proj_a/b, mtp.fc). Before 2026-12-03 the virtual-pair runs carried
# int8 with a scale per output channel and a bf16 embedding.
W8A16_WEIGHTS = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "group", "group_size": 128,
                 "dynamic": False, "actorder": None, "observer": "minmax"}
W8A16_GROUP = {"targets": ["Linear"], "input_activations": None, "output_activations": None,
               "weights": W8A16_WEIGHTS}
W8A16_EMBED_GROUP = {"targets": ["re:.*embed_tokens$"], "input_activations": None, "output_activations": None,
                     "weights": W8A16_WEIGHTS}
# ModelOpt's NVFP4 (W4A4, groups of 16); vLLM runs it on SM 9.0 only through weight-only kernels.
NVFP4 = {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16}
REFERENCE_QUANTS = ("w8a16", "fp8", "nvfp4")


def reference_quant_config(quant: str, fp8: dict) -> dict:
    """The ``quantization_config`` of the reference shapes in ``quant``, from the bundled FP8 one."""
    skip = list(fp8["modules_to_not_convert"])
    if quant == "fp8":
        return dict(fp8)
    if quant == "w8a16":
        return {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
                "config_groups": {"group_0": W8A16_GROUP, "embeddings": W8A16_EMBED_GROUP}, "ignore": skip}
    if quant == "nvfp4":
        return {**NVFP4, "exclude_modules": skip}
    raise ValueError(f"quant {quant!r}: use one of {', '.join(REFERENCE_QUANTS)}")


def write_reference_model(out: Path, quant: str, tokenizer: bool = True) -> Path:
    """The bundled Qwen3.8-27B-class reference config (vision tower, one MTP layer) with the
    ``quant`` weight format, for load_format="dummy"; with ``tokenizer`` a tokenizer carrying the
    vision tokens (their ids replace the config's) and processor files for images up to 4 MP."""
    from vllm_dualgpu.planner import reference_config

    cfg = reference_config("qwen3.8-27b")
    cfg.pop("_vllm_dualgpu", None)
    cfg["quantization_config"] = reference_quant_config(quant, cfg["quantization_config"])
    out.mkdir(parents=True, exist_ok=True)
    if tokenizer:
        cfg.update(write_vision_files(out, cfg["text_config"]["vocab_size"], max_pixels=2048 * 2048))
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    return out


# --- an INT8-packed embedding (compressed-tensors pack-quantized) --------------------------------

EMBED = "model.embed_tokens"  # the checkpoint's one embedding; the MTP predictor loads it too
BITS, GROUP = 8, 128
PACK = 32 // BITS  # values per int32 word
OFFSET = 1 << (BITS - 1)  # stored value = q + OFFSET
QMAX = OFFSET - 1
EMBED_QUANT_CONFIG = {
    "quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
    "config_groups": {"embeddings": {"targets": ["re:.*embed_tokens$"], "weights": {
        "num_bits": BITS, "type": "int", "symmetric": True, "strategy": "group", "group_size": GROUP,
        "dynamic": False, "actorder": None, "observer": "minmax"}}},
    "ignore": ["lm_head"],
}


def quantize(w):
    """[vocab, hidden] -> (q int32 in [-QMAX, QMAX], scale bf16 [vocab, hidden // GROUP]).
    Power-of-two scales: q * scale needs at most 8 significant bits, exact in bf16."""
    import torch

    v, h = w.shape
    groups = w.float().reshape(v, h // GROUP, GROUP)
    absmax = groups.abs().amax(-1).clamp_min(1e-8)
    scale = torch.exp2(torch.ceil(torch.log2(absmax / QMAX))).to(torch.bfloat16)
    q = torch.round(groups / scale.float().unsqueeze(-1)).clamp(-QMAX, QMAX)
    return q.to(torch.int32).reshape(v, h), scale


def pack(q, bits: int = BITS):
    """int values [rows, cols] -> int32 words [rows, cols // (32 / bits)] (value c at bits
    bits * (c % per) of word c // per, stored + 2**(bits - 1), as compressed-tensors'
    pack_to_int32 along dim 1): the embedding's INT8 (8*(c % 4), + 128), W4A16's int4 (4*(c % 8), + 8)."""
    import torch

    v, h = q.shape
    per = 32 // bits
    shifts = torch.arange(per, dtype=torch.int64) * bits
    words = ((q.to(torch.int64) + (1 << (bits - 1))).reshape(v, h // per, per) << shifts).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def unpack(packed, hidden: int):
    """The kernel's bit logic in torch: q = ((word >> shift) & mask) - OFFSET, int32 throughout."""
    import torch

    col = torch.arange(hidden)
    shift = ((col % PACK) * BITS).to(torch.int32)
    return ((packed[:, col // PACK] >> shift) & ((1 << BITS) - 1)) - OFFSET


def dequantize(packed, scale, hidden: int):
    """The kernel's row: q.to(float32) * scale.to(float32), cast to the scale's dtype (bf16)."""
    import torch

    grp = torch.arange(hidden) // GROUP
    return (unpack(packed, hidden).to(torch.float32) * scale[:, grp].to(torch.float32)).to(scale.dtype)


def table_sha256(table) -> str:
    import torch

    return hashlib.sha256(table.contiguous().view(torch.int16).cpu().numpy().tobytes()).hexdigest()


def write_embed_checkpoints(out: Path, preset: str = "small-hybrid", seed: int = 0) -> dict[str, Path]:
    """OUT/dense and OUT/quantized from one set of seeded weights: ``model.embed_tokens`` stored
    as pack-quantized INT8 (groups of 128, symmetric) in one, as the dequantized bf16 table in the
    other (power-of-two scales: both embed every token to bitwise the same vector)."""
    import torch
    from safetensors.torch import load_file, save_file

    cfg = PRESETS[preset]()
    dirs = {"dense": out / "dense", "quantized": out / "quantized"}
    dense, quant = dirs["dense"], dirs["quantized"]
    if (quant / "config.json").exists():
        return dirs
    shutil.rmtree(dense, ignore_errors=True)
    shutil.rmtree(quant, ignore_errors=True)
    write_random_weights(dense, cfg, seed)
    state = load_file(str(dense / "model.safetensors"))
    w = state.pop(f"{EMBED}.weight")
    q, scale = quantize(w)
    packed = pack(q)
    quant.mkdir(parents=True)
    save_file({**state, f"{EMBED}.weight_packed": packed, f"{EMBED}.weight_scale": scale,
               f"{EMBED}.weight_shape": torch.tensor(list(w.shape))},
              str(quant / "model.safetensors"), metadata={"format": "pt"})
    save_file({**state, f"{EMBED}.weight": dequantize(packed, scale, w.shape[1])},
              str(dense / "model.safetensors"), metadata={"format": "pt"})
    for name in ("model-mtp.safetensors", "generation_config.json"):
        if (dense / name).exists():
            shutil.copyfile(dense / name, quant / name)
    (dense / "config.json").write_text(json.dumps(cfg, indent=1))
    # Last: its presence means both checkpoints are complete.
    (quant / "config.json").write_text(json.dumps({**cfg, "quantization_config": EMBED_QUANT_CONFIG}, indent=1))
    return dirs


def embed_expected(dirs: dict[str, Path]) -> dict:
    """What a GPU run should show, from the files: sizes and the dense table's digest."""
    from safetensors import safe_open

    with safe_open(str(dirs["quantized"] / "model.safetensors"), "pt") as f:
        params = {n: f.get_tensor(f"{EMBED}.{n}") for n in ("weight_packed", "weight_scale", "weight_shape")}
    nbytes = {n: t.numel() * t.element_size() for n, t in params.items()}
    with safe_open(str(dirs["dense"] / "model.safetensors"), "pt") as f:
        table = f.get_tensor(f"{EMBED}.weight")
    return {"vocab": table.shape[0], "hidden": table.shape[1], "param_bytes": nbytes,
            "embedding_bytes": sum(nbytes.values()), "bf16_table_bytes": table.numel() * 2,
            "dense_table_sha256": table_sha256(table)}


# --- a scaled-down DFlash2 drafter, next to the hybrid ---------------------------------------------

# vLLM 0.33.0 file:line under site-packages/vllm/. The reference drafter (DFLASH_FIXTURE, the
# public DFlash2 drafter's config) is "DFlash2DraftModel": model_executor/models/registry.py:666
# maps it to qwen3_dflash2.DFlash2Qwen3ForCausalLM, which v1/worker/gpu/spec_decode/__init__.py:42-47
# runs with the V2 runner's DFlash2Speculator (the V1 runner refuses it: "DFlash candidate-head
# drafts", config/vllm.py:3133-3137). It is DFlash's model (model_executor/models/qwen3_dflash.py:
# decoder layers with q/k/v/o, q_norm/k_norm, gate/up/down and two layer norms, the loader stacking
# q/k/v and gate/up, :403-409; ``fc`` over the concatenated target states, len(target_layer_ids) x
# hidden -> hidden, :476-487; ``hidden_norm`` and ``norm``) plus, in qwen3_dflash2.py, two grouped
# convolutions a layer (``attention_conv``, ``mlp_conv``, :260-265: DFlashGroupedConv, :170-203, a
# ``base_kernel`` [2, taps, hidden] in the model dtype and a ``kernel_projection`` hidden ->
# 2 x taps x hidden / group built with the quantization config) and a ``candidate_selector``
# (:314-340, :382-389: ``predecessor_codebook`` and ``successor_codebook`` [vocab, rank] and a
# ``hidden_projection`` hidden -> rank built with quant_config=None, :337: a plain bf16 ``weight``,
# whatever the quantization config's ``ignore`` says). Its embedding and lm_head are the target's:
# load_weights drops ``embed_tokens`` when the checkpoint has none (qwen3_dflash.py:883-884), the
# lm_head is shared unless the checkpoint ships one (has_own_lm_head, models/utils.py:1195-1198;
# v1/worker/gpu/spec_decode/dflash/utils.py:62-73), and the embedding through
# maybe_share_target_embed (v1/worker/gpu/spec_decode/eagle/utils.py:45-77; the class declares
# has_own_embed_tokens through SupportsEagle, models/interfaces.py:1549, so vLLM shares under PP
# too; Qwen3.5 keeps embed_tokens on every rank, models/qwen3_5.py:251). Checkpoint names carry no
# "model." prefix: load_weights adds it to everything but lm_head (qwen3_dflash.py:866-867). The
# reference says ``is_causal: false``, which decides every layer (:62-66): the drafter attends
# non-causally, so vLLM picks a non-causal-capable backend for it (spec_decode/dflash/utils.py:26-33,
# dflash/speculator.py:71-75); its window is the top-level ``sliding_window`` (the reference has no
# dflash_config.swa_window_size, :146-149).
#
# W4A16 on SM 9.0: compressed-tensors' group-128 symmetric int4 is CompressedTensorsWNA16
# (model_executor/layers/quantization/compressed_tensors/schemes/compressed_tensors_wNa16.py:
# weight_packed int32 [out, in/8], weight_scale in the model dtype [out, in/128], weight_shape int64
# [2], :177-240; type uint4b8, :44). Its kernel is the first of
# model_executor/kernels/linear/__init__.py:540-548 that can implement it: CutlassW4A8 takes FP8
# activations only (mixed_precision/cutlass.py:39), Machete takes SM 9.0 exactly
# (mixed_precision/machete.py:24-54: uint4b8, group 128 with bf16 activations, in % 64 and out %
# 128, every layer here), an op of vLLM's compiled _C (_custom_ops.py:1357-1362), nothing built on
# first use. The H200 runs stock and the plugin's last rank (the drafter's); rank 0 (SM 8.9) holds
# no drafter.
DFLASH_FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "dflash2_drafter.json"
# The target: spec-hybrid with its layer kinds written out (mtp_tensors reads them), seeded weights.
DFLASH_TARGET = {**SPEC_HYBRID, "layer_types": [
    "full_attention" if (i + 1) % SPEC_HYBRID["full_attention_interval"] == 0 else "linear_attention"
    for i in range(SPEC_HYBRID["num_hidden_layers"])]}
PRESETS["dflash-hybrid"] = lambda: dict(DFLASH_TARGET)
# The reference's 5 ids on 64 layers, [5, 19, 33, 47, 61]: the last L - 3, evenly spaced. On 8
# layers that is 1..5. vLLM reads them as aux layers id + 1
# (v1/worker/gpu/spec_decode/eagle/eagle3_utils.py:121-124): [2, 3, 4, 5, 6]; with the 4/4 split
# rank 0 captures 2, 3 and 4 (4 is its last layer's output) and relays them to rank 1 (its slots:
# bisect_right(aux, 4) = 3, models/interfaces.py:1633-1636), rank 1 captures 5 and 6.
DFLASH_TARGET_LAYER_IDS = [1, 2, 3, 4, 5]
DFLASH_SPLIT = [4, 4]
# Inside the vocabulary and above every prompt id of gpu_runs.spec_prompts (3..8002), as the
# reference's 248070 is a reserved id near the end of its 248320.
DFLASH_MASK_TOKEN_ID = 8100
# The reference's window (2048) is 1/128 of its context; here 1024: shorter than the long prompt
# (1500 tokens), so the drafter's sliding window is exercised, and half of max_model_len (2048).
DFLASH_WINDOW = 1024
# The selector's rank and candidates per draft position: the reference's 256 and 16 (for a
# vocabulary of 248,320) scaled down; vLLM reads both with int() and checks neither.
DFLASH_SELECTOR_RANK, DFLASH_SELECTOR_TOP_K = 32, 8
DFLASH_DRAFTER_CLASS = "vllm.model_executor.models.qwen3_dflash2.DFlash2Qwen3ForCausalLM"
W4_BITS, W4_GROUP = 4, 128
W4_OFFSET = 1 << (W4_BITS - 1)  # uint4b8: stored value = q + 8


def dflash_drafter_config(target: dict = DFLASH_TARGET) -> dict:
    """The reference drafter's config.json scaled to ``target``: its width, heads, MLP and
    vocabulary, the window, layer ids, mask token and selector size above; as the reference: 5
    non-causal sliding-attention layers, the convolutions (2 taps, groups of 16), the draft block
    (8 = 1 + 7 draft tokens) and the W4A16 quantization_config (group 128, symmetric, lm_head ignored)."""
    ref = json.loads(DFLASH_FIXTURE.read_text())
    cfg = {**ref, **{k: target[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads",
                                            "num_key_value_heads", "head_dim", "vocab_size", "rms_norm_eps",
                                            "max_position_embeddings", "torch_dtype")}}
    cfg.update(num_target_layers=target["num_hidden_layers"], sliding_window=DFLASH_WINDOW)
    cfg["dflash_config"] = {**ref["dflash_config"], "target_layer_ids": list(DFLASH_TARGET_LAYER_IDS),
                            "mask_token_id": DFLASH_MASK_TOKEN_ID, "selector_rank": DFLASH_SELECTOR_RANK,
                            "selector_top_k": DFLASH_SELECTOR_TOP_K}
    return cfg


def dflash_linear_shapes(cfg: dict) -> dict[str, tuple[int, int]]:
    """[out, in] of every quantized linear layer of the drafter (the decoder layers', the
    convolutions' kernel projections, ``fc``), by checkpoint name (without ``.weight``)."""
    h, inter, hd = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    dfl = cfg["dflash_config"]
    conv = (2 * dfl["conv_kernel_size"] * (h // dfl["conv_group_size"]), h)
    per_layer = {"self_attn.q_proj": (q, h), "self_attn.k_proj": (kv, h), "self_attn.v_proj": (kv, h),
                 "self_attn.o_proj": (h, q), "mlp.gate_proj": (inter, h), "mlp.up_proj": (inter, h),
                 "mlp.down_proj": (h, inter), "attention_conv.kernel_projection": conv,
                 "mlp_conv.kernel_projection": conv}
    shapes = {f"layers.{i}.{n}": s for i in range(cfg["num_hidden_layers"]) for n, s in per_layer.items()}
    shapes["fc"] = (h, len(dfl["target_layer_ids"]) * h)
    return shapes


def dflash2_dense_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    """The drafter's bf16 tensors beyond the norms, by checkpoint name: each convolution's
    ``base_kernel`` [2, taps, hidden], the selector's codebooks [vocab, rank] and its
    ``hidden_projection`` [rank, hidden] (vLLM builds it unquantized)."""
    h, dfl = cfg["hidden_size"], cfg["dflash_config"]
    rank = dfl["selector_rank"]
    shapes = {f"layers.{i}.{conv}.base_kernel": (2, dfl["conv_kernel_size"], h)
              for i in range(cfg["num_hidden_layers"]) for conv in ("attention_conv", "mlp_conv")}
    shapes.update({"candidate_selector.predecessor_codebook": (cfg["vocab_size"], rank),
                   "candidate_selector.successor_codebook": (cfg["vocab_size"], rank),
                   "candidate_selector.hidden_projection.weight": (rank, h)})
    return shapes


def dflash_drafter_tensors(cfg: dict, seed: int) -> dict:
    """The drafter's dense bf16 weights by checkpoint name: matrices, base kernels and codebooks
    N(0, 0.05) as the random targets' (seeded), RMSNorm weights 1 (vLLM's RMSNorm multiplies by
    the weight)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    randn = lambda shape: (torch.randn(shape, generator=gen) * 0.05).to(torch.bfloat16)  # noqa: E731
    out = {f"{name}.weight": randn(shape) for name, shape in dflash_linear_shapes(cfg).items()}
    out.update({name: randn(shape) for name, shape in dflash2_dense_shapes(cfg).items()})
    ones = lambda n: torch.ones(n, dtype=torch.bfloat16)  # noqa: E731
    for i in range(cfg["num_hidden_layers"]):
        for norm in ("input_layernorm", "post_attention_layernorm"):
            out[f"layers.{i}.{norm}.weight"] = ones(cfg["hidden_size"])
        for norm in ("self_attn.q_norm", "self_attn.k_norm"):
            out[f"layers.{i}.{norm}.weight"] = ones(cfg["head_dim"])
    out["hidden_norm.weight"] = ones(cfg["hidden_size"])
    out["norm.weight"] = ones(cfg["hidden_size"])
    return out


def quantize_w4(w):
    """[out, in] -> (q int8 in [-8, 7], scale bf16 [out, in // 128]): symmetric per group of 128,
    scale = the group's absmax / 7 (rounded to bf16 first, so q * scale is what the kernel computes)."""
    import torch

    o, i = w.shape
    groups = w.float().reshape(o, i // W4_GROUP, W4_GROUP)
    scale = (groups.abs().amax(-1) / (W4_OFFSET - 1)).clamp_min(1e-8).to(torch.bfloat16)
    q = torch.round(groups / scale.float().unsqueeze(-1)).clamp(-W4_OFFSET, W4_OFFSET - 1)
    return q.to(torch.int8).reshape(o, i), scale


def write_dflash_drafter(out: Path, cfg: dict | None = None, seed: int = 1, packed: bool = True) -> Path:
    """The drafter folder: config.json and model.safetensors with seeded weights; ``packed``:
    every linear layer vLLM builds with the quantization config (the decoder layers', the kernel
    projections, ``fc``) as compressed-tensors W4A16 (``weight_packed``, ``weight_scale``,
    ``weight_shape``), the rest bf16 (norms, base kernels, the selector); else all bf16 and no
    quantization_config. No embedding and no lm_head: vLLM gives the drafter the target's."""
    import torch
    from safetensors.torch import save_file

    cfg = dict(cfg or dflash_drafter_config())
    out.mkdir(parents=True, exist_ok=True)
    dense = dflash_drafter_tensors(cfg, seed)
    linears = dflash_linear_shapes(cfg)
    tensors = {}
    for name, t in dense.items():
        base = name.removesuffix(".weight")
        if packed and base in linears:
            q, scale = quantize_w4(t)
            tensors[f"{base}.weight_packed"] = pack(q, W4_BITS)
            tensors[f"{base}.weight_scale"] = scale
            tensors[f"{base}.weight_shape"] = torch.tensor(list(t.shape), dtype=torch.int64)
        else:
            tensors[name] = t
    if not packed:
        cfg.pop("quantization_config", None)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg, indent=1))  # last: the folder is complete
    return out


def write_dflash_models(out: Path, seed: int = 0) -> dict[str, Path]:
    """OUT/target (dflash-hybrid, seeded weights and a tokenizer) and OUT/drafter (DFlash2, W4A16);
    written once (a complete drafter folder is reused)."""
    dirs = {"target": out / "target", "drafter": out / "drafter"}
    if not (dirs["target"] / "config.json").exists():
        write_model("dflash-hybrid", dirs["target"], "random", seed)
    if not (dirs["drafter"] / "config.json").exists():
        write_dflash_drafter(dirs["drafter"], seed=seed + 1)
    return dirs
