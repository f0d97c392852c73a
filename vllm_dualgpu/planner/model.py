"""What a model costs in memory, read from its Hugging Face ``config.json``.

:class:`ModelSpec` holds, per decoder layer, its type (full attention or Gated DeltaNet linear
attention), its weight bytes and the bytes one decode step reads; plus the embedding (rank 0;
every rank for the Qwen3.5 / Qwen3-Next family), the output head (last rank), the vision tower
(rank 0) and the model's own MTP layers.
:class:`DrafterSpec` is a speculative-decoding drafter (MTP, EAGLE, DFlash, a draft model),
which vLLM places on the last pipeline rank. Parameter shapes follow vLLM 0.30's model code
(``qwen3.py``, ``qwen3_next.py``, ``qwen3_5.py``, ``qwen3_5_mtp.py``, ``qwen3_vl.py``,
``qwen3_dflash.py``); other dense decoders are sized with the same q/k/v/o + gate/up/down
shapes. Pure arithmetic: no vLLM, torch or CUDA import.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm_dualgpu.planner.dflash import SLIDING_KEYS, dflash2_extras, fc_bytes
from vllm_dualgpu.planner.errors import BadRequest, UnsupportedModel
from vllm_dualgpu.planner.formats import EMBEDDING_NAMES, FormatResolver, dense_format, embedding_bytes

from vllm_dualgpu.planner.hf_config import EMBED_ON_EVERY_RANK_TYPES, FULL, LINEAR, DecoderConfig, GdnDims  # noqa: F401 (re-exported)


@dataclass(frozen=True)
class LayerSpec:
    """One decoder layer: its type, the bytes its weights take and the bytes a decode step reads."""

    kind: str
    weight_bytes: int
    decode_read_bytes: int


@dataclass(frozen=True)
class ModelSpec:
    """A model's memory facts. Build it with :meth:`from_hf_config`."""

    name: str
    architecture: str
    model_type: str
    dtype: str
    layers: tuple[LayerSpec, ...]
    hidden_size: int
    vocab_size: int
    intermediate_size: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    tie_word_embeddings: bool
    embed_bytes: int
    lm_head_bytes: int
    final_norm_bytes: int
    linear: GdnDims | None = None
    mamba_ssm_dtype: str = "auto"
    vision_bytes: int = 0
    vision_hidden_size: int = 0
    vision_intermediate_size: int = 0
    vision_out_hidden_size: int = 0
    mtp_num_layers: int = 0
    mtp_layer_bytes: int = 0
    mtp_extra_bytes: int = 0
    mtp_decode_read_bytes: int = 0
    activation_width: int = 0
    weight_format: str = "bf16"
    quantization_method: str = "none"
    formats: dict = field(default_factory=dict, compare=False)

    def run_dtype(self, requested: str | None) -> str:
        """The dtype vLLM runs: ``requested`` (``--dtype``), or the config's for "auto" or None."""
        return requested if requested and requested != "auto" else self.dtype

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def layer_types(self) -> tuple[str, ...]:
        return tuple(layer.kind for layer in self.layers)

    @property
    def is_hybrid(self) -> bool:
        return any(layer.kind == LINEAR for layer in self.layers)

    @property
    def embedding_on_every_rank(self) -> bool:
        """vLLM builds this model's input embedding on every pipeline rank (hf_config)."""
        return self.model_type in EMBED_ON_EVERY_RANK_TYPES

    @property
    def has_vision(self) -> bool:
        return self.vision_bytes > 0

    @property
    def layer_weight_bytes(self) -> list[int]:
        return [layer.weight_bytes for layer in self.layers]

    def summary(self) -> str:
        n_lin = sum(1 for layer in self.layers if layer.kind == LINEAR)
        n_full = self.num_layers - n_lin
        kinds = f"{n_lin} Gated DeltaNet + {n_full} full attention" if n_lin else "dense attention"
        vis = ", vision tower" if self.has_vision else ""
        mtp = f", {self.mtp_num_layers} MTP layer(s)" if self.mtp_num_layers else ""
        return f"{self.name}: {self.num_layers} layers ({kinds}){vis}{mtp}, {self.weight_format} weights"

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "architecture": self.architecture,
            "model_type": self.model_type,
            "num_layers": self.num_layers,
            "layer_types": sorted(set(self.layer_types)),
            "num_linear_attention_layers": sum(1 for t in self.layer_types if t == LINEAR),
            "hidden_size": self.hidden_size,
            "vocab_size": self.vocab_size,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "max_position_embeddings": self.max_position_embeddings,
            "weight_format": self.weight_format,
            "decoder_weight_bytes": sum(self.layer_weight_bytes),
            "embed_bytes": self.embed_bytes,
            "lm_head_bytes": self.lm_head_bytes,
            "vision_bytes": self.vision_bytes,
            "mtp_num_layers": self.mtp_num_layers,
        }

    @classmethod
    def from_hf_config(
        cls,
        cfg: dict,
        *,
        weight_format: str = "auto",
        quantization: str | None = None,
        name: str | None = None,
    ) -> "ModelSpec":
        """Size a model from its ``config.json`` contents.

        ``weight_format="auto"`` reads ``quantization_config``; otherwise one format for every
        decoder linear layer (``"fp8"``, ``"int8"``, ``"nvfp4"``, ``"w4a16"``, ``"bf16"``) or per
        category (``"mlp=nvfp4,attention=fp8,linear_attention=fp8"``). ``quantization`` is vLLM's
        ``--quantization`` (online quantization of a 16-bit checkpoint).
        """
        dc = DecoderConfig.from_dict(cfg)
        if not dc.vocab_size:
            raise UnsupportedModel(f"{dc.architecture}: config.json has no 'vocab_size'; is this a decoder LLM config?")
        meta = cfg.get("_vllm_dualgpu") or {}
        name = name or meta.get("name") or cfg.get("_name_or_path") or dc.architecture
        res = FormatResolver.from_config(dc.quantization_config, weight_format=weight_format,
                                         quantization=quantization, dtype=dc.dtype)
        w = WeightCounter(dc, res)
        H, V, db = dc.hidden_size, dc.vocab_size, w.dense_bytes
        layers = [w.decoder_layer(i, kind) for i, kind in enumerate(dc.layer_types)]
        embed = embedding_bytes(res.fmt(EMBEDDING_NAMES, "embedding"), V, H, res.dense)
        lm_head = res.fmt(("lm_head",), "lm_head").linear_bytes(V, H)
        vision = w.vision_tower(cfg.get("vision_config") or {}) if dc.is_vl else VisionTower()
        mtp = w.mtp_layers(int(dc.text.get("mtp_num_hidden_layers") or 0))
        mamba_ssm_dtype = (str(dc.text.get("mamba_ssm_dtype") or "auto")
                           if dc.model_type.startswith("qwen3_5") else "auto")
        return cls(
            name=str(name),
            architecture=dc.architecture,
            model_type=dc.model_type,
            dtype=dc.dtype,
            layers=tuple(layers),
            hidden_size=H,
            vocab_size=V,
            intermediate_size=dc.intermediate_size,
            num_attention_heads=dc.num_heads,
            num_kv_heads=dc.num_kv_heads,
            head_dim=dc.head_dim,
            max_position_embeddings=_derived_max_len(dc.text),
            tie_word_embeddings=dc.tie_word_embeddings,
            embed_bytes=embed,
            lm_head_bytes=lm_head,
            final_norm_bytes=H * db,
            linear=dc.linear,
            mamba_ssm_dtype=mamba_ssm_dtype,
            vision_bytes=vision.weight_bytes,
            vision_hidden_size=vision.hidden_size,
            vision_intermediate_size=vision.intermediate_size,
            vision_out_hidden_size=vision.out_hidden_size,
            mtp_num_layers=mtp.num_layers,
            mtp_layer_bytes=mtp.layer_bytes,
            mtp_extra_bytes=mtp.extra_bytes,
            mtp_decode_read_bytes=mtp.decode_read_bytes,
            activation_width=w.activation_width(),
            weight_format=w.format_name(weight_format),
            quantization_method=res.method,
            formats=dict(w.used),
        )


