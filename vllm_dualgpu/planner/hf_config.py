"""The decoder facts of a Hugging Face ``config.json``, read once for every user.

The planner (:class:`vllm_dualgpu.planner.ModelSpec`) and the FP8 tuner
(:func:`vllm_dualgpu.kernels.fp8_tuner.model_weight_shapes`) both read a model's layer types,
attention shapes, output gate, Gated DeltaNet dimensions and experts from here, so they cannot
disagree about a model. Pure: no vLLM, torch or CUDA import.
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm_dualgpu.planner.errors import BadRequest, UnsupportedModel

FULL = "full_attention"
LINEAR = "linear_attention"

HYBRID_TYPES = ("qwen3_next", "qwen3_5_text", "qwen3_5", "qwen3_5_moe_text", "qwen3_5_moe", "qwen4_exp_text")
"""Model types of the Qwen3-Next / Qwen3.5 family: Gated DeltaNet layers, gated attention output."""
EMBED_ON_EVERY_RANK_TYPES = HYBRID_TYPES
"""Model types whose vLLM model builds the input embedding on every pipeline rank, not only the
first: ``Qwen3NextModel.__init__`` (``qwen3_next.py``, vLLM 0.30-0.33; ``Qwen3_5Model`` inherits
it) and Qwen4Exp's model create ``embed_tokens`` without a first-rank test. Seen on GPUs: the
last rank of a 64-layer Qwen3.5 loaded 2.4 GiB more than a plan with the table on rank 0 only."""
QK_NORM_TYPES = ("qwen3", "qwen3_moe", "qwen3_next", "qwen3_5_text", "qwen3_5_moe_text", "qwen3_vl_text",
                 "qwen3_vl_moe_text")
QKV_BIAS_TYPES = ("qwen2", "qwen2_vl_text", "qwen2_5_vl_text", "qwen2_moe")


@dataclass(frozen=True)
class GdnDims:
    """Gated DeltaNet (``linear_attention``) dimensions, as in ``qwen_gdn_linear_attn.py``."""

    num_k_heads: int
    num_v_heads: int
    k_head_dim: int
    v_head_dim: int
    conv_kernel: int

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.k_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.v_head_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim


@dataclass(frozen=True)
class DecoderConfig:
    """A decoder LLM's shapes from ``config.json`` (a VLM's ``text_config`` when it has one)."""

    raw: dict
    text: dict
    """The decoder's section (``text_config`` of a VLM, with the top level's dtype and tying)."""
    is_vl: bool
    architecture: str
    model_type: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    """0 when the config names none (the FP8 tuner needs none; the planner refuses it)."""
    dtype: str
    tie_word_embeddings: bool
    layer_types: tuple[str, ...]
    linear: GdnDims | None
    attn_output_gate: bool
    qkv_bias: bool
    qk_norm: bool
    intermediate_size: int
    num_experts: int
    moe_intermediate_size: int
    experts_per_token: int
    shared_expert_intermediate_size: int
    decoder_sparse_step: int
    mlp_only_layers: frozenset[int]

    @property
    def hybrid_family(self) -> bool:
        return self.model_type in HYBRID_TYPES

    @property
    def quantization_config(self) -> dict | None:
        q = self.raw.get("quantization_config") or self.text.get("quantization_config")
        return q if isinstance(q, dict) else None

    def is_moe_layer(self, i: int) -> bool:
        """Whether decoder layer ``i`` has routed experts (vLLM's Qwen2/3-MoE rule)."""
        return self.num_experts > 0 and i not in self.mlp_only_layers and (i + 1) % self.decoder_sparse_step == 0

    def layers_of(self, kind: str) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == kind]

    @classmethod
    def from_dict(cls, cfg: dict) -> DecoderConfig:
        if not isinstance(cfg, dict):
            raise BadRequest("the model config must be a dict (the contents of config.json)")
        text = dict(cfg.get("text_config") or {})
        is_vl = bool(text)
        if not text:
            text = cfg
        else:
            for k in ("tie_word_embeddings", "torch_dtype", "dtype"):
                if k in cfg and k not in text:
                    text[k] = cfg[k]
        arch = (cfg.get("architectures") or text.get("architectures") or ["?"])[0]
        mt = str(text.get("model_type") or cfg.get("model_type") or "?")
        if text.get("kv_lora_rank") or text.get("q_lora_rank"):
            raise UnsupportedModel(f"{arch}: MLA attention (kv_lora_rank) is not sized by the planner yet")
        for key in ("hidden_size", "num_hidden_layers", "num_attention_heads"):
            if not text.get(key):
                raise UnsupportedModel(f"{arch}: config.json has no {key!r}; is this a decoder LLM config?")
        H = int(text["hidden_size"])
        L = int(text["num_hidden_layers"])
        nH = int(text["num_attention_heads"])
        dtype = str(text.get("dtype") or text.get("torch_dtype") or cfg.get("dtype") or "bfloat16")
        if dtype in ("float32", "float"):
            dtype = "bfloat16"  # vLLM serves float32 checkpoints in 16-bit by default
        layer_types = _layer_types(text, arch, L)
        _refuse_sliding_window(text, arch, mt)
        hybrid = mt in HYBRID_TYPES
        return cls(
            raw=cfg,
            text=text,
            is_vl=is_vl,
            architecture=arch,
            model_type=mt,
            hidden_size=H,
            num_layers=L,
            num_heads=nH,
            num_kv_heads=int(text.get("num_key_value_heads") or nH),
            head_dim=int(text.get("head_dim") or H // nH),
            vocab_size=int(text.get("vocab_size") or 0),
            dtype=dtype,
            tie_word_embeddings=bool(text.get("tie_word_embeddings", cfg.get("tie_word_embeddings", False))),
            layer_types=layer_types,
            linear=_gdn_dims(text, arch) if LINEAR in layer_types else None,
            attn_output_gate=bool(text.get("attn_output_gate", hybrid)),
            qkv_bias=bool(text.get("attention_bias", text.get("qkv_bias", mt in QKV_BIAS_TYPES))),
            qk_norm=mt in QK_NORM_TYPES or hybrid,
            intermediate_size=int(text.get("intermediate_size") or 0),
            num_experts=int(text.get("num_experts") or text.get("num_local_experts") or text.get("n_routed_experts") or 0),
            moe_intermediate_size=int(text.get("moe_intermediate_size") or 0),
            experts_per_token=int(text.get("num_experts_per_tok") or 0),
            shared_expert_intermediate_size=int(text.get("shared_expert_intermediate_size") or 0),
            decoder_sparse_step=int(text.get("decoder_sparse_step") or 1),
            mlp_only_layers=frozenset(int(i) for i in (text.get("mlp_only_layers") or [])),
        )


def _layer_types(text: dict, arch: str, num_layers: int) -> tuple[str, ...]:
    layer_types = list(text.get("layer_types") or [])
    if not layer_types:
        interval = text.get("full_attention_interval")
        if interval and text.get("linear_num_value_heads"):
            layer_types = [FULL if (i + 1) % int(interval) == 0 else LINEAR for i in range(num_layers)]
        else:
            layer_types = [FULL] * num_layers
    if len(layer_types) != num_layers:
        raise UnsupportedModel(f"{arch}: layer_types has {len(layer_types)} entries for {num_layers} layers")
    unknown = sorted(set(layer_types) - {FULL, LINEAR})
    if unknown:
        raise UnsupportedModel(
            f"{arch}: layer types {unknown} are not sized by the planner yet (it handles full "
            "attention and Gated DeltaNet linear attention)"
        )
    return tuple(layer_types)


def _refuse_sliding_window(text: dict, arch: str, model_type: str) -> None:
    if text.get("use_sliding_window") and text.get("sliding_window"):
        raise UnsupportedModel(f"{arch}: sliding-window attention is not sized by the planner yet")
    if "use_sliding_window" not in text and text.get("sliding_window") and model_type not in HYBRID_TYPES:
        if not str(model_type).startswith("qwen"):
            raise UnsupportedModel(f"{arch}: sliding-window attention is not sized by the planner yet")


def _gdn_dims(text: dict, arch: str) -> GdnDims:
    try:
        return GdnDims(
            int(text["linear_num_key_heads"]),
            int(text["linear_num_value_heads"]),
            int(text["linear_key_head_dim"]),
            int(text["linear_value_head_dim"]),
            int(text.get("linear_conv_kernel_dim", 4)),
        )
    except KeyError as e:
        raise UnsupportedModel(f"{arch}: linear_attention layers but no {e.args[0]!r} in config") from None
