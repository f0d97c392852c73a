"""Bytes per weight matrix for each checkpoint format, and which module uses which format.

A checkpoint's ``quantization_config`` says how its linear layers are stored; modules it leaves
out (``ignore``, ``modules_to_not_convert``, ``exclude_modules``, ...) keep 16-bit weights, as
do embeddings and the output head unless the config says otherwise. :class:`FormatResolver`
answers "what format does module NAME use" from that config or from a user override such as
``"fp8"`` or ``"mlp=nvfp4,attention=fp8"``.
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass

from vllm_dualgpu.planner.errors import BadRequest, UnsupportedModel


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class WeightFormat:
    """How one ``out x in`` weight matrix is stored.

    kind: ``"dense"`` (16/32-bit), ``"fp8"``, ``"int8"``, ``"nvfp4"``, ``"int4"``, ``"mxfp4"``.
    scale: ``"tensor"``, ``"channel"``, ``"group"`` or ``"block"`` (fp8 128x128 blocks).
    """

    name: str
    kind: str
    bits: int
    scale: str = "tensor"
    group: int = 0
    scale_bytes: int = 4
    zero_points: bool = False

    def linear_bytes(self, out_features: int, in_features: int) -> int:
        """Bytes of one weight matrix (plus its scales) of shape ``out x in``."""
        n = out_features * in_features
        data = cdiv(n * self.bits, 8)
        if self.kind == "dense":
            return data
        if self.kind == "nvfp4":
            # fp8 (e4m3) scale per 16 input elements + fp32 global weight and input scales
            return data + out_features * cdiv(in_features, 16) + 8
        if self.kind == "mxfp4":
            # e8m0 scale per 32 input elements
            return data + out_features * cdiv(in_features, 32)
        if self.scale == "block":
            scales = cdiv(out_features, self.group) * cdiv(in_features, self.group)
        elif self.scale == "group":
            scales = out_features * cdiv(in_features, self.group)
        elif self.scale == "channel":
            scales = out_features
        else:
            scales = 1
        extra = scales * self.scale_bytes
        if self.zero_points:
            extra += cdiv(scales * self.bits, 8)
        return data + extra

    @property
    def short(self) -> str:
        return self.name


BF16 = WeightFormat("bf16", "dense", 16)
FP16 = WeightFormat("fp16", "dense", 16)
FP32 = WeightFormat("fp32", "dense", 32)
FP8_BLOCK = WeightFormat("fp8", "fp8", 8, "block", 128, 4)
FP8_CHANNEL = WeightFormat("fp8-channel", "fp8", 8, "channel", 0, 4)
FP8_TENSOR = WeightFormat("fp8-tensor", "fp8", 8, "tensor", 0, 4)
INT8_CHANNEL = WeightFormat("int8", "int8", 8, "channel", 0, 2)
NVFP4 = WeightFormat("nvfp4", "nvfp4", 4)
W4A16 = WeightFormat("w4a16", "int4", 4, "group", 128, 2)
MXFP4 = WeightFormat("mxfp4", "mxfp4", 4)

#: Names accepted by ``--weight-format`` (and the ``weight_format`` argument).
FORMAT_ALIASES: dict[str, WeightFormat] = {
    "bf16": BF16,
    "bfloat16": BF16,
    "fp16": FP16,
    "float16": FP16,
    "half": FP16,
    "fp32": FP32,
    "float32": FP32,
    "fp8": FP8_BLOCK,
    "fp8-block": FP8_BLOCK,
    "fp8_block": FP8_BLOCK,
    "fp8-channel": FP8_CHANNEL,
    "fp8-tensor": FP8_TENSOR,
    "int8": INT8_CHANNEL,
    "w8a16": INT8_CHANNEL,
    "w8a8": INT8_CHANNEL,
    "nvfp4": NVFP4,
    "fp4": NVFP4,
    "w4a16": W4A16,
    "int4": W4A16,
    "gptq": W4A16,
    "awq": W4A16,
    "mxfp4": MXFP4,
}

#: Module categories a per-category override may name.
CATEGORIES = (
    "attention",
    "linear_attention",
    "mlp",
    "experts",
    "vision",
    "mtp",
    "lm_head",
    "embedding",
)


def int_group_format(bits: int, group: int, zero_points: bool = False) -> WeightFormat:
    """Weight-only integers (8 or 4 bits) in groups of ``group`` inputs with a 16-bit scale each."""
    if bits == 8:
        return WeightFormat(f"int8-g{group}", "int8", 8, "group", group, 2, zero_points)
    return WeightFormat("w4a16" if group == 128 else f"w4a16-g{group}", "int4", 4, "group", group, 2, zero_points)


#: Integer formats with their group size in the name: int8-g128, w8a16-g128, w4a16-g32, int4-g64.
_GROUPED = re.compile(r"^(int8|w8a16|int4|w4a16)-g([1-9][0-9]*)$")


def weight_format(name: str) -> WeightFormat:
    key = name.strip().lower()
    if key in FORMAT_ALIASES:
        return FORMAT_ALIASES[key]
    m = _GROUPED.match(key)
    if m:
        return int_group_format(8 if m.group(1) in ("int8", "w8a16") else 4, int(m.group(2)))
    raise BadRequest(
        f"unknown weight format {name!r}; use one of {', '.join(sorted(set(FORMAT_ALIASES)))}, "
        "or int8-gN / w4a16-gN for groups of N"
    )


_named = weight_format  # from_config's parameter of the same name shadows the function


def dense_format(dtype: str) -> WeightFormat:
    """The 16-bit (or 32-bit) format of unquantized weights for a model dtype name."""
    d = (dtype or "bfloat16").lower().replace("torch.", "")
    if d in ("float32", "fp32", "float"):
        return FP32
    if d in ("float16", "fp16", "half"):
        return FP16
    return BF16


class _Patterns:
    """Module-name patterns as quantization configs write them.

    ``re:REGEX`` (compressed-tensors), shell globs with ``*`` (ModelOpt) and plain dotted names
    that match whole name components (``"lm_head"``, ``"mlp.gate"``, ``"model.visual"``).
    """

    def __init__(self, patterns) -> None:
        self.regexes: list[re.Pattern] = []
        self.globs: list[str] = []
        self.plain: list[str] = []
        for p in patterns or ():
            if not isinstance(p, str) or not p:
                continue
            if p.startswith("re:"):
                self.regexes.append(re.compile(p[3:]))
            elif "*" in p or "?" in p:
                self.globs.append(p)
            else:
                self.plain.append(p)

    def __bool__(self) -> bool:
        return bool(self.regexes or self.globs or self.plain)

    def match(self, name: str) -> bool:
        dotted = f".{name}."
        for p in self.plain:
            if f".{p}." in dotted:
                return True
        for g in self.globs:
            if fnmatch.fnmatchcase(name, g):
                return True
        for r in self.regexes:
            if r.match(name) or r.fullmatch(name):
                return True
        return False


#: The names vLLM and checkpoints give a model's input embedding, and vLLM's class for it:
#: compressed-tensors matches a config group's targets against both (by name, exactly or as a
#: ``re:`` regex, or by class name containing the target; utils.py find_matched_target).
EMBEDDING_NAMES = ("model.embed_tokens", "model.language_model.embed_tokens", "language_model.model.embed_tokens")
EMBEDDING_CLASS = "VocabParallelEmbedding"


def targets_embedding(targets) -> bool:
    """Whether a compressed-tensors config group with these ``targets`` quantizes the embedding."""
    for t in targets or ():
        if not isinstance(t, str) or not t:
            continue
        if t.startswith("re:"):
            if any(re.match(t[3:], n) for n in EMBEDDING_NAMES):
                return True
        elif t in EMBEDDING_NAMES or t in EMBEDDING_CLASS:
            return True
    return False


def embedding_bytes(f: WeightFormat, vocab: int, hidden: int, dense: WeightFormat) -> int:
    """Bytes of a ``vocab x hidden`` input embedding stored in ``f``. Quantized, as vLLM's
    ``CompressedTensorsEmbeddingWNA16Int.create_weights`` lays it out: int32 words of ``32 / bits``
    values, one scale per group (or per row) in the model's dtype, and an int64 [2] shape."""
    if f.kind == "dense":
        return vocab * hidden * f.bits // 8
    words = vocab * (hidden // (32 // f.bits)) * 4
    scales = vocab * (hidden // f.group if f.scale == "group" else 1) * (dense.bits // 8)
    return words + scales + 2 * 8


def _fmt_from_compressed_tensors(weights: dict, fmt_name: str | None) -> WeightFormat:
    bits = int(weights.get("num_bits", 8))
    typ = weights.get("type", "int")
    strategy = weights.get("strategy", "tensor")
    group = int(weights.get("group_size") or 128)
    symmetric = weights.get("symmetric", True)
    fmt_name = (fmt_name or "").lower()
    if "nvfp4" in fmt_name or (bits == 4 and typ == "float" and group == 16):
        return NVFP4
    if "mxfp4" in fmt_name or (bits == 4 and typ == "float" and group == 32):
        return MXFP4
    if bits == 8 and typ == "float":
        if strategy == "block":
            block = weights.get("block_structure") or [128, 128]
            return WeightFormat("fp8", "fp8", 8, "block", int(block[0]), 4)
        if strategy == "channel":
            return FP8_CHANNEL
        return FP8_TENSOR
    if bits == 8:
        if strategy == "group":
            return int_group_format(8, group, not symmetric)
        return INT8_CHANNEL
    if bits == 4:
        if strategy == "channel":
            return WeightFormat("w4a16-channel", "int4", 4, "channel", 0, 2, not symmetric)
        return int_group_format(4, group, not symmetric)
    raise UnsupportedModel(f"compressed-tensors weights with {bits} bits ({typ}) are not sized by the planner")


class FormatResolver:
    """Answers which :class:`WeightFormat` a module uses.

    Build it with :meth:`from_config`. ``fmt(name, category)`` takes a checkpoint-style module
    name (``model.layers.3.self_attn.q_proj``) and its category (see :data:`CATEGORIES`).
    """

    def __init__(
        self,
        *,
        default: WeightFormat,
        dense: WeightFormat,
        ignore: _Patterns | None = None,
        targeted: list[tuple[_Patterns, WeightFormat]] | None = None,
        by_category: dict[str, WeightFormat] | None = None,
        method: str = "none",
        quantize_lm_head: bool = False,
    ) -> None:
        self.default = default
        self.dense = dense
        self.ignore = ignore or _Patterns(())
        self.targeted = targeted or []
        self.by_category = by_category or {}
        self.method = method
        self.quantize_lm_head = quantize_lm_head

    def fmt(self, names: str | tuple[str, ...], category: str) -> WeightFormat:
        if isinstance(names, str):
            names = (names,)
        if category in self.by_category:
            return self.by_category[category]
        if category == "embedding":
            return self.dense
        if category == "lm_head" and not self.quantize_lm_head:
            return self.dense
        if self.default is self.dense and not self.targeted:
            return self.dense
        if any(self.ignore.match(n) for n in names):
            return self.dense
        for pats, f in self.targeted:
            if any(pats.match(n) for n in names):
                return f
        if self.targeted:
            return self.dense
        return self.default

    def describe(self) -> str:
        if self.by_category and self.default is self.dense and not self.targeted:
            return ",".join(f"{k}={v.name}" for k, v in self.by_category.items())
        base = self.default.name
        if self.targeted:
            base = "+".join(sorted({f.name for _, f in self.targeted}))
        if self.by_category:
            base += " (" + ",".join(f"{k}={v.name}" for k, v in self.by_category.items()) + ")"
        return base

    @classmethod
    def from_config(
        cls,
        quant_config: dict | None,
        *,
        weight_format: str = "auto",
        quantization: str | None = None,
        dtype: str = "bfloat16",
    ) -> "FormatResolver":
        """Resolve formats from ``quantization_config`` (``weight_format="auto"``) or an override.

        ``weight_format`` may be one format for every quantizable linear layer (``"fp8"``), or
        per-category ``"mlp=nvfp4,attention=fp8,linear_attention=fp8"`` (categories not named
        keep what the checkpoint says, or 16-bit). ``quantization`` is vLLM's ``--quantization``:
        for a 16-bit checkpoint, ``"fp8"`` means vLLM quantizes the linear layers when loading.
        """
        dense = dense_format(dtype)
        wf = (weight_format or "auto").strip()
        if wf.lower() != "auto":
            if "=" in wf:
                by_cat: dict[str, WeightFormat] = {}
                bare = [p.strip() for p in wf.split(",") if p.strip() and "=" not in p]
                if len(bare) > 1:
                    raise BadRequest(f"bad --weight-format {wf!r}: at most one format without a category (the "
                                     "decoder's linear layers), then CATEGORY=FORMAT parts")
                for part in wf.split(","):
                    if not part.strip() or "=" not in part:
                        continue
                    k, v = (s.strip() for s in part.split("=", 1))
                    if k not in CATEGORIES:
                        raise BadRequest(f"unknown weight category {k!r}; use one of {', '.join(CATEGORIES)}")
                    by_cat[k] = _named(v)
                # a bare format first: as --weight-format FORMAT; else what the checkpoint says
                base = cls.from_config(quant_config, weight_format=bare[0] if bare else "auto",
                                       quantization=quantization, dtype=dtype)
                base.by_category = {**base.by_category, **by_cat}
                return base
            f = _named(wf)
            # One format for the decoder's linear layers; vision, embeddings and the head stay 16-bit.
            return cls(
                default=f,
                dense=dense,
                by_category={"vision": dense},
                method=f"override:{f.name}",
            )
        if not quant_config:
            if quantization:
                q = quantization.lower()
                if q in ("fp8", "ptpc_fp8"):
                    return cls(default=FP8_TENSOR, dense=dense, by_category={"vision": dense}, method="online-fp8")
                if q in FORMAT_ALIASES:
                    return cls(default=FORMAT_ALIASES[q], dense=dense, by_category={"vision": dense}, method=q)
                raise UnsupportedModel(
                    f"--quantization {quantization} on a 16-bit checkpoint is not sized by the planner; "
                    "pass --weight-format"
                )
            return cls(default=dense, dense=dense, method="none")
        return cls._from_quant_config(quant_config, dense)

    @classmethod
    def _from_quant_config(cls, qc: dict, dense: WeightFormat) -> "FormatResolver":
        method = str(qc.get("quant_method") or qc.get("quantization_method") or "").lower()
        if method == "fp8":
            block = qc.get("weight_block_size")
            if block:
                f = WeightFormat("fp8", "fp8", 8, "block", int(block[0]), 4)
            else:
                f = FP8_TENSOR
            ignore = _Patterns(list(qc.get("ignored_layers") or []) + list(qc.get("modules_to_not_convert") or []))
            return cls(default=f, dense=dense, ignore=ignore, method="fp8")
        if method == "compressed-tensors":
            ignore = _Patterns(qc.get("ignore") or [])
            targeted: list[tuple[_Patterns, WeightFormat]] = []
            by_category: dict[str, WeightFormat] = {}
            fmt_name = qc.get("format")
            for group in (qc.get("config_groups") or {}).values():
                w = group.get("weights")
                if not w:
                    continue
                f = _fmt_from_compressed_tensors(w, group.get("format") or fmt_name)
                targets = group.get("targets") or ["Linear"]
                if (targets_embedding(targets) and "embedding" not in by_category
                        and not any(ignore.match(n) for n in EMBEDDING_NAMES)):
                    if f.kind not in ("int8", "int4") or f.scale not in ("group", "channel"):
                        raise UnsupportedModel(
                            f"the checkpoint quantizes its embedding as {f.name}; vLLM loads only weight-only INT "
                            "group/channel embeddings (compressed-tensors WNA16)")
                    by_category["embedding"] = f
                if any(t == "Linear" for t in targets):
                    targeted.append((_Patterns(["re:.*"]), f))
                else:
                    targeted.append((_Patterns(targets), f))
            if not targeted:
                return cls(default=dense, dense=dense, method="compressed-tensors (no weight groups)")
            return cls(default=targeted[-1][1], dense=dense, ignore=ignore, targeted=targeted,
                       by_category=by_category, method="compressed-tensors")
        if method.startswith("modelopt"):
            algo = str(qc.get("quant_algo") or ("NVFP4" if "fp4" in method else "FP8")).upper()
            exclude = _Patterns(qc.get("exclude_modules") or qc.get("ignore") or [])
            if algo == "MIXED_PRECISION":
                layers = qc.get("quantized_layers") or {}
                targeted = []
                for name, info in layers.items():
                    a = str((info or {}).get("quant_algo", "")).upper()
                    f = NVFP4 if "FP4" in a else FP8_TENSOR
                    targeted.append((_Patterns([name]), f))
                return cls(default=dense, dense=dense, ignore=exclude, targeted=targeted, method="modelopt-mixed")
            f = NVFP4 if "FP4" in algo else FP8_TENSOR
            return cls(default=f, dense=dense, ignore=exclude, method=f"modelopt-{f.name}")
        if method in ("gptq", "awq", "gptq_marlin", "awq_marlin", "auto-round", "auto_round"):
            bits = int(qc.get("bits") or qc.get("w_bit") or 4)
            group = int(qc.get("group_size") or qc.get("q_group_size") or 128)
            if group <= 0:
                group = 1 << 30
            zp = bool(qc.get("zero_point", not qc.get("sym", True)))
            kind = "int4" if bits == 4 else "int8"
            f = WeightFormat(f"{'w4a16' if bits == 4 else 'int8'}-g{group}", kind, bits, "group", group, 2, zp)
            pats = list(qc.get("modules_to_not_convert") or [])
            dynamic = qc.get("dynamic") or {}
            pats += ["re:" + k[2:].lstrip(":") for k in dynamic if isinstance(k, str) and k.startswith("-:")]
            return cls(default=f, dense=dense, ignore=_Patterns(pats), method=method)
        if method == "mxfp4":
            return cls(
                default=dense,
                dense=dense,
                ignore=_Patterns(qc.get("modules_to_not_convert") or []),
                by_category={"experts": MXFP4},
                method="mxfp4",
            )
        if method == "bitsandbytes":
            if qc.get("load_in_8bit"):
                return cls(default=INT8_CHANNEL, dense=dense, method="bitsandbytes-8bit")
            return cls(default=WeightFormat("nf4", "int4", 4, "group", 64, 4), dense=dense, method="bitsandbytes-4bit")
        raise UnsupportedModel(
            f"quantization method {method or '?'!r} is not sized by the planner; pass --weight-format "
            "(e.g. fp8, int8, nvfp4, w4a16, or mlp=nvfp4,attention=fp8)"
        )
