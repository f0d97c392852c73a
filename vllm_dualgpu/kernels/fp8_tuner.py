"""Tune vLLM's block-FP8 Triton GEMM for the weight shapes of a model, on the current GPU.

vLLM's own tuner (``benchmarks/kernels/benchmark_w8a8_block_fp8.py``) is not part of the wheel,
so this is a compact one. It launches vLLM's kernel (``fp8_utils._w8a8_triton_block_scaled_mm``,
exactly as ``w8a8_triton_block_scaled_mm`` does) with an explicit config, times candidates with
``triton.testing.do_bench`` (L2 flushed before every run, median), and writes files in vLLM's
format: ``{"M": {BLOCK_SIZE_M, BLOCK_SIZE_N, BLOCK_SIZE_K, GROUP_SIZE_M, num_warps,
num_stages}}``, named ``N={N},K={K},device_name={card},dtype=fp8_w8a8,block_shape=[bn,bk].json``.

The search is a fixed shortlist per batch-size bucket (about 20-35 configs, vLLM's default
config always among them), pruned by the card's shared memory, timed in two passes (a short
pass over all, a longer one over the best three). Compiling is what costs most: Triton compiles
one variant per config and per "specialization" of the integer arguments (M == 1, M % 16 == 0,
...), so the candidates of neighbouring buckets overlap on purpose, and the variants can be
compiled beforehand in parallel worker processes (``jobs``).

Shapes come from a model's ``config.json`` (:func:`model_weight_shapes`) or from the caller.
Everything above the "GPU" line works without torch or a GPU.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from vllm_dualgpu.kernels.fp8_configs import (
    CONFIG_KEYS,
    config_file_name,
    device_name_as_file_name,
    pick_config,
    validate_configs,
)

DEFAULT_BATCH_SIZES = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
BENCH_BATCH_SIZES = (1, 8, 64, 512, 4096)
H200_SMEM = 232448  # bytes per block (opt-in), used for plans made without a GPU
H200_L2 = 60 * 1024**2

# The kernel's parameters in vLLM 0.30.0 (fp8_utils.py, _w8a8_triton_block_scaled_mm), in order.
KERNEL_NAMES = ("_w8a8_triton_block_scaled_mm", "_w8a8_block_fp8_matmul")
KERNEL_PARAMS = (
    "A", "B", "C", "As", "Bs", "M", "N", "K", "group_n", "group_k",
    "stride_am", "stride_ak", "stride_bk", "stride_bn", "stride_cm", "stride_cn",
    "stride_As_m", "stride_As_k", "stride_Bs_k", "stride_Bs_n",
    "BLOCK_SIZE_M", "BLOCK_SIZE_N", "BLOCK_SIZE_K", "GROUP_SIZE_M",
)


# ============================================================================================
# Weight shapes of a model
# ============================================================================================


@dataclass
class WeightShape:
    N: int
    K: int
    layers: list[str] = field(default_factory=list)

    @property
    def key(self) -> tuple[int, int]:
        return (self.N, self.K)


@dataclass
class ShapeReport:
    shapes: list[WeightShape]
    block: tuple[int, int]
    skipped: list[str]
    notes: list[str]


def parse_shapes(text: str) -> list[tuple[int, int]]:
    """``"14336,5120;5120,6144"`` (or ``14336x5120``) -> [(14336, 5120), (5120, 6144)]."""
    out: list[tuple[int, int]] = []
    for part in text.replace(" ", "").split(";"):
        if not part:
            continue
        bits = part.replace("x", ",").replace("X", ",").split(",")
        try:
            if len(bits) != 2:
                raise ValueError
            n, k = int(bits[0]), int(bits[1])
            if n < 1 or k < 1:
                raise ValueError
        except ValueError:
            raise ValueError(
                f"cannot read {part!r} as a weight shape: write N,K pairs separated by ';', "
                "e.g. --shapes '14336,5120;5120,6144'"
            ) from None
        if (n, k) not in out:
            out.append((n, k))
    if not out:
        raise ValueError("--shapes names no shape: write e.g. '14336,5120;5120,6144'")
    return out


def parse_batch_sizes(text: str) -> list[int]:
    try:
        sizes = sorted({int(x) for x in text.replace(" ", "").split(",") if x})
    except ValueError:
        raise ValueError(f"cannot read {text!r} as batch sizes: write e.g. 1,8,64,512") from None
    if not sizes or sizes[0] < 1:
        raise ValueError(f"batch sizes must be positive integers, got {text!r}")
    return sizes


def read_model_config(model: str) -> dict:
    """``config.json`` of a local model folder, a path to a config file, or a Hugging Face id
    (read from the local cache, downloaded if missing: config.json only)."""
    p = Path(model).expanduser()
    if p.is_dir():
        p = p / "config.json"
    if p.is_file():
        return json.loads(p.read_text())
    if p.suffix == ".json" or model.startswith(("/", ".", "~")) or model.count("/") != 1:
        raise FileNotFoundError(f"no config.json at {p}")
    try:
        from huggingface_hub import hf_hub_download

        return json.loads(Path(hf_hub_download(model, "config.json")).read_text())
    except Exception as exc:  # noqa: BLE001 - any failure means: not readable
        raise FileNotFoundError(
            f"{model!r} is neither a local model folder nor a readable Hugging Face model id "
            f"({exc.__class__.__name__}: {exc})"
        ) from None


def _quant_config(cfg: dict) -> dict | None:
    for where in (cfg, cfg.get("text_config") or {}):
        q = where.get("quantization_config")
        if isinstance(q, dict):
            return q
    return None


def quant_block_size(cfg: dict) -> tuple[int, int] | None:
    q = _quant_config(cfg)
    if not q:
        return None
    block = q.get("weight_block_size")
    if isinstance(block, (list, tuple)) and len(block) == 2:
        return int(block[0]), int(block[1])
    return None


def _ignore_list(q: dict) -> list[str]:
    for key in ("ignored_layers", "modules_to_not_convert", "ignore"):
        val = q.get(key)
        if val:
            return [str(v) for v in val]
    return []


def _is_ignored(entry: str, layer: int | None, sub: str) -> bool:
    """Does one ignore-list entry cover ``sub`` (``self_attn.q_proj``) of ``layer``?"""
    import re

    if entry.startswith("re:"):
        pat = entry[3:]
        names = [f"model.layers.{layer}.{sub}", f"model.language_model.layers.{layer}.{sub}"]
        return any(re.search(pat, n) for n in names)
    if layer is not None and re.search(rf"(^|\.)layers\.{layer}\.{re.escape(sub)}$", entry):
        return True
    if re.search(r"(^|\.)\d+(\.|$)", entry):
        return False  # names one numbered module (another layer, a vision block, ...)
    return entry == sub or entry.endswith("." + sub) or entry == sub.split(".")[-1]


def _all_ignored(ignore: list[str], layers: Iterable[int], subs: Sequence[str]) -> bool:
    layers = list(layers)
    return bool(ignore) and all(
        any(_is_ignored(e, i, s) for e in ignore) for i in layers for s in subs
    )


def model_weight_shapes(cfg: dict, tp: int = 1, block: tuple[int, int] | None = None) -> ShapeReport:
    """The (N, K) of every block-FP8 linear layer vLLM builds for a Qwen3 / Qwen3.5 / Qwen3-Next
    style decoder (and Llama/Qwen2-style ones): fused qkv (with Qwen3.5's output gate), o_proj,
    the GDN in_proj_qkvz / out_proj, gate_up and down; ``N`` is split by ``tp`` for
    column-parallel layers, ``K`` for row-parallel ones."""
    from vllm_dualgpu.planner.errors import PlanError
    from vllm_dualgpu.planner.hf_config import FULL, LINEAR, DecoderConfig

    block = block or quant_block_size(cfg)
    if block is None:
        raise ValueError(
            "the model's quantization_config has no weight_block_size (not a block-FP8 "
            "checkpoint); give the shapes with --shapes N,K;N,K"
        )
    try:
        dc = DecoderConfig.from_dict(cfg)  # the planner's reader: both see the same layers
    except PlanError as exc:
        raise ValueError(f"{exc}; give the shapes with --shapes N,K;N,K") from None
    bn, bk = block
    ignore = _ignore_list(dc.quantization_config or {})
    H = dc.hidden_size
    full, linear = dc.layers_of(FULL), dc.layers_of(LINEAR)
    all_layers = list(range(dc.num_layers))

    shapes: dict[tuple[int, int], WeightShape] = {}
    skipped: list[str] = []
    notes: list[str] = []

    def div(x: int, what: str) -> int:
        if x % tp:
            raise ValueError(f"{what} = {x} is not divisible by --tp {tp}")
        return x // tp

    def add(name: str, N: int, K: int, parts: Sequence[int], layers: list[int],
            subs: Sequence[str], column: bool) -> None:
        if not layers:
            return
        if _all_ignored(ignore, layers, subs):
            skipped.append(f"{name}: not quantized (ignored by the checkpoint)")
            return
        # vLLM's validate_fp8_block_shape: merged shards (all but the last, or all under TP)
        # must be whole blocks, and a row-parallel split must be whole blocks of K.
        check = list(parts) if tp > 1 else list(parts)[:-1]
        bad = [p for p in check if p % bn]
        if bad or (not column and tp > 1 and K % bk):
            skipped.append(f"{name}: shards {list(parts)} do not fit block {bn}x{bk}, so vLLM "
                           "cannot load it as block FP8")
            return
        shape = shapes.setdefault((N, K), WeightShape(N, K))
        shape.layers.append(name)

    if full:
        heads, kv, head_dim = dc.num_heads, dc.num_kv_heads, dc.head_dim
        q_size = div(heads, "num_attention_heads") * (1 + dc.attn_output_gate) * head_dim
        kv_size = (kv // tp if kv >= tp else 1) * head_dim
        add("self_attn.qkv_proj", q_size + 2 * kv_size, H, [q_size, kv_size, kv_size], full,
            ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), True)
        add("self_attn.o_proj", H, div(heads * head_dim, "attention width"), [H], full,
            ("self_attn.o_proj",), False)
    if linear:
        g = dc.linear
        nv, key_dim, value_dim = g.num_v_heads, g.key_dim, g.value_dim
        qwen35 = dc.model_type.startswith("qwen3_5")
        qkvz_parts = [div(d, "linear-attention width") for d in (key_dim, key_dim, value_dim, value_dim)]
        add("linear_attn.in_proj_qkvz", sum(qkvz_parts), H,
            qkvz_parts if qwen35 else [sum(qkvz_parts)], linear,
            ("linear_attn.in_proj_qkv", "linear_attn.in_proj_z") if qwen35 else ("linear_attn.in_proj_qkvz",),
            True)
        ba_parts = [div(nv, "linear_num_value_heads")] * 2 if qwen35 else [div(2 * nv, "2 x linear_num_value_heads")]
        add("linear_attn.in_proj_ba", sum(ba_parts), H, ba_parts, linear,
            ("linear_attn.in_proj_b", "linear_attn.in_proj_a") if qwen35 else ("linear_attn.in_proj_ba",),
            True)
        add("linear_attn.out_proj", H, div(value_dim, "linear value width"), [H], linear,
            ("linear_attn.out_proj",), False)

    dense_layers = [i for i in all_layers if not dc.is_moe_layer(i)]
    if dc.num_experts:
        notes.append(f"{dc.num_experts} routed experts run through vLLM's fused-MoE kernels, whose "
                     "configs are tuned separately (not here)")
        moe_layers = [i for i in all_layers if dc.is_moe_layer(i)]
        shared = dc.shared_expert_intermediate_size
        if shared:
            s = div(shared, "shared_expert_intermediate_size")
            add("mlp.shared_expert.gate_up_proj", 2 * s, H, [s, s], moe_layers,
                ("mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj"), True)
            add("mlp.shared_expert.down_proj", H, s, [H], moe_layers,
                ("mlp.shared_expert.down_proj",), False)
    if dense_layers and dc.intermediate_size:
        inter = div(dc.intermediate_size, "intermediate_size")
        add("mlp.gate_up_proj", 2 * inter, H, [inter, inter], dense_layers,
            ("mlp.gate_proj", "mlp.up_proj"), True)
        add("mlp.down_proj", H, inter, [H], dense_layers, ("mlp.down_proj",), False)
    if not shapes:
        raise ValueError("found no block-FP8 linear layer in this config; give --shapes")
    return ShapeReport(list(shapes.values()), (bn, bk), skipped, notes)


# ============================================================================================
# Candidate configs and the plan
# ============================================================================================


def cfg(bm: int, bn: int, bk: int, gm: int, warps: int, stages: int) -> dict:
    return {"BLOCK_SIZE_M": bm, "BLOCK_SIZE_N": bn, "BLOCK_SIZE_K": bk, "GROUP_SIZE_M": gm,
            "num_warps": warps, "num_stages": stages}


def vllm_default_config(block_n: int, block_k: int) -> dict:
    """The config w8a8_triton_block_scaled_mm uses when no file matches (vLLM 0.30.0)."""
    return cfg(64, block_n, block_k, 32, 4, 2)


def smem_bytes(c: dict) -> int:
    """Shared memory the software pipeline needs: FP8 tiles of A and B per stage."""
    return c["num_stages"] * (c["BLOCK_SIZE_M"] + c["BLOCK_SIZE_N"]) * c["BLOCK_SIZE_K"]


_SMALL_BN_W = ((32, 4), (64, 4), (64, 8), (128, 4), (128, 8))
_MID_BN_W = ((32, 4), (64, 4), (64, 8), (128, 4), (128, 8))
_BIG_BN_W = ((64, 4), (128, 4), (128, 8), (256, 8))


def candidate_configs(M: int, block_n: int, block_k: int, smem_limit: int = H200_SMEM) -> list[dict]:
    """The shortlist for M rows: small tiles for decode-sized M, large ones for prefill.

    BLOCK_SIZE_K is the largest of 128/64 that divides the quantization block (one scale per
    K step). GROUP_SIZE_M only matters with several row tiles, so it is searched for M >= 256.
    Neighbouring buckets share configs, so Triton compiles fewer variants.
    """
    bk = next((b for b in (128, 64, 32) if block_k % b == 0), None)
    if bk is None:
        raise ValueError(f"quantization block K={block_k} is not a multiple of 32")
    out: list[dict] = []
    if M <= 32:
        out += [cfg(16, n, bk, 1, w, s) for n, w in _SMALL_BN_W for s in (3, 4, 5, 6)]
    if 16 < M <= 64:
        out += [cfg(32, n, bk, 1, w, s) for n, w in _MID_BN_W for s in (3, 4, 5)]
    if 32 < M <= 128:
        out += [cfg(64, n, bk, 1, w, s) for n, w in _BIG_BN_W for s in (3, 4)]
    if 64 < M <= 128:
        out += [cfg(128, n, bk, 1, w, s) for n, w in _BIG_BN_W for s in (3, 4)]
    if M > 128:
        out += [cfg(bm, n, bk, gm, w, s) for bm in (64, 128) for n, w in _BIG_BN_W
                for s in (3, 4) for gm in (8, 32)]
    if M >= 1024:
        out += [cfg(256, 128, bk, gm, 8, s) for s in (3, 4) for gm in (8, 32)]
    out.append(vllm_default_config(block_n, block_k))
    seen: set[tuple] = set()
    kept = []
    for c in out:
        key = tuple(c[k] for k in CONFIG_KEYS)
        if key in seen or smem_bytes(c) > smem_limit:
            continue
        seen.add(key)
        kept.append(c)
    return kept


def launch_ints(M: int, N: int, K: int, block_n: int, block_k: int) -> tuple[int, ...]:
    """The integer arguments vLLM passes the kernel for contiguous A (M,K), B (N,K), C (M,N),
    As (M, K/bk) and Bs (N/bn, K/bk): M, N, K, group_n, group_k and the ten strides."""
    kt = -(-K // block_k)
    return (M, N, K, block_n, block_k,
            K, 1,        # A: stride_am, stride_ak
            1, K,        # B: stride_bk = B.stride(1), stride_bn = B.stride(0)
            N, 1,        # C
            kt, 1,       # As: stride_As_m, stride_As_k
            1, kt)       # Bs: stride_Bs_k = Bs.stride(1), stride_Bs_n = Bs.stride(0)


def spec_key(M: int, N: int, K: int, block_n: int, block_k: int, c: dict) -> tuple:
    """What Triton compiles one variant for: the config plus, for every integer argument,
    whether it equals 1 (becomes a constant) and whether it is a multiple of 16."""
    ints = launch_ints(M, N, K, block_n, block_k)
    return (tuple(c[k] for k in CONFIG_KEYS), tuple((v == 1, v % 16 == 0) for v in ints))


@dataclass
class Plan:
    shapes: list[tuple[int, int]]
    block: tuple[int, int]
    batch_sizes: list[int]
    smem_limit: int
    candidates: dict[int, list[dict]]  # per M
    variants: int  # distinct compiled kernels

    @property
    def benchmarks(self) -> int:
        return len(self.shapes) * sum(len(c) for c in self.candidates.values())


def make_plan(shapes: Sequence[tuple[int, int]], block: tuple[int, int],
              batch_sizes: Sequence[int] = DEFAULT_BATCH_SIZES, smem_limit: int = H200_SMEM) -> Plan:
    bn, bk = block
    cands = {M: candidate_configs(M, bn, bk, smem_limit) for M in batch_sizes}
    keys = {spec_key(M, N, K, bn, bk, c) for (N, K) in shapes for M, cs in cands.items() for c in cs}
    return Plan(list(shapes), block, list(batch_sizes), smem_limit, cands, len(keys))


def describe_plan(plan: Plan, device_file_name: str | None = None, out_dir: str | None = None) -> str:
    bn, bk = plan.block
    lines = [f"block-FP8 tuning plan: {len(plan.shapes)} shape(s), block [{bn},{bk}], "
             f"batch sizes {','.join(map(str, plan.batch_sizes))}, shared-memory limit "
             f"{plan.smem_limit} B"]
    for M, cs in plan.candidates.items():
        lines.append(f"  M={M}: {len(cs)} candidate configs")
    lines.append(f"  {plan.benchmarks} timings, {plan.variants} Triton compilations")
    for N, K in plan.shapes:
        name = config_file_name(N, K, device_file_name or "<this GPU>", bn, bk)
        lines.append(f"  N={N},K={K} -> {os.path.join(out_dir, name) if out_dir else name}")
    return "\n".join(lines)


def write_config_file(out_dir: str | os.PathLike, N: int, K: int, device_file_name: str,
                      block: tuple[int, int], configs: dict[int, dict]) -> Path:
    """Write one file in vLLM's format (keys are batch sizes, ascending; 4-space indent)."""
    bn, bk = block
    validate_configs({str(m): c for m, c in configs.items()}, bk)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / config_file_name(N, K, device_file_name, bn, bk)
    body = {str(m): {k: int(configs[m][k]) for k in CONFIG_KEYS} for m in sorted(configs)}
    tmp = path.with_suffix(".json.tmp")
    with open(tmp, "w") as f:
        json.dump(body, f, indent=4)
        f.write("\n")
    os.replace(tmp, path)
    return path


def bundle_config_files(paths: Iterable[str | os.PathLike]) -> dict[str, dict]:
    """{file name: file content} for several config files: one plain-named JSON file that
    survives copying tools that mangle names with '=', ',' or '['."""
    return {Path(p).name: json.loads(Path(p).read_text()) for p in paths}


def unpack_config_bundle(bundle: dict[str, dict], dest: str | os.PathLike) -> list[Path]:
    """Write the files of :func:`bundle_config_files` into ``dest`` (checked, vLLM's format)."""
    from vllm_dualgpu.kernels.fp8_configs import DTYPE, parse_config_file_name

    checked = []
    for name, body in bundle.items():
        key = parse_config_file_name(name)
        if key is None or key.dtype != DTYPE or os.path.basename(name) != name:
            raise ValueError(f"{name!r} is not a block-FP8 config file name")
        checked.append((key, validate_configs(body, key.block_k)))
    return [write_config_file(dest, k.N, k.K, k.device_name, (k.block_n, k.block_k), c)
            for k, c in checked]


# ============================================================================================
# GPU: vLLM's kernel, inputs, timing
# ============================================================================================


def find_kernel():
    """vLLM's block-FP8 Triton kernel (a triton JITFunction), checked against KERNEL_PARAMS."""
    from vllm.model_executor.layers.quantization.utils import fp8_utils

    for name in KERNEL_NAMES:
        kernel = getattr(fp8_utils, name, None)
        if kernel is not None:
            break
    else:
        raise RuntimeError(f"vLLM's fp8_utils has none of {KERNEL_NAMES}: this vLLM is not supported")
    params = tuple(getattr(kernel, "arg_names", ()) or ())
    if not params:
        import inspect

        params = tuple(inspect.signature(getattr(kernel, "fn", kernel)).parameters)
    if params != KERNEL_PARAMS:
        raise RuntimeError(f"fp8_utils.{name} takes {params}, expected {KERNEL_PARAMS}")
    return kernel


def launch(kernel, A, B, As, Bs, C, block_n: int, block_k: int, config: dict) -> None:
    """One GEMM, launched exactly as vLLM's w8a8_triton_block_scaled_mm does, with ``config``."""
    M = A.numel() // A.shape[-1]
    N, K = B.shape
    grid = (-(-M // config["BLOCK_SIZE_M"]) * -(-N // config["BLOCK_SIZE_N"]),)
    kernel[grid](
        A, B, C, As, Bs, M, N, K, block_n, block_k,
        A.stride(-2), A.stride(-1), B.stride(1), B.stride(0), C.stride(-2), C.stride(-1),
        As.stride(-2), As.stride(-1), Bs.stride(1), Bs.stride(0),
        **config,
    )


def make_weight(N: int, K: int, block: tuple[int, int], device):
    import torch

    bn, bk = block
    fp8 = torch.finfo(torch.float8_e4m3fn)
    B = ((torch.rand(N, K, device=device) - 0.5) * 2 * fp8.max).clamp(fp8.min, fp8.max)
    B = B.to(torch.float8_e4m3fn)
    Bs = torch.rand(-(-N // bn), -(-K // bk), device=device, dtype=torch.float32) * 1e-2
    return B, Bs


def make_activation(M: int, K: int, block: tuple[int, int], device):
    import torch

    _, bk = block
    fp8 = torch.finfo(torch.float8_e4m3fn)
    A = ((torch.rand(M, K, device=device) - 0.5) * 2 * fp8.max).clamp(fp8.min, fp8.max)
    A = A.to(torch.float8_e4m3fn)
    As = torch.rand(M, -(-K // bk), device=device, dtype=torch.float32) * 1e-2
    return A, As


def device_facts(index: int | None = None) -> dict:
    import torch

    index = torch.cuda.current_device() if index is None else index
    p = torch.cuda.get_device_properties(index)
    name = torch.cuda.get_device_name(index)
    smem = 0
    try:  # the limit Triton itself enforces
        import triton

        smem = int(triton.runtime.driver.active.utils.get_device_properties(index)["max_shared_mem"])
    except Exception:  # noqa: BLE001
        smem = int(getattr(p, "shared_memory_per_block_optin", 0) or 0)
    return {
        "index": index,
        "name": name,
        "file_name": device_name_as_file_name(name),
        "capability": list(torch.cuda.get_device_capability(index)),
        "smem_optin": smem or 101376,
        "l2_bytes": int(getattr(p, "L2_cache_size", 0) or 0),
        "sms": int(p.multi_processor_count),
    }


def _do_bench(fn: Callable[[], None], warmup_ms: float, rep_ms: float) -> float:
    import triton.testing

    try:
        return float(triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))
    except TypeError:  # older Triton without return_mode
        return float(triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, quantiles=[0.5])[0])


# ---- parallel pre-compilation ----------------------------------------------------------------


def _precompile_chunk(task: tuple[int, list[tuple]]) -> tuple[int, int, str]:
    """Worker process: compile (not run) kernel variants into Triton's on-disk cache."""
    index, items = task
    import torch

    torch.cuda.set_device(index)
    kernel = find_kernel()
    dev = torch.device("cuda", index)
    # Real (tiny) tensors, so pointer specialization matches the real launches exactly.
    a = torch.empty(16, device=dev, dtype=torch.float8_e4m3fn)
    c = torch.empty(16, device=dev, dtype=torch.bfloat16)
    s = torch.empty(16, device=dev, dtype=torch.float32)
    ok = failed = 0
    last = ""
    for ints, config in items:
        try:
            kernel.warmup(a, a, c, s, s, *ints, grid=(1,), **config)
            ok += 1
        except Exception as exc:  # noqa: BLE001 - a config the card cannot compile is skipped
            failed += 1
            last = f"{exc.__class__.__name__}: {str(exc)[:200]}"
    return ok, failed, last


def precompile(plan: Plan, jobs: int, device_index: int, timeout_s: float,
               log: Callable[[str], None] = print) -> dict:
    """Compile every variant of ``plan`` in ``jobs`` processes (spawned; each holds a CUDA
    context), so the timing loop finds them in Triton's cache. Never raises: on any failure or
    after ``timeout_s`` the workers are terminated and the timing loop compiles what is left."""
    import multiprocessing as mp

    bn, bk = plan.block
    items: dict[tuple, tuple] = {}
    for N, K in plan.shapes:
        for M, cs in plan.candidates.items():
            for c in cs:
                items.setdefault(spec_key(M, N, K, bn, bk, c), (launch_ints(M, N, K, bn, bk), c))
    work = list(items.values())
    result = {"variants": len(work), "jobs": jobs, "compiled": 0, "failed": 0, "seconds": 0.0,
              "status": "skipped"}
    if jobs < 1 or not work:
        return result
    jobs = min(jobs, len(work))
    chunks = [(device_index, work[i::jobs]) for i in range(jobs)]
    start = time.monotonic()
    pool = None
    try:
        pool = mp.get_context("spawn").Pool(jobs)
        res = pool.map_async(_precompile_chunk, chunks)
        parts = res.get(timeout=timeout_s)
        result["compiled"] = sum(p[0] for p in parts)
        result["failed"] = sum(p[1] for p in parts)
        result["status"] = "done"
        last = next((p[2] for p in parts if p[2]), "")
        if last:
            result["last_failure"] = last
    except mp.TimeoutError:
        result["status"] = f"timed out after {timeout_s:.0f} s"
    except Exception as exc:  # noqa: BLE001
        result["status"] = f"failed: {exc.__class__.__name__}: {str(exc)[:300]}"
    finally:
        if pool is not None:
            pool.terminate()
            pool.join()
    result["seconds"] = round(time.monotonic() - start, 1)
    log(f"precompile: {result['compiled']} of {len(work)} variants in {result['seconds']} s "
        f"with {jobs} processes ({result['status']})")
    return result


# ---- tuning ----------------------------------------------------------------------------------


@dataclass
class ShapeResult:
    N: int
    K: int
    configs: dict[int, dict]
    tuned_us: dict[int, float]
    default_us: dict[int, float]
    tried: dict[int, int]
    capped: bool = False
    seconds: float = 0.0


def tune_shape(kernel, N: int, K: int, block: tuple[int, int], batch_sizes: Sequence[int],
               smem_limit: int, *, time_cap_s: float = 120.0, quick_ms: float = 6.0,
               full_ms: float = 30.0, finalists: int = 3,
               on_candidate: Callable[[int], None] | None = None,
               log: Callable[[str], None] = print) -> ShapeResult:
    """Best config per batch size for one weight shape on the current GPU.

    Pass 1 times every candidate briefly, pass 2 the best ``finalists`` longer; the median of
    do_bench (L2 flushed before each run) decides. After ``time_cap_s`` the remaining batch
    sizes only compare vLLM's default with the previous bucket's winner, so a shape never takes
    much longer than its cap.
    """
    import torch

    dev = torch.device("cuda", torch.cuda.current_device())
    bn, bk = block
    B, Bs = make_weight(N, K, block, dev)
    default = vllm_default_config(bn, bk)
    start = time.monotonic()
    res = ShapeResult(N, K, {}, {}, {}, {})
    prev_best: dict | None = None
    for M in batch_sizes:
        A, As = make_activation(M, K, block, dev)
        C = torch.empty(M, N, device=dev, dtype=torch.bfloat16)
        cands = candidate_configs(M, bn, bk, smem_limit)
        if time.monotonic() - start > time_cap_s:
            res.capped = True
            cands = [default] + ([prev_best] if prev_best and prev_best != default else [])
        timings: list[tuple[float, dict]] = []
        failures = 0
        for c in cands:
            try:
                t = _do_bench(lambda c=c: launch(kernel, A, B, As, Bs, C, bn, bk, c), 1, quick_ms)
                timings.append((t, c))
            except Exception as exc:  # noqa: BLE001 - out of resources, compile error
                failures += 1
                if failures == 1:
                    log(f"  N={N},K={K},M={M}: skipped a config ({exc.__class__.__name__}: "
                        f"{str(exc).splitlines()[0][:160] if str(exc) else ''})")
            if on_candidate:
                on_candidate(1)
        if not timings:
            raise RuntimeError(f"no candidate config ran for N={N},K={K},M={M}")
        timings.sort(key=lambda tc: tc[0])
        finals = [c for _, c in timings[:finalists]]
        if default not in finals and any(c == default for _, c in timings):
            finals.append(default)
        measured = [(_do_bench(lambda c=c: launch(kernel, A, B, As, Bs, C, bn, bk, c), 2, full_ms), c)
                    for c in finals]
        measured.sort(key=lambda tc: tc[0])
        best_t, best = measured[0]
        res.configs[M] = dict(best)
        res.tuned_us[M] = round(best_t * 1000, 3)
        dflt = [t for t, c in measured if c == default]
        if dflt:
            res.default_us[M] = round(dflt[0] * 1000, 3)
        res.tried[M] = len(timings)
        prev_best = best
        del A, As, C
    res.seconds = round(time.monotonic() - start, 1)
    del B, Bs
    torch.cuda.empty_cache()
    return res


def tune(shapes: Sequence[tuple[int, int]], block: tuple[int, int],
         batch_sizes: Sequence[int] = DEFAULT_BATCH_SIZES, *, out_dir: str | os.PathLike,
         jobs: int = 0, time_cap_s: float = 120.0, precompile_timeout_s: float = 180.0,
         progress: bool = True, log: Callable[[str], None] = print) -> dict:
    """Tune every shape on the current GPU and write one file per shape into ``out_dir``."""
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("no CUDA GPU visible: tuning needs the GPU the configs are for")
    torch.cuda.init()
    facts = device_facts()
    kernel = find_kernel()
    plan = make_plan(shapes, block, batch_sizes, facts["smem_optin"])
    log(describe_plan(plan, facts["file_name"], str(out_dir)))
    pre = precompile(plan, jobs, facts["index"], precompile_timeout_s, log) if jobs > 0 else None

    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=plan.benchmarks, desc="tune-fp8", unit="cfg", file=sys.stderr,
                   mininterval=1.0, dynamic_ncols=True)
    results: list[ShapeResult] = []
    written: list[str] = []
    t0 = time.monotonic()
    try:
        for N, K in shapes:
            if bar is not None:
                bar.set_postfix_str(f"N={N},K={K}")
            r = tune_shape(kernel, N, K, block, batch_sizes, facts["smem_optin"],
                           time_cap_s=time_cap_s, on_candidate=bar.update if bar else None,
                           log=(bar.write if bar else log))
            results.append(r)
            path = write_config_file(out_dir, N, K, facts["file_name"], block, r.configs)
            written.append(str(path))
            msg = (f"N={N},K={K}: {r.seconds} s{' (time cap reached)' if r.capped else ''}; "
                   + ", ".join(f"M={m} {r.tuned_us[m]:.1f}us"
                               + (f" (default {r.default_us[m]:.1f})" if m in r.default_us else "")
                               for m in batch_sizes))
            (bar.write if bar else log)(msg)
    finally:
        if bar is not None:
            bar.close()
    return {
        "device": facts,
        "block": list(block),
        "batch_sizes": list(batch_sizes),
        "plan": {"benchmarks": plan.benchmarks, "variants": plan.variants},
        "precompile": pre,
        "seconds": round(time.monotonic() - t0, 1),
        "files": written,
        "shapes": [r.__dict__ for r in results],
    }


# ---- default vs tuned, weights rotated past L2 -------------------------------------------------


def _graph_or_loop(fns: list[Callable[[], None]]):
    """A callable replaying ``fns`` once each: a CUDA graph when capture works, else a loop."""
    import torch

    for f in fns:
        f()
    torch.cuda.synchronize()
    try:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for f in fns:
                f()
        torch.cuda.synchronize()
        return g.replay, True
    except Exception:  # noqa: BLE001
        torch.cuda.synchronize()

        def loop():
            for f in fns:
                f()

        return loop, False


def time_rotating(a: Callable[[], None], b: Callable[[], None], per_call: int,
                  reps: int) -> tuple[list[float], list[float]]:
    """Interleaved timings (ms per GEMM) of two replays that each run ``per_call`` GEMMs."""
    import torch

    ta, tb = [], []
    s1, e1, s2, e2 = (torch.cuda.Event(enable_timing=True) for _ in range(4))
    for _ in range(3):
        a()
        b()
    for _ in range(reps):
        s1.record(); a(); e1.record()  # noqa: E702
        s2.record(); b(); e2.record()  # noqa: E702
        torch.cuda.synchronize()
        ta.append(s1.elapsed_time(e1) / per_call)
        tb.append(s2.elapsed_time(e2) / per_call)
    return ta, tb


def bench_default_vs_tuned(shapes: Sequence[tuple[int, int]], tuned: dict[tuple[int, int], dict[int, dict]],
                           block: tuple[int, int], batch_sizes: Sequence[int] = BENCH_BATCH_SIZES, *,
                           reps: int = 30, l2_factor: float = 4.0, time_cap_s: float = 60.0,
                           log: Callable[[str], None] = print) -> list[dict]:
    """GEMM time with vLLM's default config vs the tuned one for each shape and batch size.

    Each replay runs the GEMM over ``copies`` different weight/activation/output sets whose
    weights together exceed ``l2_factor`` x the L2 cache, so every GEMM reads its weights from
    HBM as in a real forward pass (inside a CUDA graph, as vLLM decodes). The two configs are
    replayed alternately ``reps`` times; medians are reported.
    """
    import torch

    kernel = find_kernel()
    facts = device_facts()
    l2 = facts["l2_bytes"] or H200_L2
    dev = torch.device("cuda", facts["index"])
    bn, bk = block
    default = vllm_default_config(bn, bk)
    rows: list[dict] = []
    for N, K in shapes:
        start = time.monotonic()
        copies = max(2, min(16, math.ceil(l2_factor * l2 / (N * K))))
        weights = [make_weight(N, K, block, dev) for _ in range(copies)]
        for M in batch_sizes:
            if time.monotonic() - start > time_cap_s:
                log(f"  N={N},K={K}: time cap reached, M={M} not measured")
                rows.append({"N": N, "K": K, "M": M, "skipped": "time cap"})
                continue
            acts = [make_activation(M, K, block, dev) for _ in range(copies)]
            outs_d = [torch.empty(M, N, device=dev, dtype=torch.bfloat16) for _ in range(copies)]
            outs_t = [torch.empty(M, N, device=dev, dtype=torch.bfloat16) for _ in range(copies)]
            tcfg = pick_config(tuned[(N, K)], M)

            def fns(c, outs):
                return [lambda i=i: launch(kernel, acts[i][0], weights[i][0], acts[i][1], weights[i][1],
                                           outs[i], bn, bk, c) for i in range(copies)]

            run_d, graph_d = _graph_or_loop(fns(default, outs_d))
            run_t, graph_t = _graph_or_loop(fns(tcfg, outs_t))
            td, tt = time_rotating(run_d, run_t, copies, reps)
            ref = outs_d[0].float()
            diff = (outs_t[0].float() - ref).abs().max().item() / max(ref.abs().max().item(), 1e-30)
            md, mt = statistics.median(td), statistics.median(tt)
            flops = 2.0 * M * N * K
            row = {
                "N": N, "K": K, "M": M, "copies": copies, "cuda_graph": graph_d and graph_t,
                "default_us": round(md * 1000, 2), "tuned_us": round(mt * 1000, 2),
                "speedup": round(md / mt, 3),
                "default_tflops": round(flops / (md * 1e-3) / 1e12, 1),
                "tuned_tflops": round(flops / (mt * 1e-3) / 1e12, 1),
                "default_us_p10_p90": [round(1000 * _q(td, 0.1), 2), round(1000 * _q(td, 0.9), 2)],
                "tuned_us_p10_p90": [round(1000 * _q(tt, 0.1), 2), round(1000 * _q(tt, 0.9), 2)],
                "tuned_config": tcfg,
                "max_rel_diff_vs_default": float(f"{diff:.3g}"),
            }
            rows.append(row)
            log(f"  N={N},K={K},M={M}: default {row['default_us']}us, tuned {row['tuned_us']}us "
                f"(x{row['speedup']}), rel. diff {row['max_rel_diff_vs_default']}")
            del acts, outs_d, outs_t, run_d, run_t
        del weights
        torch.cuda.empty_cache()
    return rows


def _q(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


def bench_table(rows: list[dict]) -> str:
    out = ["| N | K | M | default µs | tuned µs | speedup | tuned config (BM,BN,BK,GM,warps,stages) |",
           "|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        if "skipped" in r:
            out.append(f"| {r['N']} | {r['K']} | {r['M']} | - | - | - | {r['skipped']} |")
            continue
        c = r["tuned_config"]
        cs = ",".join(str(c[k]) for k in CONFIG_KEYS)
        out.append(f"| {r['N']} | {r['K']} | {r['M']} | {r['default_us']} | {r['tuned_us']} | "
                   f"{r['speedup']:.2f}x | {cs} |")
    return "\n".join(out) + "\n"
