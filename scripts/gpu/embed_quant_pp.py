#!/usr/bin/env python3
"""A Qwen3.5 checkpoint with an INT8-packed embedding, served with PP=2 (issue #6 item 4).

    python scripts/gpu/embed_quant_pp.py OUTDIR [--timeout S] [--dry-run]

Why: vLLM 0.30 builds the Qwen3-Next/Qwen3.5 ``embed_tokens`` (and the MTP predictors') without
``quant_config``, so a compressed-tensors checkpoint whose embedding is group-quantized INT
(pack-quantized, loaded by ``CompressedTensorsEmbeddingWNA16Int``,
layers/quantization/compressed_tensors/compressed_tensors_embedding.py) fails to load: the
dense table has no ``weight_packed``. The plugin's ``qwen3-next-embed-quant-config`` patch
gives these embeddings the model's quant_config in dualgpu runs. This script shows it on GPUs.

Models: make_model's ``small-hybrid`` (Qwen3.5 text, 6 Gated DeltaNet + 2 attention layers, one
MTP layer, vocab 4096, hidden 512) with seeded random weights, written twice from the same
weights. ``OUTDIR/quantized/``: ``model.embed_tokens`` stored as compressed-tensors
pack-quantized INT8, groups of 128, symmetric (``weight_packed`` int32 with 4 values a word,
value c at bits 8*(c % 4) of word c // 4, stored + 128, as ``_dequant_gather_kernel`` unpacks
them and compressed-tensors' ``pack_to_int32`` packs them; ``weight_scale`` bf16 [vocab, 4];
``weight_shape``), and a ``quantization_config`` whose one config group targets
``re:.*embed_tokens$`` (every Linear stays bf16; lm_head ignored). A Qwen3.5 checkpoint holds
one embedding: the MTP predictor loads ``model.embed_tokens`` too (qwen3_5_mtp.py,
``Qwen3_5MTP.load_weights`` keeps names containing embed_tokens), so it gets the packed one.
``OUTDIR/dense/``: the same checkpoint with the dequantized table as a bf16 ``weight``, computed
as the kernel computes a row: int -> float32, times the bf16 scale as float32, cast to bf16.
The scales are powers of two, so each product is exact in bf16 and the cast cannot round:
both checkpoints embed every token to bitwise the same vector, whatever the rounding mode.

Arms, each one ``vllm.LLM`` (PP=2 with layers 4/4 pinned by VLLM_PP_LAYER_PARTITION in every arm,
real weights, MTP with 2 speculative tokens, enforce_eager, gpu_memory_utilization 0.3,
Triton GDN prefill, split-K GEMMs off as in e2e_correctness.py) in a child process in its own
process group, logging to OUTDIR/<arm>-llm.log, result in OUTDIR/<arm>-child.json:
``plugin-quantized`` (dualgpu executor, quantized checkpoint), ``plugin-dense`` (dualgpu, dense:
the reference tokens), ``stock-quantized`` ("mp", quantized: expected to fail while loading with
vLLM's "There is no module or parameter named '...embed_tokens.weight_packed'"; the packed
names are accepted in any order). The two plugin arms generate greedily for 4 token-id prompts
(32 tokens, top-2 logprobs), then ``collective_rpc`` reads in every worker: the target's
``embed_tokens`` (class of its quant_method, parameter names and bytes), the MTP drafter's on
the last rank (and whether it is the target's module) and the SHA-256 of the whole table as
the module looks it up on that rank (the Triton kernel for the packed one).
``--timeout`` (default 480 s) is for the three arms together; an arm keeps ARM_MIN_S for the
arms after it. Boots seen on 2 x H200 right after staging: 208, 104 and 92 s (the first arm
compiles the JIT caches; with 260 s for all three, every arm ran out of time).

Checks: the quantized arm generated; both ranks' target embedding is
``CompressedTensorsEmbeddingWNA16Int`` without a dense ``weight``; each rank's embedding bytes
are the packed size (int8: half a bf16 table's bytes, plus the scales; both numbers recorded);
the MTP drafter on the last rank looks up the target's packed module; every rank's lookup equals
the dense table bitwise; the workers' plugin lines list the patch as applied; the quantized
tokens equal the dense arm's token for token (mismatches recorded with the logprob gaps there);
stock refused with the weight_packed message and did not generate. Results in
OUTDIR/embed_quant_pp.json, a one-line summary on stdout; exit code 0 only if the checks hold.

``--dry-run`` (no GPU; sets VLLM_TARGET_DEVICE=cpu) writes both checkpoints and checks on the
CPU: the packed words round-trip through a torch mirror of the kernel's bit logic and equal
compressed-tensors' own packing, the dense table equals the dequantized packed table bitwise,
vLLM's kernel source run by Triton's interpreter gives the same rows (when Triton is installed;
the interpreter truncates float32 -> bf16 where GPUs round to nearest even: exact products agree),
vLLM's CompressedTensorsConfig built from the written config (quantized embeddings for the
target and MTP prefixes, unquantized Linear layers and lm_head), and every arm's
``EngineArgs(...).create_engine_config()`` (with the plugin's preflight for the dualgpu arms).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from gpurun import (  # noqa: E402
    applied_names, arms_main, attempt, gdn_prefill_config, kill_running_on_exit, registry_entry, run_child,
    workers_by_rank, write_child_result,
)
from spec_decode_pp import NUM_SPEC, _cpu_inspection_shim  # noqa: E402

PATCH = "qwen3-next-embed-quant-config"
PRESET, SEED = "small-hybrid", 0
EMBED = "model.embed_tokens"  # the checkpoint's one embedding; the MTP predictor loads it too
BITS, GROUP = 8, 128
PACK = 32 // BITS  # values per int32 word
OFFSET = 1 << (BITS - 1)  # stored value = q + OFFSET
QMAX = OFFSET - 1
EMBED_METHOD = "CompressedTensorsEmbeddingWNA16Int"
QUANT_CONFIG = {
    "quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
    "config_groups": {"embeddings": {"targets": ["re:.*embed_tokens$"], "weights": {
        "num_bits": BITS, "type": "int", "symmetric": True, "strategy": "group", "group_size": GROUP,
        "dynamic": False, "actorder": None, "observer": "minmax"}}},
    "ignore": ["lm_head"],
}
ARMS = {"plugin-quantized": ("dualgpu", "quantized"), "plugin-dense": ("dualgpu", "dense"),
        "stock-quantized": ("mp", "quantized")}  # arm -> (executor, checkpoint)
ARM_MIN_S = {"plugin-quantized": 120, "plugin-dense": 110, "stock-quantized": 100}
PARTITION = "4,4"  # the same layer split in every arm
CHILD_ENV = {"VLLM_ALLOW_INSECURE_SERIALIZATION": "1",  # collective_rpc with a function
             "VLLM_PP_LAYER_PARTITION": PARTITION,
             "CUBLAS_WORKSPACE_CONFIG": ":16:8", "CUBLASLT_WORKSPACE_SIZE": "1"}
MAX_TOKENS, LOGPROBS = 32, 2
# vLLM's AutoWeightsLoader (model_executor/models/utils.py) on stock's dense table.
STOCK_REFUSAL = r"There is no module or parameter named '[\w.]*embed_tokens\.weight_(?:packed|scale|shape)'"


def model_config() -> dict:
    from make_model import PRESETS

    return PRESETS[PRESET]()


def prompts() -> list[list[int]]:
    def ids(start: int, n: int) -> list[int]:
        return [3 + (start + 7 * i) % 4000 for i in range(n)]

    return [ids(11, 24), ids(500, 90), ids(1234, 300), ids(2345, 700)]


# --- the packed format: quantize, pack, and the kernel's unpack and dequantization ---------------


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


def pack(q):
    """int values [vocab, hidden] -> int32 words [vocab, hidden // PACK]."""
    import torch

    v, h = q.shape
    shifts = torch.arange(PACK, dtype=torch.int64) * BITS
    words = ((q.to(torch.int64) + OFFSET).reshape(v, h // PACK, PACK) << shifts).sum(-1)
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


def checkpoint_dirs(out: Path) -> dict[str, Path]:
    """The two checkpoints' folders: OUTDIR/dense and OUTDIR/quantized."""
    return {"dense": out / "dense", "quantized": out / "quantized"}


def write_checkpoints(out: Path) -> dict[str, Path]:
    """OUTDIR/dense and OUTDIR/quantized from one set of seeded weights (written once)."""
    import torch
    from make_model import write_random_weights
    from safetensors.torch import load_file, save_file

    cfg = model_config()
    dirs = checkpoint_dirs(out)
    dense, quant = dirs["dense"], dirs["quantized"]
    if (quant / "config.json").exists():
        return dirs
    shutil.rmtree(dense, ignore_errors=True)
    shutil.rmtree(quant, ignore_errors=True)
    write_random_weights(dense, cfg, SEED)
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
    (quant / "config.json").write_text(json.dumps({**cfg, "quantization_config": QUANT_CONFIG}, indent=1))
    return dirs


def expected_facts(dirs: dict[str, Path]) -> dict:
    """What the GPU run should show, from the files: sizes and the dense table's digest."""
    from safetensors import safe_open

    with safe_open(str(dirs["quantized"] / "model.safetensors"), "pt") as f:
        params = {n: f.get_tensor(f"{EMBED}.{n}") for n in ("weight_packed", "weight_scale", "weight_shape")}
    nbytes = {n: t.numel() * t.element_size() for n, t in params.items()}
    with safe_open(str(dirs["dense"] / "model.safetensors"), "pt") as f:
        table = f.get_tensor(f"{EMBED}.weight")
    return {"vocab": table.shape[0], "hidden": table.shape[1], "param_bytes": nbytes,
            "embedding_bytes": sum(nbytes.values()), "bf16_table_bytes": table.numel() * 2,
            "dense_table_sha256": table_sha256(table)}


def engine_kwargs(model: Path, arm: str) -> dict:
    return dict(model=str(model), load_format="auto", skip_tokenizer_init=True, pipeline_parallel_size=2,
                distributed_executor_backend=ARMS[arm][0],
                speculative_config={"method": "mtp", "num_speculative_tokens": NUM_SPEC},
                enforce_eager=True, max_model_len=4096, gpu_memory_utilization=0.3, seed=0,
                additional_config=gdn_prefill_config())


# --- dry run (CPU) -----------------------------------------------------------------------------


def kernel_rows(packed, scale, ids):
    """vLLM's ``_dequant_gather_kernel`` source, run by Triton's interpreter on the CPU (vLLM
    itself disables Triton without a GPU driver), for the rows ``ids``."""
    import ast

    import torch
    import vllm.model_executor.layers.quantization.compressed_tensors as ct

    path = Path(ct.__file__).parent / "compressed_tensors_embedding.py"
    tree = ast.parse(path.read_text())
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "_dequant_gather_kernel")
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"  # read when triton.jit wraps the function
    try:
        import triton
        import triton.language as tl

        ns = {"triton": triton, "tl": tl}
        exec(compile(ast.Module([fn], []), str(path), "exec"), ns)
    finally:
        if old is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = old
    hidden, groups = packed.shape[1] * PACK, scale.shape[1]
    out = torch.empty(len(ids), hidden, dtype=scale.dtype)
    ns["_dequant_gather_kernel"][(len(ids), 1)](  # the arguments _dequant_gather_triton passes
        ids, packed, scale, out, hidden, packed.shape[1], groups, NUM_BITS=BITS, PACK_FACTOR=PACK,
        GROUP_SIZE=0 if groups == 1 else hidden // groups, BLOCK=min(1 << (hidden - 1).bit_length(), 1024))
    return out


def dry_run(out: Path, dirs: dict[str, Path]) -> int:
    import importlib.util

    shim = _cpu_inspection_shim()
    os.environ.setdefault("VLLM_PP_LAYER_PARTITION", PARTITION)  # the arms' split, for preflight
    res: dict = {"mode": "dry-run", "shim": shim, "expected": expected_facts(dirs)}

    def packing():
        import torch
        from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
        from safetensors.torch import load_file

        qt = load_file(str(dirs["quantized"] / "model.safetensors"))
        dn = load_file(str(dirs["dense"] / "model.safetensors"))
        packed, scale = qt[f"{EMBED}.weight_packed"], qt[f"{EMBED}.weight_scale"]
        hidden = int(qt[f"{EMBED}.weight_shape"][1])
        q = unpack(packed, hidden)
        table = dn[f"{EMBED}.weight"]
        same = sorted(k for k in dn if k in qt and torch.equal(dn[k], qt[k]))
        facts = {"packed": [str(packed.dtype), list(packed.shape)], "scale": [str(scale.dtype), list(scale.shape)],
                 "shape": qt[f"{EMBED}.weight_shape"].tolist(), "q_range": [int(q.min()), int(q.max())],
                 "repack_equal": torch.equal(pack(q), packed),
                 "compressed_tensors_pack_equal": torch.equal(pack_to_int32(q.to(torch.int8), BITS), packed),
                 "dense_equals_dequantized": torch.equal(table.view(torch.int16),
                                                         dequantize(packed, scale, hidden).view(torch.int16)),
                 "other_tensors_equal": len(same) == len(dn) - 1 == len(qt) - 3,
                 "only_embedding_differs": sorted(set(dn) ^ set(qt))}
        if importlib.util.find_spec("triton") is None:
            facts["kernel"] = {"skipped": "triton not installed"}
        else:
            ids = torch.tensor(sorted({0, 1, len(table) - 1, *range(5, len(table), 97)}))
            rows = kernel_rows(packed, scale, ids)
            same = torch.equal(rows.view(torch.int16), table[ids].view(torch.int16))
            facts["kernel"] = {"rows": len(ids), "equal": same}
        return facts

    def quant_config():
        from torch import nn
        from vllm.config import VllmConfig
        from vllm.engine.arg_utils import EngineArgs
        from vllm.model_executor.layers.linear import ColumnParallelLinear, QKVParallelLinear
        from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

        cfg = EngineArgs(**engine_kwargs(dirs["quantized"], "plugin-quantized")).create_engine_config()
        qc = VllmConfig._get_quantization_config(cfg.model_config, cfg.load_config)  # as the workers build it

        def method(cls, prefix):
            layer = cls.__new__(cls)  # get_quant_method looks at the class and the prefix only
            nn.Module.__init__(layer)
            m = qc.get_quant_method(layer, prefix)
            return type(m).__name__ if m is not None else None

        return {"class": type(qc).__name__ if qc is not None else None,
                "model_quantization": cfg.model_config.quantization,
                "draft_quantization": cfg.speculative_config.draft_model_config.quantization,
                "methods": {p: method(c, p) for c, p in (
                    (VocabParallelEmbedding, EMBED), (VocabParallelEmbedding, "mtp.embed_tokens"),
                    (ParallelLMHead, "lm_head"), (QKVParallelLinear, "model.layers.3.self_attn.qkv_proj"),
                    (ColumnParallelLinear, "mtp.fc"))}}

    def engine(arm):
        from vllm.engine.arg_utils import EngineArgs

        cfg = EngineArgs(**engine_kwargs(dirs[ARMS[arm][1]], arm)).create_engine_config()
        mc, spec = cfg.model_config, cfg.speculative_config
        backend = cfg.parallel_config.distributed_executor_backend
        facts = {"architectures": mc.architectures, "is_hybrid": mc.is_hybrid, "quantization": mc.quantization,
                 "executor": getattr(backend, "__name__", str(backend)),
                 "pp": cfg.parallel_config.pipeline_parallel_size,
                 "spec_method": spec.method if spec else None, "vocab": mc.get_vocab_size(),
                 "draft_architectures": spec.draft_model_config.architectures if spec else None,
                 "enforce_eager": mc.enforce_eager, "max_model_len": mc.max_model_len}
        if ARMS[arm][0] == "dualgpu":
            from vllm_dualgpu.engine import preflight

            facts["preflight_warnings"] = preflight.check(cfg, 2)  # raises if refused
        return facts

    res["packing"] = attempt(packing)
    res["quant_config"] = attempt(quant_config)
    res["engine"] = {arm: attempt(lambda a=arm: engine(a)) for arm in ARMS}
    res["patch"] = attempt(lambda: registry_entry(PATCH))
    p, qc, e = res["packing"], res["quant_config"], res["engine"]
    methods = qc.get("methods", {})
    checks = {
        "pack/unpack round-trips (kernel bit logic, compressed-tensors' packing)": p.get("repack_equal") is True
        and p.get("compressed_tensors_pack_equal") is True and p.get("q_range", [0])[0] >= -OFFSET,
        "dense table equals the dequantized packed table bitwise": p.get("dense_equals_dequantized") is True,
        "only the embedding differs between the checkpoints": p.get("other_tensors_equal") is True,
        "vLLM's CompressedTensorsConfig quantizes only the embeddings": qc.get("class") == "CompressedTensorsConfig"
        and methods.get(EMBED) == EMBED_METHOD and methods.get("mtp.embed_tokens") == EMBED_METHOD
        and methods.get("lm_head") is None and qc.get("draft_quantization") == "compressed-tensors"
        and all(methods.get(k) == "UnquantizedLinearMethod" for k in ("model.layers.3.self_attn.qkv_proj", "mtp.fc")),
        "engine configs build (dualgpu preflight accepts)": all(
            "error" not in f and f.get("pp") == 2 and f.get("spec_method") == "mtp" for f in e.values())
        and [e[a].get("executor") for a in ARMS] == ["DualGpuExecutor", "DualGpuExecutor", "mp"],
        "quantization per arm": [e[a].get("quantization") for a in ARMS]
        == ["compressed-tensors", None, "compressed-tensors"],
        "prompts fit the vocab and the context": all(max(x) < e["plugin-dense"].get("vocab", 0) for x in prompts())
        and max(map(len, prompts())) + MAX_TOKENS + NUM_SPEC <= e["plugin-dense"].get("max_model_len", 0),
        "patch entry targets VocabParallelEmbedding.__init__": res["patch"].get("target_exists") is True,
    }
    if "equal" in (p.get("kernel") or {}):
        checks["vLLM's kernel (Triton interpreter) gives the dense rows"] = p["kernel"]["equal"] is True
    res["checks"], res["ok"] = checks, all(checks.values())
    (out / "embed_quant_pp.json").write_text(json.dumps(res, indent=1, default=str))
    print(json.dumps(res, default=str))
    return 0 if res["ok"] else 1


# --- child: vLLM itself ------------------------------------------------------------------------


def embed_facts(module) -> dict:
    params = list(module.named_parameters())
    method = getattr(module, "quant_method", None)
    return {"class": type(module).__name__, "quant_method": type(method).__name__ if method is not None else None,
            "params": {n: [str(p.dtype).replace("torch.", ""), list(p.shape)] for n, p in params},
            "bytes": sum(p.numel() * p.element_size() for _, p in params),
            "has_weight": any(n == "weight" for n, _ in params)}


def probe_worker(worker) -> dict:
    """Runs inside each worker (collective_rpc): the embeddings this rank holds and looks up."""
    import torch
    from vllm.distributed.parallel_state import get_pp_group

    runner = worker.model_runner
    target = runner.model
    language = target.get_language_model() if hasattr(target, "get_language_model") else target
    embed = getattr(getattr(language, "model", None), "embed_tokens", None)
    facts = {"pp_rank": get_pp_group().rank_in_group, "pid": os.getpid(), "cuda_device": torch.cuda.current_device(),
             "runner": type(runner).__name__, "use_v2_model_runner": bool(worker.vllm_config.use_v2_model_runner),
             "allocated": torch.cuda.memory_allocated(), "reserved": torch.cuda.memory_reserved(),
             "target": embed_facts(embed) if embed is not None else None}
    if embed is not None and facts["target"]["class"] != "PPMissingLayer":
        try:  # the whole table as this rank's module looks it up (the Triton kernel when packed)
            vocab = worker.vllm_config.model_config.get_vocab_size()
            with torch.inference_mode():
                table = embed(torch.arange(vocab, device=torch.device("cuda", torch.cuda.current_device())))
            facts["lookup"] = {"shape": list(table.shape), "dtype": str(table.dtype), "sha256": table_sha256(table)}
        except Exception as exc:
            facts["lookup"] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
    holder = getattr(runner, "speculator", None) or getattr(runner, "drafter", None)  # V2 / V1 runner
    drafter = getattr(holder, "model", None)
    if drafter is not None:
        d_embed = getattr(getattr(drafter, "model", None), "embed_tokens", None)
        facts["drafter"] = type(drafter).__name__
        facts["drafter_embed"] = embed_facts(d_embed) if d_embed is not None else None
        facts["drafter_embed_is_target_embed"] = d_embed is not None and d_embed is embed
    return facts


def child(out: Path, dirs: dict[str, Path], arm: str) -> int:
    t0, res = time.time(), {"arm": arm, "booted": False}
    try:
        from e2e_correctness import token_logprobs
        from vllm import LLM, SamplingParams

        llm = LLM(**engine_kwargs(dirs[ARMS[arm][1]], arm))
        res.update(booted=True, boot_s=round(time.time() - t0, 1))
        sp = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, detokenize=False, logprobs=LOGPROBS)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts()], sp, use_tqdm=False)
        res["outputs"] = [list(o.outputs[0].token_ids) for o in outs]
        res["logprobs"] = [token_logprobs(o.outputs[0]) for o in outs]
        res["workers"] = llm.collective_rpc(probe_worker, timeout=60)
    except Exception as exc:
        res["error"] = f"{type(exc).__name__}: {exc}"[:2000]
    write_child_result(out, arm, res, t0)
    return 0


