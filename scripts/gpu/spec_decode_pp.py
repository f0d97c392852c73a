#!/usr/bin/env python3
"""MTP speculative decoding with PP=2 through the dualgpu executor, on a small Qwen3.5 hybrid.

    python scripts/gpu/spec_decode_pp.py OUTDIR [--timeout 210] [--dry-run]

Writes OUTDIR/model/config.json (a text-only Qwen3.5: Gated DeltaNet + full attention layers,
one MTP layer; random weights through load_format="dummy"), boots ``vllm.LLM`` with
pipeline_parallel_size=2, distributed_executor_backend="dualgpu" and
speculative_config={"method": "mtp", "num_speculative_tokens": 2}, generates for a few
token-id prompts (one of them twice, so the second run is a prefix-cache hit through the GDN
layers) and writes OUTDIR/spec_decode_pp.json:

- per-rank facts read inside each worker (``collective_rpc``): PP rank, torch allocated and
  reserved bytes, ``max_concurrent_batches`` as the worker sees it, whether the drafter's
  embedding is the target's module, how many embedding-sized weights the rank holds;
- per-process GPU memory sampled with NVML from outside (peak and at the end), plus one
  ``nvidia-smi --query-compute-apps`` snapshot;
- the plugin's per-process summary lines (EngineCore and workers must list the issue #6
  patches), boot and generation times, output token ids.

vLLM runs in a child process in its own process group, logging to OUTDIR/llm.log; the whole
group is killed on exit, on a signal and at the timeout. Exit code 0 only if generation
finished and the checks in "checks" hold.

``--dry-run`` (no GPU needed; sets VLLM_TARGET_DEVICE=cpu): writes the model config and builds
the engine config with ``EngineArgs(...).create_engine_config()`` in this process, then checks
the architecture, the drafter, the executor class and the spec-decoding settings.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
GiB = 1024**3

MODEL_CONFIG = {
    "architectures": ["Qwen3_5ForCausalLM"],
    "model_type": "qwen3_5_text",
    "vocab_size": 8192,
    "hidden_size": 1024,
    "intermediate_size": 2048,
    "num_hidden_layers": 8,  # 6 Gated DeltaNet + 2 full attention; 4 layers per PP rank
    "full_attention_interval": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 128,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_num_key_heads": 4,
    "linear_num_value_heads": 8,
    "mtp_num_hidden_layers": 1,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1000000, "partial_rotary_factor": 0.25},
    "hidden_act": "silu",
    "attention_bias": False,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "bos_token_id": 1,
    "eos_token_id": 2,
}

NUM_SPEC = 2
# The issue #6 patches each process kind must report as applied in its plugin line.
ENGINE_PATCHES = ("pp-inflight-batches", "mamba-hit-drop-last-block")
WORKER_PATCHES = ("pp-inflight-batches", "drafter-shares-target-embed")


def engine_kwargs(model_dir: Path) -> dict:
    return dict(
        model=str(model_dir),
        load_format="dummy",
        skip_tokenizer_init=True,
        pipeline_parallel_size=2,
        distributed_executor_backend="dualgpu",
        speculative_config={"method": "mtp", "num_speculative_tokens": NUM_SPEC},
        enforce_eager=True,
        max_model_len=4096,
        gpu_memory_utilization=0.3,
        seed=0,
        # FlashInfer's GDN prefill (vLLM's pick on SM 9.0) needs nvidia-cutlass-dsl; Triton's does not.
        additional_config={"gdn_prefill_backend": os.environ.get("GDN_PREFILL_BACKEND", "triton")},
    )


def prompts() -> list[list[int]]:
    """Token-id prompts: three short ones and one long one (several KV blocks)."""
    def ids(start: int, n: int) -> list[int]:
        return [3 + (start + 7 * i) % 8000 for i in range(n)]

    return [ids(11, 24), ids(500, 90), ids(1234, 300), ids(4321, 1500)]


def write_model(out: Path) -> Path:
    model = out / "model"
    model.mkdir(parents=True, exist_ok=True)
    (model / "config.json").write_text(json.dumps(MODEL_CONFIG, indent=1))
    return model


# --- dry run (CPU) ---------------------------------------------------------------------------


def _cpu_inspection_shim() -> str | None:
    """Let vLLM inspect Qwen3.5 on a CPU machine without torchvision.

    ``vllm.model_executor.models.qwen3_5`` imports transformers' Qwen2-VL image processor, which
    imports torchvision. CPU development installs often lack it, and vLLM inspects model classes
    in a subprocess. Without torchvision, inspect in this process (no CUDA to protect here) with
    an empty ``torchvision.transforms.v2.functional`` module; transformers has already recorded
    that torchvision is missing, so nothing else uses the stub. Dry runs only.
    """
    try:
        import torchvision  # noqa: F401

        return None
    except ImportError:
        pass
    import importlib.machinery
    import types

    import vllm.engine.arg_utils  # noqa: F401  (transformers decides torchvision is absent)
    import vllm.model_executor.models.registry as registry

    for name in ("torchvision", "torchvision.transforms", "torchvision.transforms.v2",
                 "torchvision.transforms.v2.functional"):
        mod = types.ModuleType(name)
        mod.__spec__ = importlib.machinery.ModuleSpec(name, None)
        mod.__path__ = []
        sys.modules.setdefault(name, mod)
    registry._run_in_subprocess = lambda fn: fn()
    return "torchvision missing: model class inspected in-process with a stub"


def dry_run(out: Path, model: Path) -> int:
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    shim = _cpu_inspection_shim()
    from vllm.engine.arg_utils import EngineArgs

    cfg = EngineArgs(**engine_kwargs(model)).create_engine_config()
    spec = cfg.speculative_config
    backend = cfg.parallel_config.distributed_executor_backend
    facts = {
        "architectures": cfg.model_config.architectures,
        "model_type": cfg.model_config.hf_config.model_type,
        "is_hybrid": cfg.model_config.is_hybrid,
        "draft_architectures": spec.draft_model_config.architectures if spec else None,
        "spec_method": spec.method if spec else None,
        "num_speculative_tokens": spec.num_speculative_tokens if spec else None,
        "executor": getattr(backend, "__name__", str(backend)),
        "pipeline_parallel_size": cfg.parallel_config.pipeline_parallel_size,
        "block_size": cfg.cache_config.block_size,
        "mamba_cache_mode": cfg.cache_config.mamba_cache_mode,
        "enable_prefix_caching": cfg.cache_config.enable_prefix_caching,
        "max_model_len": cfg.model_config.max_model_len,
        "num_prompts": len(prompts()),
    }
    checks = {
        "qwen3.5 hybrid target": facts["architectures"] == ["Qwen3_5ForCausalLM"] and facts["is_hybrid"],
        "mtp drafter": facts["draft_architectures"] == ["Qwen3_5MTP"] and facts["spec_method"] == "mtp",
        "dualgpu executor": facts["executor"] == "DualGpuExecutor",
        "pp=2": facts["pipeline_parallel_size"] == 2,
        "prompts fit": max(map(len, prompts())) + 128 <= facts["max_model_len"],
    }
    result = {"mode": "dry-run", "shim": shim, "facts": facts, "checks": checks, "ok": all(checks.values())}
    (out / "spec_decode_pp.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result))
    return 0 if result["ok"] else 1


# --- child: vLLM itself ------------------------------------------------------------------------


def probe_worker(worker) -> dict:
    """Runs inside each worker (collective_rpc): facts only the worker can see."""
    import torch
    from vllm.distributed.parallel_state import get_pp_group

    runner = worker.model_runner
    target = runner.model
    language = target.get_language_model() if hasattr(target, "get_language_model") else target
    vocab = worker.vllm_config.model_config.get_vocab_size()
    facts = {
        "pp_rank": get_pp_group().rank_in_group,
        "pid": os.getpid(),
        "cuda_device": torch.cuda.current_device(),
        "allocated": torch.cuda.memory_allocated(),
        "reserved": torch.cuda.memory_reserved(),
        "max_concurrent_batches": worker.vllm_config.max_concurrent_batches,
        "runner": type(runner).__module__ + "." + type(runner).__name__,
        "dualgpu_env": os.environ.get("VLLM_DUALGPU_ACTIVE"),
    }
    modules = [target]
    # V2 runner: runner.speculator.model; V1 runner: runner.drafter.model.
    holder = getattr(runner, "speculator", None) or getattr(runner, "drafter", None)
    drafter = getattr(holder, "model", None)
    if drafter is not None:
        modules.append(drafter)
        t_embed = getattr(getattr(language, "model", None), "embed_tokens", None)
        d_embed = getattr(getattr(drafter, "model", None), "embed_tokens", None)
        facts["drafter"] = type(drafter).__name__
        facts["drafter_embed_is_target_embed"] = d_embed is not None and d_embed is t_embed
        facts["drafter_param_bytes"] = sum(p.numel() * p.element_size() for p in drafter.parameters())
    seen, embeds = set(), 0
    for module in modules:
        for p in module.parameters():
            if p.data_ptr() in seen:
                continue
            seen.add(p.data_ptr())
            if p.dim() == 2 and p.shape[0] >= vocab // 2:  # vocab-parallel embeddings and heads
                embeds += 1
    facts["vocab_sized_weights"] = embeds
    return facts


def child(out: Path, model: Path) -> int:
    t0 = time.time()
    from vllm import LLM, SamplingParams

    llm = LLM(**engine_kwargs(model))
    res: dict = {"boot_s": round(time.time() - t0, 1)}
    cfg = llm.llm_engine.vllm_config
    res["block_size"] = cfg.cache_config.block_size
    res["num_gpu_blocks"] = cfg.cache_config.num_gpu_blocks
    sp = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True, detokenize=False)
    ps = prompts()
    t1 = time.time()
    outs = llm.generate([{"prompt_token_ids": p} for p in ps], sp, use_tqdm=False)
    res["generate_s"] = round(time.time() - t1, 2)
    res["outputs"] = [list(o.outputs[0].token_ids) for o in outs]
    # The long prompt again: a prefix-cache hit that restores GDN state.
    t2 = time.time()
    again = llm.generate([{"prompt_token_ids": ps[-1]}], sp, use_tqdm=False)[0]
    res["repeat_s"] = round(time.time() - t2, 2)
    res["repeat_num_cached_tokens"] = again.num_cached_tokens
    res["repeat_same_output"] = list(again.outputs[0].token_ids) == res["outputs"][-1]
    res["workers"] = llm.collective_rpc(probe_worker, timeout=60)
    try:
        metrics = llm.get_metrics()
        res["spec_metrics"] = {m.name: getattr(m, "value", getattr(m, "values", None))
                               for m in metrics if "spec_decode" in m.name}
    except Exception as exc:  # metrics are informational
        res["spec_metrics_error"] = repr(exc)
    res["total_s"] = round(time.time() - t0, 1)
    (out / "child.json").write_text(json.dumps(res, indent=1, default=str))
    # Let the parent take its end-of-run memory snapshot while everything is still loaded.
    end = time.time() + 15
    while time.time() < end and not (out / "snapshot.done").exists():
        time.sleep(0.2)
    return 0


# --- parent: process group, NVML, checks -------------------------------------------------------


class ProcessMemory:
    """Per-process GPU memory from NVML, sampled from outside vLLM."""

    def __init__(self):
        try:
            import pynvml
        except ImportError:
            from vllm.third_party import pynvml
        pynvml.nvmlInit()
        self.nvml = pynvml
        self.handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
        self.peak_device = [0] * len(self.handles)
        self.peak_process: dict[str, int] = {}

    def sample(self) -> dict:
        snap: dict = {"device_used": [], "processes": {}}
        for gpu, h in enumerate(self.handles):
            used = self.nvml.nvmlDeviceGetMemoryInfo(h).used
            snap["device_used"].append(used)
            self.peak_device[gpu] = max(self.peak_device[gpu], used)
            try:
                procs = self.nvml.nvmlDeviceGetComputeRunningProcesses(h)
            except self.nvml.NVMLError:
                procs = []
            for p in procs:
                key = f"gpu{gpu}:pid{p.pid}"
                mem = p.usedGpuMemory or 0
                snap["processes"][key] = mem
                self.peak_process[key] = max(self.peak_process.get(key, 0), mem)
        return snap


def _name_of(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:120].strip()
    except OSError:
        return "?"


def parent(out: Path, model: Path, timeout: float) -> int:
    sys.path.insert(0, str(HERE))
    from gpurun import grep, kill, start

    for stale in ("child.json", "snapshot.done"):
        (out / stale).unlink(missing_ok=True)
    log = out / "llm.log"
    t0 = time.time()
    proc = start([sys.executable, str(Path(__file__).resolve()), str(out), "--child"], log,
                 env={"VLLM_ALLOW_INSECURE_SERIALIZATION": "1"})

    def cleanup(*_):
        kill(proc, grace=3)

    atexit.register(cleanup)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda s, f: (cleanup(), sys.exit(128 + s)))

    result: dict = {"mode": "gpu", "engine_kwargs": {**engine_kwargs(model), "model": "OUTDIR/model"}}
    memory = ProcessMemory()
    end_snapshot = None
    try:
        while time.time() - t0 < timeout and proc.poll() is None:
            memory.sample()
            if end_snapshot is None and (out / "child.json").exists():
                end_snapshot = memory.sample()
                smi = subprocess.run(
                    ["nvidia-smi", "--query-compute-apps=pid,gpu_uuid,used_memory", "--format=csv"],
                    capture_output=True, text=True, timeout=20)
                result["nvidia_smi_compute_apps"] = smi.stdout.strip().splitlines()
                (out / "snapshot.done").write_text("1")
            time.sleep(0.25)
        result["timed_out"] = proc.poll() is None
        result["child_rc"] = proc.poll()
    finally:
        cleanup()
    result["wall_s"] = round(time.time() - t0, 1)
    child_json = out / "child.json"
    result["child"] = json.loads(child_json.read_text()) if child_json.exists() else None
    result["memory"] = {
        "peak_device_used_gib": [round(b / GiB, 3) for b in memory.peak_device],
        "peak_process_gib": {k: round(v / GiB, 3) for k, v in memory.peak_process.items()},
        "end_process_gib": {k: round(v / GiB, 3) for k, v in (end_snapshot or {}).get("processes", {}).items()},
        "end_device_used_gib": [round(b / GiB, 3) for b in (end_snapshot or {}).get("device_used", [])],
        "process_names": {k: _name_of(int(k.split("pid")[1])) for k in memory.peak_process},
    }
    result["plugin_lines"] = grep(log, r"vllm-dualgpu \d+\.\d+\.\d+ \(")
    result["errors"] = grep(log, r"Traceback|Error|error:")[:20]
    result["checks"] = checks(result)
    result["ok"] = bool(result["child"]) and not result["timed_out"] and all(result["checks"].values())
    (out / "spec_decode_pp.json").write_text(json.dumps(result, indent=1, default=str))
    summary = {k: result[k] for k in ("ok", "wall_s", "timed_out", "checks")}
    summary["memory"] = result["memory"]["end_process_gib"] or result["memory"]["peak_device_used_gib"]
    print(json.dumps(summary))
    return 0 if result["ok"] else 1


def checks(result: dict) -> dict:
    c = result.get("child") or {}
    workers = sorted(c.get("workers") or [], key=lambda w: w["pp_rank"])
    lines = result.get("plugin_lines", [])

    def applied_in(kind: str, names: tuple[str, ...]) -> bool:
        sel = [l for l in lines if re.search(rf"[(+]{kind}[,+ )]", l)]
        return bool(sel) and all(all(n in l for n in names) for l in sel)

    last = workers[-1] if workers else {}
    return {
        "generated": len(c.get("outputs") or []) == len(prompts()),
        "two ranks probed": [w["pp_rank"] for w in workers] == [0, 1],
        "workers see max_concurrent_batches == pp_size": bool(workers)
        and all(w["max_concurrent_batches"] == 2 for w in workers),
        "drafter on the last rank only": bool(workers) and "drafter" in last
        and all("drafter" not in w for w in workers[:-1]),
        "drafter embedding is the target's": last.get("drafter_embed_is_target_embed") is True,
        "engine applied its issue #6 patches": applied_in("engine", ENGINE_PATCHES),
        "workers applied their issue #6 patches": applied_in("worker", WORKER_PATCHES),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("outdir", type=Path)
    ap.add_argument("--dry-run", action="store_true", help="CPU only: build and check the engine config")
    ap.add_argument("--timeout", type=float, default=210.0, help="seconds for the vLLM child (default 210)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    out = args.outdir.resolve()
    out.mkdir(parents=True, exist_ok=True)
    model = write_model(out)
    if args.dry_run:
        return dry_run(out, model)
    if args.child:
        return child(out, model)
    return parent(out, model, args.timeout)


if __name__ == "__main__":
    raise SystemExit(main())
