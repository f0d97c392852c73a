"""What a model costs in memory, read from its Hugging Face ``config.json``.

:class:`ModelSpec` holds, per decoder layer, its type (full attention or Gated DeltaNet linear
attention), its weight bytes and the bytes one decode step reads; plus the embedding (rank 0),
the output head (last rank), the vision tower (rank 0) and the model's own MTP layers.
:class:`DrafterSpec` is a speculative-decoding drafter (MTP, EAGLE, DFlash, a draft model),
which vLLM places on the last pipeline rank. Parameter shapes follow vLLM 0.30's model code
(``qwen3.py``, ``qwen3_next.py``, ``qwen3_5.py``, ``qwen3_5_mtp.py``, ``qwen3_vl.py``,
``qwen3_dflash.py``); other dense decoders are sized with the same q/k/v/o + gate/up/down
shapes. Pure arithmetic: no vLLM, torch or CUDA import.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm_dualgpu.planner.errors import BadRequest, UnsupportedModel
from vllm_dualgpu.planner.formats import FormatResolver, dense_format

from vllm_dualgpu.planner.hf_config import FULL, LINEAR, DecoderConfig, GdnDims  # noqa: F401 (re-exported)


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
        text, is_vl, arch, mt = dc.text, dc.is_vl, dc.architecture, dc.model_type
        meta = cfg.get("_vllm_dualgpu") or {}
        name = name or meta.get("name") or cfg.get("_name_or_path") or arch
        H, L, nH, nKV, hd, V = dc.hidden_size, dc.num_layers, dc.num_heads, dc.num_kv_heads, dc.head_dim, dc.vocab_size
        dtype, tie, layer_types, linear = dc.dtype, dc.tie_word_embeddings, list(dc.layer_types), dc.linear

        res = FormatResolver.from_config(dc.quantization_config, weight_format=weight_format, quantization=quantization, dtype=dtype)
        dense = dense_format(dtype)
        db = dense.bits // 8

        if is_vl:
            prefixes = ("model.language_model.layers.{i}", "language_model.model.layers.{i}", "model.layers.{i}")
        else:
            prefixes = ("model.layers.{i}", "model.language_model.layers.{i}")

        gate, qkv_bias, qk_norm, I = dc.attn_output_gate, dc.qkv_bias, dc.qk_norm, dc.intermediate_size
        num_experts, moe_I, top_k = dc.num_experts, dc.moe_intermediate_size, dc.experts_per_token
        shared_I, is_moe_layer = dc.shared_expert_intermediate_size, dc.is_moe_layer

        used: dict[str, int] = {}

        def linear_bytes(names: tuple[str, ...], category: str, out_f: int, in_f: int) -> int:
            f = res.fmt(names, category)
            used[f.name] = used.get(f.name, 0) + out_f * in_f
            return f.linear_bytes(out_f, in_f)

        def names_for(i: int, suffixes: tuple[str, ...], pfx=prefixes) -> tuple[str, ...]:
            return tuple(p.format(i=i) + "." + s for p in pfx for s in suffixes)

        def attention_bytes(i: int, pfx=prefixes, category="attention") -> int:
            qo = nH * hd
            b = linear_bytes(names_for(i, ("self_attn.q_proj",), pfx), category, qo * (2 if gate else 1), H)
            b += linear_bytes(names_for(i, ("self_attn.k_proj",), pfx), category, nKV * hd, H)
            b += linear_bytes(names_for(i, ("self_attn.v_proj",), pfx), category, nKV * hd, H)
            b += linear_bytes(names_for(i, ("self_attn.o_proj",), pfx), category, H, qo)
            if qk_norm:
                b += 2 * hd * db
            if qkv_bias:
                b += (qo + 2 * nKV * hd) * db
            return b

        def gdn_bytes(i: int) -> int:
            g = linear
            assert g is not None
            b = linear_bytes(names_for(i, ("linear_attn.in_proj_qkv", "linear_attn.in_proj_qkvz")), "linear_attention", g.conv_dim, H)
            b += linear_bytes(names_for(i, ("linear_attn.in_proj_z", "linear_attn.in_proj_qkvz")), "linear_attention", g.value_dim, H)
            b += linear_bytes(names_for(i, ("linear_attn.in_proj_b", "linear_attn.in_proj_ba")), "linear_attention", g.num_v_heads, H)
            b += linear_bytes(names_for(i, ("linear_attn.in_proj_a", "linear_attn.in_proj_ba")), "linear_attention", g.num_v_heads, H)
            b += linear_bytes(names_for(i, ("linear_attn.out_proj",)), "linear_attention", H, g.value_dim)
            b += g.conv_dim * g.conv_kernel * db  # conv1d
            b += g.num_v_heads * (4 + db)  # A_log (fp32), dt_bias
            b += g.v_head_dim * 4  # gated RMSNorm weight
            return b

        def mlp_bytes(i: int, pfx=prefixes, category="mlp") -> tuple[int, int]:
            """(weight bytes, bytes one token reads)."""
            if not is_moe_layer(i):
                b = linear_bytes(names_for(i, ("mlp.gate_proj",), pfx), category, I, H)
                b += linear_bytes(names_for(i, ("mlp.up_proj",), pfx), category, I, H)
                b += linear_bytes(names_for(i, ("mlp.down_proj",), pfx), category, H, I)
                return b, b
            ecat = category if category == "mtp" else "experts"
            e = linear_bytes(names_for(i, ("mlp.experts.0.gate_proj",), pfx), ecat, moe_I, H)
            e += linear_bytes(names_for(i, ("mlp.experts.0.up_proj",), pfx), ecat, moe_I, H)
            e += linear_bytes(names_for(i, ("mlp.experts.0.down_proj",), pfx), ecat, H, moe_I)
            router = linear_bytes(names_for(i, ("mlp.gate",), pfx), category, num_experts, H)
            shared = 0
            if shared_I:
                shared = linear_bytes(names_for(i, ("mlp.shared_expert.gate_proj",), pfx), category, shared_I, H)
                shared += linear_bytes(names_for(i, ("mlp.shared_expert.up_proj",), pfx), category, shared_I, H)
                shared += linear_bytes(names_for(i, ("mlp.shared_expert.down_proj",), pfx), category, H, shared_I)
                shared += H * db  # shared_expert_gate
            total = e * num_experts + router + shared
            read = e * min(top_k or num_experts, num_experts) + router + shared
            return total, read

        layers: list[LayerSpec] = []
        for i, kind in enumerate(layer_types):
            mixer = attention_bytes(i) if kind == FULL else gdn_bytes(i)
            mlp_w, mlp_r = mlp_bytes(i)
            norms = 2 * H * db
            layers.append(LayerSpec(kind, mixer + mlp_w + norms, mixer + mlp_r + norms))

        embed = V * H * res.fmt(("model.embed_tokens", "model.language_model.embed_tokens"), "embedding").bits // 8
        lm_head = res.fmt(("lm_head",), "lm_head").linear_bytes(V, H)
        final_norm = H * db

        # Widest per-token intermediate a layer produces (for the activation estimate).
        widths = [nH * hd * (2 if gate else 1) + 2 * nKV * hd, I]
        if num_experts:
            widths.append(top_k * moe_I + shared_I)
        if linear is not None:
            widths.append(2 * linear.conv_dim + 2 * linear.value_dim)
        activation_width = max(widths)

        mamba_ssm_dtype = str(text.get("mamba_ssm_dtype") or "auto") if mt.startswith("qwen3_5") else "auto"

        # Vision tower (Qwen3-VL / Qwen3.5 layout; other families by the same shapes).
        vision_bytes = vis_h = vis_i = vis_out = 0
        vc = cfg.get("vision_config") or {}
        if vc and is_vl:
            vis_h = int(vc.get("hidden_size") or vc.get("embed_dim") or 0)
            depth = int(vc.get("depth") or vc.get("num_hidden_layers") or 0)
            vis_i = int(vc.get("intermediate_size") or (vis_h * float(vc.get("mlp_ratio", 4))))
            vis_out = int(vc.get("out_hidden_size") or H)
            if vis_h and depth:
                merge = int(vc.get("spatial_merge_size") or 2)
                patch = int(vc.get("patch_size") or 14)
                tps = int(vc.get("temporal_patch_size") or 2)
                chans = int(vc.get("in_channels") or 3)
                vpfx = ("model.visual.blocks.{i}", "visual.blocks.{i}")

                def vlin(i: int, s: str, o: int, n: int) -> int:
                    return linear_bytes(names_for(i, (s,), vpfx), "vision", o, n)

                block = (
                    vlin(0, "attn.qkv", 3 * vis_h, vis_h)
                    + vlin(0, "attn.proj", vis_h, vis_h)
                    + vlin(0, "mlp.linear_fc1", vis_i, vis_h)
                    + vlin(0, "mlp.linear_fc2", vis_h, vis_i)
                    + (3 * vis_h + vis_h + vis_i + vis_h + 4 * vis_h) * db  # biases, 2 norms
                )
                mh = vis_h * merge * merge
                merger = (mh * mh + mh * vis_out + 2 * mh + vis_out) * db
                n_deep = len(vc.get("deepstack_visual_indexes") or [])
                vision_bytes = (
                    depth * block
                    + (chans * tps * patch * patch * vis_h + vis_h) * db
                    + int(vc.get("num_position_embeddings") or 0) * vis_h * db
                    + merger * (1 + n_deep)
                )

        # The model's own MTP layers (Qwen3-Next / Qwen3.5: a full-attention decoder layer each,
        # plus an fc over [embedding, hidden] and three norms).
        mtp_n = int(text.get("mtp_num_hidden_layers") or 0)
        mtp_layer = mtp_extra = mtp_read = 0
        if mtp_n:
            mpfx = ("mtp.layers.{i}",)
            mtp_layer = attention_bytes(0, mpfx, "mtp")
            w, r = mlp_bytes(0, mpfx, "mtp")
            mtp_layer_read = mtp_layer + r + 2 * H * db
            mtp_layer += w + 2 * H * db
            mtp_extra = linear_bytes(("mtp.fc",), "mtp", H, 2 * H) + 3 * H * db
            mtp_read = mtp_layer_read + mtp_extra

        max_pos = _derived_max_len(text)
        total_params = sum(used.values()) or 1
        mix = sorted(used.items(), key=lambda kv: -kv[1])
        wf = res.describe() if weight_format != "auto" else (
            mix[0][0] if len(mix) == 1 or mix[0][1] / total_params > 0.97 else "+".join(k for k, _ in mix)
        )
        return cls(
            name=str(name),
            architecture=arch,
            model_type=mt,
            dtype=dtype,
            layers=tuple(layers),
            hidden_size=H,
            vocab_size=V,
            intermediate_size=I,
            num_attention_heads=nH,
            num_kv_heads=nKV,
            head_dim=hd,
            max_position_embeddings=max_pos,
            tie_word_embeddings=tie,
            embed_bytes=embed,
            lm_head_bytes=lm_head,
            final_norm_bytes=final_norm,
            linear=linear,
            mamba_ssm_dtype=mamba_ssm_dtype,
            vision_bytes=vision_bytes,
            vision_hidden_size=vis_h,
            vision_intermediate_size=vis_i,
            vision_out_hidden_size=vis_out,
            mtp_num_layers=mtp_n,
            mtp_layer_bytes=mtp_layer,
            mtp_extra_bytes=mtp_extra,
            mtp_decode_read_bytes=mtp_read,
            activation_width=activation_width,
            weight_format=wf,
            quantization_method=res.method,
            formats={k: v for k, v in used.items()},
        )


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

    def to_dict(self) -> dict:
        return {
            "method": self.method,
            "num_speculative_tokens": self.num_speculative_tokens,
            "kv_layers": self.kv_layers,
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
        try:
            d = ModelSpec.from_hf_config(dcfg, weight_format=str(spec.get("draft_weight_format") or "auto"))
        except UnsupportedModel as e:
            raise UnsupportedModel(f"drafter: {e}") from None
        if d.is_hybrid:
            raise UnsupportedModel("drafter: linear-attention drafters are not sized by the planner yet")
        H = d.hidden_size
        db = dense_format(d.dtype).bits // 8
        if "dflash" in method:
            dfl = text.get("dflash_config") or {}
            n_feat = len(dfl.get("target_layer_ids") or text.get("target_layer_ids") or []) or d.num_layers
            fc = n_feat * H * H * db + H * db
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
        weights = sum(d.layer_weight_bytes) + fc + d.final_norm_bytes
        head_read = own_head or target.lm_head_bytes
        read = sum(layer.decode_read_bytes for layer in d.layers) + fc + head_read
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
            name=f"{method} drafter ({d.num_layers} layers, {d.weight_format})",
        )


__all__ = ["DrafterSpec", "FULL", "GdnDims", "LINEAR", "LayerSpec", "ModelSpec"]