# --- parent: process groups, log lines, checks -------------------------------------------------


def run_arm(out: Path, dirs: dict[str, Path], arm: str, timeout: float) -> dict:
    from gpurun import grep

    res: dict = {"engine_kwargs": {**engine_kwargs(dirs[ARMS[arm][1]], arm), "model": f"OUTDIR/{ARMS[arm][1]}"},
                 "env": CHILD_ENV, "time_limit_s": round(timeout, 1), "log": f"{arm}-llm.log"}
    res.update(run_child(Path(__file__).resolve(), out, arm, timeout, env=CHILD_ENV, sample_memory=True))
    res["refusal_lines"] = [line[-400:] for line in grep(out / res["log"], STOCK_REFUSAL)][:8]
    return res


def generated(res: dict) -> bool:
    c = res.get("child") or {}
    outs = c.get("outputs") or []
    return "error" not in c and len(outs) == len(prompts()) and all(len(o) == MAX_TOKENS for o in outs)


def checks(arms: dict, expected: dict) -> dict:
    q, d, s = arms["plugin-quantized"], arms["plugin-dense"], arms["stock-quantized"]
    w = workers_by_rank(q)
    targets = [x.get("target") or {} for x in w.values()]
    last = w.get(max(w)) if w else {}
    drafter_embed = last.get("drafter_embed") or {}
    lines = [l for l in q.get("plugin_lines", []) if re.search(r"\(worker[,+ ]", l)]
    sc = s.get("child") or {}
    return {
        "quantized arm generated": generated(q),
        "two ranks probed": sorted(w) == [0, 1],
        f"every rank's target embedding is {EMBED_METHOD}, no dense weight": len(targets) == 2
        and all(t.get("quant_method") == EMBED_METHOD and t.get("has_weight") is False for t in targets),
        "embedding bytes per rank are the packed size": len(targets) == 2
        and all(t.get("bytes") == expected["embedding_bytes"] for t in targets),
        "MTP drafter on the last rank looks up the target's packed embedding":
        last.get("drafter_embed_is_target_embed") is True and drafter_embed.get("quant_method") == EMBED_METHOD,
        "every rank's packed lookup equals the dense table bitwise": len(w) == 2
        and all((x.get("lookup") or {}).get("sha256") == expected["dense_table_sha256"] for x in w.values()),
        f"workers applied {PATCH}": len(lines) >= 2 and all(PATCH in applied_names(l) for l in lines),
        "quantized tokens equal the dense arm's": generated(q) and generated(d)
        and q["child"]["outputs"] == d["child"]["outputs"],
        "stock refused with the weight_packed message": (bool(s.get("refusal_lines"))
                                                         or bool(re.search(STOCK_REFUSAL, sc.get("error") or "")))
        and bool(sc) and not sc.get("outputs"),
    }