@dataclass(frozen=True)
class VisionTower:
    weight_bytes: int = 0
    hidden_size: int = 0
    intermediate_size: int = 0
    out_hidden_size: int = 0


@dataclass(frozen=True)
class MtpLayers:
    """The model's own MTP layers (Qwen3-Next / Qwen3.5: a full-attention decoder layer each,
    plus an fc over [embedding, hidden] and three norms)."""

    num_layers: int = 0
    layer_bytes: int = 0
    extra_bytes: int = 0
    decode_read_bytes: int = 0


class WeightCounter:
    """Bytes of each module's weights in the formats the checkpoint stores them in; remembers
    how many parameters each format holds (the model's weight-format summary)."""

    def __init__(self, dc: DecoderConfig, res: FormatResolver):
        self.dc, self.res = dc, res
        self.dense_bytes = dense_format(dc.dtype).bits // 8
        self.used: dict[str, int] = {}
        self.prefixes = (
            ("model.language_model.layers.{i}", "language_model.model.layers.{i}", "model.layers.{i}")
            if dc.is_vl else ("model.layers.{i}", "model.language_model.layers.{i}")
        )

    def linear(self, names: tuple[str, ...], category: str, out_f: int, in_f: int) -> int:
        f = self.res.fmt(names, category)
        self.used[f.name] = self.used.get(f.name, 0) + out_f * in_f
        return f.linear_bytes(out_f, in_f)

    def names(self, i: int, suffixes: tuple[str, ...], prefixes=None) -> tuple[str, ...]:
        return tuple(p.format(i=i) + "." + s for p in (prefixes or self.prefixes) for s in suffixes)

    def attention(self, i: int, prefixes=None, category: str = "attention") -> int:
        dc, db = self.dc, self.dense_bytes
        H, nKV, hd = dc.hidden_size, dc.num_kv_heads, dc.head_dim
        qo = dc.num_heads * hd
        b = self.linear(self.names(i, ("self_attn.q_proj",), prefixes), category, qo * (2 if dc.attn_output_gate else 1), H)
        b += self.linear(self.names(i, ("self_attn.k_proj",), prefixes), category, nKV * hd, H)
        b += self.linear(self.names(i, ("self_attn.v_proj",), prefixes), category, nKV * hd, H)
        b += self.linear(self.names(i, ("self_attn.o_proj",), prefixes), category, H, qo)
        if dc.qk_norm:
            b += 2 * hd * db
        if dc.qkv_bias:
            b += (qo + 2 * nKV * hd) * db
        return b

    def gdn(self, i: int) -> int:
        g, H, db = self.dc.linear, self.dc.hidden_size, self.dense_bytes
        assert g is not None
        cat = "linear_attention"
        b = self.linear(self.names(i, ("linear_attn.in_proj_qkv", "linear_attn.in_proj_qkvz")), cat, g.conv_dim, H)
        b += self.linear(self.names(i, ("linear_attn.in_proj_z", "linear_attn.in_proj_qkvz")), cat, g.value_dim, H)
        b += self.linear(self.names(i, ("linear_attn.in_proj_b", "linear_attn.in_proj_ba")), cat, g.num_v_heads, H)
        b += self.linear(self.names(i, ("linear_attn.in_proj_a", "linear_attn.in_proj_ba")), cat, g.num_v_heads, H)
        b += self.linear(self.names(i, ("linear_attn.out_proj",)), cat, H, g.value_dim)
        b += g.conv_dim * g.conv_kernel * db  # conv1d
        b += g.num_v_heads * (4 + db)  # A_log (fp32), dt_bias
        b += g.v_head_dim * 4  # gated RMSNorm weight
        return b

    def mlp(self, i: int, prefixes=None, category: str = "mlp") -> tuple[int, int]:
        """(weight bytes, bytes one token reads)."""
        dc, H = self.dc, self.dc.hidden_size
        if not dc.is_moe_layer(i):
            I = dc.intermediate_size
            b = self.linear(self.names(i, ("mlp.gate_proj",), prefixes), category, I, H)
            b += self.linear(self.names(i, ("mlp.up_proj",), prefixes), category, I, H)
            b += self.linear(self.names(i, ("mlp.down_proj",), prefixes), category, H, I)
            return b, b
        moe_I, n, shared_I = dc.moe_intermediate_size, dc.num_experts, dc.shared_expert_intermediate_size
        ecat = category if category == "mtp" else "experts"
        e = self.linear(self.names(i, ("mlp.experts.0.gate_proj",), prefixes), ecat, moe_I, H)
        e += self.linear(self.names(i, ("mlp.experts.0.up_proj",), prefixes), ecat, moe_I, H)
        e += self.linear(self.names(i, ("mlp.experts.0.down_proj",), prefixes), ecat, H, moe_I)
        router = self.linear(self.names(i, ("mlp.gate",), prefixes), category, n, H)
        shared = 0
        if shared_I:
            shared = self.linear(self.names(i, ("mlp.shared_expert.gate_proj",), prefixes), category, shared_I, H)
            shared += self.linear(self.names(i, ("mlp.shared_expert.up_proj",), prefixes), category, shared_I, H)
            shared += self.linear(self.names(i, ("mlp.shared_expert.down_proj",), prefixes), category, H, shared_I)
            shared += H * self.dense_bytes  # shared_expert_gate
        total = e * n + router + shared
        read = e * min(dc.experts_per_token or n, n) + router + shared
        return total, read

    def decoder_layer(self, i: int, kind: str) -> LayerSpec:
        mixer = self.attention(i) if kind == FULL else self.gdn(i)
        mlp_w, mlp_r = self.mlp(i)
        norms = 2 * self.dc.hidden_size * self.dense_bytes
        return LayerSpec(kind, mixer + mlp_w + norms, mixer + mlp_r + norms)

    def vision_tower(self, vc: dict) -> VisionTower:
        """Qwen3-VL / Qwen3.5 layout; other families by the same shapes."""
        db = self.dense_bytes
        vis_h = int(vc.get("hidden_size") or vc.get("embed_dim") or 0)
        depth = int(vc.get("depth") or vc.get("num_hidden_layers") or 0)
        if not (vis_h and depth):
            return VisionTower()
        vis_i = int(vc.get("intermediate_size") or (vis_h * float(vc.get("mlp_ratio", 4))))
        vis_out = int(vc.get("out_hidden_size") or self.dc.hidden_size)
        merge = int(vc.get("spatial_merge_size") or 2)
        patch = int(vc.get("patch_size") or 14)
        tps = int(vc.get("temporal_patch_size") or 2)
        chans = int(vc.get("in_channels") or 3)
        vpfx = ("model.visual.blocks.{i}", "visual.blocks.{i}")

        def vlin(s: str, o: int, n: int) -> int:
            return self.linear(self.names(0, (s,), vpfx), "vision", o, n)

        block = (
            vlin("attn.qkv", 3 * vis_h, vis_h)
            + vlin("attn.proj", vis_h, vis_h)
            + vlin("mlp.linear_fc1", vis_i, vis_h)
            + vlin("mlp.linear_fc2", vis_h, vis_i)
            + (3 * vis_h + vis_h + vis_i + vis_h + 4 * vis_h) * db  # biases, 2 norms
        )
        mh = vis_h * merge * merge
        merger = (mh * mh + mh * vis_out + 2 * mh + vis_out) * db
        n_deep = len(vc.get("deepstack_visual_indexes") or [])
        total = (
            depth * block
            + (chans * tps * patch * patch * vis_h + vis_h) * db
            + int(vc.get("num_position_embeddings") or 0) * vis_h * db
            + merger * (1 + n_deep)
        )
        return VisionTower(total, vis_h, vis_i, vis_out)

    def mtp_layers(self, n: int) -> MtpLayers:
        if not n:
            return MtpLayers()
        H, db = self.dc.hidden_size, self.dense_bytes
        mpfx = ("mtp.layers.{i}",)
        layer = self.attention(0, mpfx, "mtp")
        w, r = self.mlp(0, mpfx, "mtp")
        layer_read = layer + r + 2 * H * db
        layer += w + 2 * H * db
        extra = self.linear(("mtp.fc",), "mtp", H, 2 * H) + 3 * H * db
        return MtpLayers(n, layer, extra, layer_read + extra)

    def activation_width(self) -> int:
        """Widest per-token intermediate a layer produces (for the activation estimate)."""
        dc = self.dc
        widths = [dc.num_heads * dc.head_dim * (2 if dc.attn_output_gate else 1) + 2 * dc.num_kv_heads * dc.head_dim,
                  dc.intermediate_size]
        if dc.num_experts:
            widths.append(dc.experts_per_token * dc.moe_intermediate_size + dc.shared_expert_intermediate_size)
        if dc.linear is not None:
            widths.append(2 * dc.linear.conv_dim + 2 * dc.linear.value_dim)
        return max(widths)

    def format_name(self, weight_format: str) -> str:
        if weight_format != "auto":
            return self.res.describe()
        total = sum(self.used.values()) or 1
        mix = sorted(self.used.items(), key=lambda kv: -kv[1])
        return mix[0][0] if len(mix) == 1 or mix[0][1] / total > 0.97 else "+".join(k for k, _ in mix)


