#!/usr/bin/env python3
"""Issue #3 benchmark: stock vLLM vs vllm-dualgpu on an emulated 32 GiB + 16 GiB pair.

    python scripts/gpu/bench_memory.py OUTDIR [--full-sweep]

GPU 0 keeps 32 GiB free and GPU 1 16 GiB (ballast processes hold the rest), so the BIG card
comes first in PCI order and the plugin has to reorder. Model: Qwen3-14B-class shapes with
block-FP8 weights (dummy), bf16 KV, eager mode, max_model_len 32768 in every run.
Runs: stock (mp) at utilization 0.90 / 0.11 / 0.10; the plugin with no extra flags (full boot
and a generation); the plugin over a sweep of layer splits (stopped once the KV pool is
known: the plugin's split +-1 and +-2 layers and the even split; --full-sweep adds +-4 and +-6); the
plugin with the model's full 262,144 context (must fail with the largest that fits).
BENCH_SKIP_STOCK, BENCH_SKIP_SWEEP, BENCH_SKIP_FULL_CONTEXT (any value) leave those runs out.
Writes OUTDIR/bench_memory.json and OUTDIR/bench_memory.md.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpurun import GiB, NvmlSampler, ballast, grep, kill, start, wait_for  # noqa: E402

FREE = [32.0, 16.0]
# Every run takes vLLM's Triton block-FP8 GEMM (the kernel the reference small card uses), so
# each rank's tuned-config lookup shows in the log; the same for stock and plugin runs.
TRITON_ONLY = {"VLLM_DISABLED_KERNELS": ",".join([
    "FlashInferFp8DeepGEMMDynamicBlockScaledKernel", "DeepGemmFp8BlockScaledMMKernel",
    "CutlassFp8BlockScaledMMKernel", "B12xFp8BlockScaledMMKernel", "MarlinFP8ScaledMMLinearKernel",
    "HummingFP8ScaledMMLinearKernel"])}
KV_LINE = r"GPU KV cache size: ([\d,]+) tokens"
FAIL = r"Traceback|Error|error:"


def run_one(name, kwargs, out: Path, env=None, stop_at_kv=False, prompts=None, timeout=240):
    log = out / "logs" / f"{name}.log"
    cmd = [sys.executable, str(Path(__file__).parent / "boot_llm.py"), json.dumps(kwargs)]
    if prompts:
        cmd.append(json.dumps(prompts))
    plan_file = out / "logs" / f"{name}.plan.json"
    env = {**TRITON_ONLY, **(env or {}), "VLLM_DUALGPU_PLAN_FILE": str(plan_file)}
    t0 = time.time()
    with NvmlSampler() as s:
        base = s.used()
        p = start(cmd, log, env)
        if stop_at_kv:
            got = wait_for(log, KV_LINE, timeout, p, fail_pattern=r"EngineCore failed|Engine core initialization failed|ValueError|RuntimeError")
            time.sleep(1.0)
        else:
            got = wait_for(log, r"RESULT ", timeout, p)
        kill(p, dump=got is None and p.poll() is None)  # still running and no answer: a hang
    text = log.read_text(errors="replace")
    r = {"name": name, "wall_s": round(time.time() - t0, 1), "env": env, "kwargs": kwargs}
    m = re.search(KV_LINE, text)
    r["kv_tokens"] = int(m.group(1).replace(",", "")) if m else None
    m = re.search(r"RESULT (.*)", text)
    if m:
        r.update(json.loads(m.group(1)))
    r["booted"] = r["kv_tokens"] is not None
    r["peak_used_gib"] = [round((pk - b) / GiB, 3) for pk, b in zip(s.peak, base)]
    r["rank_lines"] = grep(log, r"vllm-dualgpu rank \d")
    r["plan_line"] = grep(log, r"vllm-dualgpu plan:")
    r["fp8_lines"] = grep(log, r"(?i)fp8 config|fp8-configs|Selected \w+ for")[:8]
    r["errors"] = [l[-400:] for l in grep(log, r"ValueError|does not fit|less than desired")][:3]
    if plan_file.exists():
        r["plan"] = json.loads(plan_file.read_text())
    print(json.dumps({k: r.get(k) for k in ("name", "booted", "kv_tokens", "wall_s", "peak_used_gib", "errors")}), flush=True)
    return r


def main() -> int:
    out = Path(sys.argv[1])
    full_sweep = "--full-sweep" in sys.argv
    model = out / "models" / "qwen3-14b-fp8"
    subprocess.run([sys.executable, str(Path(__file__).parent / "make_model.py"), "qwen3-14b-fp8", str(model)], check=True)
    base = {"model": str(model), "load_format": "dummy", "enforce_eager": True,
            "max_model_len": 32768, "pipeline_parallel_size": 2, "skip_tokenizer_init": False}
    prompts = [[1 + (i * 7 + j) % 900 for j in range(64 + 40 * i)] for i in range(4)]
    results = []

    def run(*a, **kw):  # every result is written as soon as it exists: a timeout keeps the rest
        results.append(run_one(*a, **kw))
        save(results, out)
        return results[-1]

    with ballast(FREE, out / "logs"):
        for u in (() if os.environ.get("BENCH_SKIP_STOCK") else (0.90, 0.11, 0.10)):
            run(f"stock_u{u:.2f}", {**base, "distributed_executor_backend": "mp", "gpu_memory_utilization": u},
                out, stop_at_kv=True)
        plugin = run("dualgpu", {**base, "distributed_executor_backend": "dualgpu"}, out, prompts=prompts,
                     timeout=420)
        chosen = (plugin.get("plan") or {}).get("partition") or [12, 28]
        steps = (-2, -1, 1, 2) if not full_sweep else (-6, -4, -2, -1, 1, 2, 4, 6)
        splits = [[chosen[0] + d, 40 - chosen[0] - d] for d in steps if 0 < chosen[0] + d < 40]
        if [20, 20] not in splits and chosen != [20, 20]:
            splits.append([20, 20])
        if os.environ.get("BENCH_SKIP_SWEEP"):
            splits = []
        for sp in splits:
            run(f"split_{sp[0]}_{sp[1]}", {**base, "distributed_executor_backend": "dualgpu"}, out,
                env={"VLLM_PP_LAYER_PARTITION": f"{sp[0]},{sp[1]}"}, stop_at_kv=True)
        full = {**base, "distributed_executor_backend": "dualgpu"}
        full.pop("max_model_len")
        if not os.environ.get("BENCH_SKIP_FULL_CONTEXT"):
            run("dualgpu_full_context", full, out, stop_at_kv=True)
    print(table(results))
    return 0


def save(results, out: Path) -> None:
    (out / "bench_memory.json").write_text(json.dumps(results, indent=1))
    (out / "bench_memory.md").write_text(table(results))


def peak_rows(results) -> list[str]:
    """Predicted vs measured peak memory per rank, for runs that booted fully and generated.

    Predicted: what the plan leaves vLLM on that card at its peak (free at start minus the
    plan's predicted free after: weights + fixed costs + runtime reserve + KV cache). Measured:
    NVML's used memory on that GPU at its highest during the run, minus before the run (0.25 s
    samples). Runs stopped at the KV line never reach their peak, so they are left out.
    """
    rows = []
    for r in results:
        plan = r.get("plan") or {}
        if not plan.get("ranks") or "outputs" not in r:
            continue
        for rk in plan["ranks"]:
            gpu = rk["gpu"]
            pred = gpu["free_bytes"] - rk["predicted_free_after_bytes"]
            meas = r["peak_used_gib"][gpu["index"]] * GiB
            diff = meas - pred
            rows.append(f"| {r['name']} | {rk['rank']} | GPU {gpu['index']} | {rk['num_layers']} | "
                        f"{pred / GiB:.2f} | {meas / GiB:.2f} | {diff / 2**20:+,.0f} MiB ({100 * diff / pred:+.1f}%) |")
    if not rows:
        return []
    return ["", "Peak memory per rank, predicted by the plan vs measured (NVML, used minus before the run):", "",
            "| run | rank | GPU | layers | predicted (GiB) | measured (GiB) | measured - predicted |",
            "|---|---|---|---|---|---|---|"] + rows


def table(results) -> str:
    """Markdown: per run, the split, predicted vs measured pool, boot and memory figures."""
    rows = ["| run | split | boots | KV pool (tokens) | predicted | error | boot (s) | peak used GPU0 / GPU1 (GiB) |",
            "|---|---|---|---|---|---|---|---|"]
    for r in results:
        pk = " / ".join(f"{x:.2f}" for x in r["peak_used_gib"])
        kv = r["kv_tokens"]
        plan = r.get("plan") or {}
        split = "/".join(map(str, plan.get("partition", []))) or "even"
        predicted = plan.get("num_blocks", 0) * r.get("block_size", 16) if plan else None
        err = f"{100.0 * (predicted - kv) / kv:+.1f}%" if predicted and kv else "-"
        rows.append(f"| {r['name']} | {split} | {'yes' if r['booted'] else 'no'} | "
                    f"{f'{kv:,}' if kv else '-'} | {f'{predicted:,}' if predicted else '-'} | {err} | "
                    f"{r.get('boot_s', '-')} | {pk} |")
    rows += peak_rows(results)
    ranks = [l for r in results for l in r.get("rank_lines", [])]
    if ranks:
        rows += ["", "Per-rank summary lines (non-KV memory: vLLM's profile vs the plan):", ""]
        rows += [f"    {l.split('] ', 1)[-1]}" for l in ranks]
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