def token_comparison(arms: dict) -> dict | None:
    """Where the quantized tokens leave the dense ones, with both runs' logprob gaps there."""
    from e2e_correctness import compare

    q, d = (arms[a].get("child") or {} for a in ("plugin-quantized", "plugin-dense"))
    if not (q.get("outputs") and d.get("outputs")):
        return None
    return compare(d["outputs"], q["outputs"], d.get("logprobs"), q.get("logprobs"), strict=True)


def summary_of(res: dict) -> dict:
    w = workers_by_rank(res)
    return {"wall_s": res.get("wall_s"), "timed_out": res.get("timed_out"),
            "boot_s": (res.get("child") or {}).get("boot_s"),
            "error": (res.get("child") or {}).get("error", None if res.get("child") else "no result"),
            "embedding_bytes": {r: (x.get("target") or {}).get("bytes") for r, x in sorted(w.items())},
            "embed_method": {r: (x.get("target") or {}).get("quant_method") for r, x in sorted(w.items())}}


def parent(out: Path, dirs: dict[str, Path], timeout: float) -> int:
    kill_running_on_exit()
    expected = expected_facts(dirs)
    deadline, names, arms = time.time() + timeout, list(ARMS), {}
    for i, arm in enumerate(names):
        limit = deadline - time.time() - sum(ARM_MIN_S[a] for a in names[i + 1:])
        arms[arm] = run_arm(out, dirs, arm, max(limit, 10.0))
    result = {"mode": "gpu", "patch": PATCH, "expected": expected, "arms": arms,
              "tokens": token_comparison(arms), "checks": checks(arms, expected)}
    result["ok"] = all(result["checks"].values())
    (out / "embed_quant_pp.json").write_text(json.dumps(result, indent=1, default=str))
    print(json.dumps({"ok": result["ok"], "checks": result["checks"],
                      "bytes": {"packed_expected": expected["embedding_bytes"],
                                "bf16_table": expected["bf16_table_bytes"]},
                      **{a: summary_of(r) for a, r in arms.items()}}))
    return 0 if result["ok"] else 1


def main() -> int:
    return arms_main(__doc__, ARMS, timeout=480.0,
                     dry_help="CPU only: checkpoints, packing, quant and engine configs",
                     prepare=write_checkpoints, reuse=checkpoint_dirs,
                     dry_run=dry_run, child=child, parent=parent)


if __name__ == "__main__":
    raise SystemExit(main())
