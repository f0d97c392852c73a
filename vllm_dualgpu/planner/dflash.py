"""What vLLM builds for a DFlash drafter beyond its decoder layers: the ``fc`` over the target's
states, and a DFlash2 drafter's convolutions and candidate selector.

``fc`` (``model_executor/models/qwen3_dflash.py``, ``DFlashQwen3Model``) is a linear
``len(target_layer_ids) x hidden -> hidden`` built with the checkpoint's quantization config,
followed by ``hidden_norm``: a W4A16 drafter holds it packed (67.6 MB for the reference drafter's,
262 MB in bf16).

vLLM (0.30-0.33) builds a ``DFlash2DraftModel`` checkpoint as
``model_executor/models/qwen3_dflash2.py:DFlash2Qwen3ForCausalLM`` and runs it with the V2
runner's ``DFlash2Speculator``. Besides the DFlash layers, ``fc`` and norms it holds:

- in every decoder layer two grouped convolutions (``attention_conv``, ``mlp_conv``:
  ``DFlashGroupedConv``), each a ``base_kernel`` of ``2 x taps x hidden`` in the model's dtype and
  a ``kernel_projection`` linear ``hidden -> 2 x taps x (hidden / group)`` built with the
  checkpoint's quantization config;
- a ``CandidateSelector``: ``predecessor_codebook`` and ``successor_codebook`` of
  ``vocab x rank`` and a ``hidden_projection`` ``hidden -> rank``, all in the model's dtype
  (vLLM builds the projection without the quantization config).

``taps`` is ``dflash_config.conv_kernel_size``, ``group`` ``conv_group_size``, ``rank``
``selector_rank``; ``selector_top_k`` candidates a draft position are scored. For the public
Qwen3.8-27B DFlash2 drafter (hidden 5,120, 5 layers, vocabulary 248,320, taps 2, group 16,
rank 256) that is 278 MiB in W4A16, most of it the two bf16 codebooks. Pure arithmetic.
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm_dualgpu.planner.errors import BadRequest
from vllm_dualgpu.planner.formats import FormatResolver, dense_format
from vllm_dualgpu.planner.hf_config import DecoderConfig

ARCHITECTURE = "DFlash2DraftModel"
SLIDING_KEYS = ("use_sliding_window", "sliding_window", "layer_types")
FIGURES = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")


@dataclass(frozen=True)
class DFlash2Extras:
    weight_bytes: int
    """The convolutions' and the selector's weights."""
    decode_read_bytes: int
    """Read by one draft pass: the convolutions and the selector's projection whole, the two
    codebooks' rows of the scored candidates."""


def resolver(cfg: dict, weight_format: str = "auto") -> tuple[DecoderConfig, FormatResolver]:
    """The drafter's shapes (its attention kind aside: a DFlash drafter's sliding layers are
    sized as its KV spec elsewhere) and the format of each of its modules."""
    dc = DecoderConfig.from_dict({k: v for k, v in cfg.items() if k not in SLIDING_KEYS})
    return dc, FormatResolver.from_config(dc.quantization_config, weight_format=weight_format, dtype=dc.dtype)


def fc_bytes(cfg: dict, num_features: int, weight_format: str = "auto") -> int:
    """``fc`` in the format the checkpoint stores it in, and ``hidden_norm``."""
    dc, res = resolver(cfg, weight_format)
    H = dc.hidden_size
    return res.fmt(("model.fc", "fc"), "mlp").linear_bytes(H, num_features * H) + H * (dense_format(dc.dtype).bits // 8)


def is_dflash2(cfg: dict) -> bool:
    text = cfg.get("text_config") or cfg
    return ARCHITECTURE in (cfg.get("architectures") or text.get("architectures") or [])


def dflash2_extras(cfg: dict, num_speculative_tokens: int, weight_format: str = "auto") -> DFlash2Extras | None:
    """The extras of the drafter whose ``config.json`` is ``cfg``; None unless it is a DFlash2
    drafter. Refused as vLLM refuses it: a missing figure (vLLM reads each with ``int(...)``), a
    group that does not divide the hidden size."""
    if not is_dflash2(cfg):
        return None
    dc, res = resolver(cfg, weight_format)
    dfl = dc.text.get("dflash_config") or {}
    missing = [k for k in FIGURES if not dfl.get(k)]
    if missing:
        raise BadRequest(f"drafter: a {ARCHITECTURE} needs dflash_config.{', dflash_config.'.join(missing)} in its "
                         "config.json (vLLM sizes its convolutions and candidate selector by them)")
    taps, group, rank, top_k = (int(dfl[k]) for k in FIGURES)
    H, V = dc.hidden_size, dc.vocab_size
    if H % group:
        raise BadRequest(f"drafter: conv_group_size={group} must divide hidden_size={H} (vLLM refuses it)")
    db = dense_format(dc.dtype).bits // 8
    convs = 0
    for i in range(dc.num_layers):
        for conv, category in (("attention_conv", "attention"), ("mlp_conv", "mlp")):
            names = tuple(f"{p}layers.{i}.{conv}.kernel_projection" for p in ("model.", ""))
            convs += 2 * taps * H * db + res.fmt(names, category).linear_bytes(2 * taps * (H // group), H)
    projection = rank * H * db
    codebooks = 2 * V * rank * db
    rows = num_speculative_tokens * top_k * 2 * rank * db
    return DFlash2Extras(weight_bytes=convs + projection + codebooks, decode_read_bytes=convs + projection + rows)