def _derived_max_len(text: dict) -> int:
    """vLLM's derived max_model_len: max_position_embeddings times a non-YaRN RoPE factor."""
    keys = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "max_sequence_length")
    vals = [int(text[k]) for k in keys if isinstance(text.get(k), (int, float)) and text.get(k)]
    base = min(vals) if vals else 2048
    rp = text.get("rope_parameters") or text.get("rope_scaling") or {}
    if isinstance(rp, dict):
        rtype = rp.get("rope_type") or rp.get("type") or "default"
        if rtype not in ("default", "su", "longrope", "llama3", "yarn", "deepseek_yarn", "deepseek_llama_scaling", "mrope"):
            factor = rp.get("factor") or 1.0
            base = int(base * float(factor))
    return base


@dataclass(frozen=True)
class DrafterSpec:
    """A speculative-decoding drafter as far as memory goes. It lives on the last pipeline rank.

    ``kv_layers`` attention layers of ``kv_heads x head_dim`` each (K and V) go into the KV cache
    next to the target's layers; ``passes`` is how many drafter forward passes one decode step
    runs (``num_speculative_tokens`` for MTP/EAGLE, one for DFlash).
    """

    method: str
    num_speculative_tokens: int
    kv_layers: int = 0
    kv_heads: int = 0
    head_dim: int = 0
    kv_cache_dtype: str | None = None
    weight_bytes: int = 0
    embed_bytes: int = 0
    lm_head_bytes: int = 0
    decode_read_bytes: int = 0
    passes: int = 1
    name: str = ""
    sliding_window: int = 0
    """Sliding-window attention in every drafter layer (DFlash drafters whose ``layer_types``
    say ``sliding_attention``, or ``dflash_config.use_swa``): its window; 0 = full attention."""
    aux_layers: tuple[int, ...] = ()
    """The target layers whose hidden states the drafter reads (EAGLE3, DFlash), as vLLM 0.33 names
    them (``eagle3_utils.get_eagle3_aux_layers_from_config``: DFlash's ``target_layer_ids`` + 1).
    Under PP a later stage receives those of the layers before it as extra tensors."""

    def to_dict(self) -> dict:
        return {
            "method": self.method,
            "num_speculative_tokens": self.num_speculative_tokens,
            "kv_layers": self.kv_layers,
            "sliding_window": self.sliding_window,
            "weight_bytes": self.weight_bytes,
            "embed_bytes": self.embed_bytes,
            "lm_head_bytes": self.lm_head_bytes,
        }

    @classmethod
    def from_speculative(cls, spec: dict | None, target: ModelSpec) -> "DrafterSpec | None":
        """Build from a ``--speculative-config`` dict.

        Keys read: ``method``, ``num_speculative_tokens``, ``kv_cache_dtype``, and for drafters
        with their own checkpoint ``draft_config`` (or ``draft_hf_config``: the drafter's
        ``config.json`` contents; the CLI loads it from ``model``) plus an optional
        ``draft_weight_format``.
        """
        if not spec:
            return None
        method = str(spec.get("method") or ("draft_model" if spec.get("model") else "")).lower()
        k = int(spec.get("num_speculative_tokens") or 0)
        if k < 1:
            raise BadRequest("--speculative-config needs num_speculative_tokens >= 1")
        kv_dtype = spec.get("kv_cache_dtype")
        if method in ("ngram", "ngram_gpu", "suffix", "none"):
            return cls(method, k, name=method)
        if method in ("mtp",) or method.endswith("_mtp"):
            if not target.mtp_num_layers:
                raise BadRequest(f"{target.name} has no MTP layers (mtp_num_hidden_layers); pick another method")
            return cls(
                "mtp",
                k,
                kv_layers=target.mtp_num_layers,
                kv_heads=target.num_kv_heads,
                head_dim=target.head_dim,
                kv_cache_dtype=kv_dtype,
                weight_bytes=target.mtp_num_layers * target.mtp_layer_bytes + target.mtp_extra_bytes,
                embed_bytes=target.embed_bytes,
                lm_head_bytes=0,
                decode_read_bytes=target.mtp_decode_read_bytes + target.lm_head_bytes,
                passes=k,
                name=f"{target.mtp_num_layers} MTP layer(s)",
            )
        dcfg = spec.get("draft_config") or spec.get("draft_hf_config")
        if not dcfg:
            raise BadRequest(
                f"speculative method {method or '?'!r} needs the drafter's config.json: give a local "
                "drafter directory as 'model' in --speculative-config"
            )
        text = dcfg.get("text_config") or dcfg
        draft_format = str(spec.get("draft_weight_format") or "auto")
        window = dflash_sliding_window(text) if "dflash" in method else 0
        if window:  # sized below as the drafter's KV spec; the layers' weights are the same
            dcfg = {k: v for k, v in dcfg.items() if k not in SLIDING_KEYS}
        try:
            d = ModelSpec.from_hf_config(dcfg, weight_format=draft_format)
        except UnsupportedModel as e:
            raise UnsupportedModel(f"drafter: {e}") from None
        if d.is_hybrid:
            raise UnsupportedModel("drafter: linear-attention drafters are not sized by the planner yet")
        H = d.hidden_size
        db = dense_format(d.dtype).bits // 8
        extras = None
        if "dflash" in method:
            dfl = text.get("dflash_config") or {}
            n_feat = len(dfl.get("target_layer_ids") or text.get("target_layer_ids") or []) or d.num_layers
            fc = fc_bytes(dcfg, n_feat, draft_format)
            extras = dflash2_extras(dcfg, k, draft_format)  # None unless a DFlash2 drafter
            passes = 1
        elif "eagle3" in method:
            fc = 3 * H * H * db
            passes = k
        elif "eagle" in method:
            fc = 2 * H * H * db
            passes = k
        else:  # an independent draft model: its own head too
            fc = 0
            passes = k
        own_head = 0
        if text.get("draft_vocab_size"):
            own_head = int(text["draft_vocab_size"]) * H * db
        elif method in ("draft_model",):
            own_head = d.lm_head_bytes
        aux: tuple[int, ...] = ()
        if text.get("eagle_aux_hidden_state_layer_ids"):
            aux = tuple(int(i) for i in text["eagle_aux_hidden_state_layer_ids"])
        elif "dflash" in method and (dfl.get("target_layer_ids") or text.get("target_layer_ids")):
            aux = tuple(int(i) + 1 for i in (dfl.get("target_layer_ids") or text.get("target_layer_ids")))
        elif "eagle3" in method:  # vLLM's default for EAGLE3 (the target's get_eagle3_aux_hidden_state_layers)
            L = target.num_layers
            aux = (2, L // 2, L - 3)
        weights = sum(d.layer_weight_bytes) + fc + d.final_norm_bytes
        head_read = own_head or target.lm_head_bytes
        read = sum(layer.decode_read_bytes for layer in d.layers) + fc + head_read
        if extras:
            weights += extras.weight_bytes
            read += extras.decode_read_bytes
        return cls(
            method or "draft_model",
            k,
            kv_layers=d.num_layers,
            kv_heads=d.num_kv_heads,
            head_dim=d.head_dim,
            kv_cache_dtype=kv_dtype,
            weight_bytes=weights,
            embed_bytes=target.vocab_size * H * db,
            lm_head_bytes=own_head,
            decode_read_bytes=read,
            passes=passes,
            name=f"{'DFlash2' if extras else method} drafter ({d.num_layers} layers, {d.weight_format}"
                 + (f", sliding window {window:,}" if window else "") + ")",
            sliding_window=window,
            aux_layers=tuple(sorted(set(aux))),
        )


def dflash_sliding_window(text: dict) -> int:
    """The sliding window of a DFlash drafter's layers as vLLM resolves it
    (``qwen3_dflash._resolve_layer_attention``): ``layer_types`` naming ``sliding_attention``
    (or ``dflash_config.use_swa`` without ``layer_types``/with none sliding) make a layer
    sliding, with ``dflash_config.swa_window_size`` or the config's ``sliding_window``; 0 when
    every layer attends the whole context."""
    dfl = text.get("dflash_config") or {}
    types = text.get("layer_types")
    use_swa = bool(dfl.get("use_swa", False))
    n = int(text.get("num_hidden_layers") or 0)
    if types is not None:
        sliding = [t == "sliding_attention" for t in types[:n] or types]
        if use_swa and not any(sliding):
            sliding = [True] * len(sliding)
    else:
        sliding = [use_swa] * max(n, 1)
    if not any(sliding):
        return 0
    if not all(sliding):
        raise UnsupportedModel("drafter: DFlash drafters with both sliding-window and full-attention "
                               "layers are not sized by the planner yet")
    window = dfl.get("swa_window_size", text.get("sliding_window"))
    if not window:
        raise BadRequest("drafter: DFlash sliding attention needs a window size "
                         "(dflash_config.swa_window_size or sliding_window in its config.json)")
    return int(window)


__all__ = ["DrafterSpec", "FULL", "GdnDims", "LINEAR", "LayerSpec", "ModelSpec"]
