#!/usr/bin/env python3
"""Issue #5 on one GPU: tune vLLM's block-FP8 Triton GEMM, then compare default vs tuned.

    python benchmarks/fp8_tuning.py OUTDIR [--budget 300] [--jobs N]

1. Tunes the five weight shapes of a 27B Qwen3.5-class FP8 checkpoint
   (N,K = 14336,5120; 16384,5120; 34816,5120; 5120,17408; 5120,6144) for
   M = 1,8,16,32,64,128,256,512,1024,2048,4096 on the current GPU with
   ``vllm_dualgpu.kernels.fp8_tuner`` (kernel variants compiled first in ``--jobs`` processes)
   and writes OUTDIR/configs/N=...,device_name=<card>,...json, the same files bundled in
   OUTDIR/fp8_configs.json (``--unpack kernel_configs/`` writes them back out, byte-identical)
   and OUTDIR/fp8_tune.json (tuner timings).
2. Times the GEMM with vLLM's default config vs the tuned one for M = 1, 8, 64, 512, 4096: each
   CUDA-graph replay runs it over enough weight copies to exceed 4x the L2 cache, the two
   configs alternate, medians of --reps replays. Writes OUTDIR/fp8_bench.json and
   OUTDIR/fp8_bench.md.

Never hangs: the whole run keeps to --budget seconds (per-shape caps are derived from what is
left; the parallel compile step is killed after its share). Exit code 0 when the files were
written. That vLLM reads them (the patched lookup, bitwise the tuned launch) is
tests/gpu/test_gpu_fp8_tuning.py; what needs no GPU (vLLM's kernel signature, the plan, the
patches) is in tests/integration.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

SHAPES = [(14336, 5120), (16384, 5120), (34816, 5120), (5120, 17408), (5120, 6144)]
BLOCK = (128, 128)
TUNE_M = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096]
BENCH_M = [1, 8, 64, 512, 4096]


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    ap.add_argument("outdir")
    ap.add_argument("--budget", type=float, default=300.0, help="seconds for the whole run")
    ap.add_argument("--bench-share", type=float, default=0.2,
                    help="share of the budget kept for the default-vs-tuned benchmark")
    ap.add_argument("--jobs", type=int, default=max(1, min(14, (os.cpu_count() or 4) - 2)),
                    help="processes compiling kernel variants before tuning (0: none)")
    ap.add_argument("--reps", type=int, default=30, help="replays per config in the benchmark")
    ap.add_argument("--unpack", metavar="DEST",
                    help="instead of running: write the files bundled in OUTDIR/fp8_configs.json "
                         "(or the bundle named by OUTDIR) into DEST, e.g. kernel_configs/")
    args = ap.parse_args()
    if args.unpack:
        from vllm_dualgpu.kernels import fp8_tuner

        src = Path(args.outdir)
        src = src / "fp8_configs.json" if src.is_dir() else src
        for path in fp8_tuner.unpack_config_bundle(json.loads(src.read_text()), args.unpack):
            print(f"wrote {path}")
        return 0

    t0 = time.monotonic()
    deadline = t0 + args.budget
    out = Path(args.outdir)
    cfg_dir = out / "configs"
    cfg_dir.mkdir(parents=True, exist_ok=True)

    import torch
    import triton
    import vllm

    from vllm_dualgpu.kernels import fp8_tuner

    torch.cuda.init()
    facts = fp8_tuner.device_facts()
    env = {"torch": torch.__version__, "triton": triton.__version__, "vllm": vllm.__version__,
           "device": facts}
    log(f"{facts['name']} (SM{facts['capability'][0]}{facts['capability'][1]}, "
        f"{facts['smem_optin']} B shared memory, {facts['l2_bytes'] / 2**20:.0f} MiB L2), "
        f"torch {torch.__version__}, triton {triton.__version__}, vLLM {vllm.__version__}")

    # 1. Tune: the benchmark keeps its share; the rest is split over the shapes as we go.
    bench_reserve = args.bench_share * args.budget
    tune_deadline = deadline - bench_reserve
    kernel = fp8_tuner.find_kernel()
    plan = fp8_tuner.make_plan(SHAPES, BLOCK, TUNE_M, facts["smem_optin"])
    log(fp8_tuner.describe_plan(plan, facts["file_name"], str(cfg_dir)))
    pre = fp8_tuner.precompile(plan, args.jobs, facts["index"],
                               timeout_s=max(10.0, min(0.35 * args.budget, tune_deadline - time.monotonic() - 30)),
                               log=log) if args.jobs > 0 else None
    results, tuned, files = [], {}, []
    for i, (N, K) in enumerate(SHAPES):
        left = tune_deadline - time.monotonic()
        cap = max(5.0, left / (len(SHAPES) - i) - 3.0)
        log(f"tuning N={N},K={K} (cap {cap:.0f} s)")
        r = fp8_tuner.tune_shape(kernel, N, K, BLOCK, TUNE_M, facts["smem_optin"], time_cap_s=cap,
                                 log=log)
        path = fp8_tuner.write_config_file(cfg_dir, N, K, facts["file_name"], BLOCK, r.configs)
        files.append(path.name)
        tuned[(N, K)] = {int(m): c for m, c in r.configs.items()}
        results.append(r.__dict__)
        log(f"  {r.seconds} s{' (cap reached)' if r.capped else ''}: "
            + ", ".join(f"M={m} {r.tuned_us[m]:.1f}us"
                        + (f"/dflt {r.default_us[m]:.1f}" if m in r.default_us else "")
                        for m in TUNE_M))
    tune_s = round(time.monotonic() - t0, 1)
    (out / "fp8_configs.json").write_text(json.dumps(
        fp8_tuner.bundle_config_files(sorted(cfg_dir.glob("N=*.json"))), indent=1))
    (out / "fp8_tune.json").write_text(json.dumps(
        {"env": env, "precompile": pre, "seconds": tune_s, "files": files, "shapes": results},
        indent=1, default=str))
    log(f"tuning done in {tune_s} s; {len(files)} files in {cfg_dir}")

    # 3. Default vs tuned, weights rotated past L2.
    rows = []
    for i, shape in enumerate(SHAPES):
        left = deadline - time.monotonic() - 5
        cap = max(3.0, left / (len(SHAPES) - i))
        rows += fp8_tuner.bench_default_vs_tuned([shape], tuned, BLOCK, BENCH_M, reps=args.reps,
                                                 time_cap_s=cap, log=log)
    total_s = round(time.monotonic() - t0, 1)
    bench = {"env": env, "block": list(BLOCK), "tune_seconds": tune_s, "total_seconds": total_s,
             "precompile": pre, "files": files,
             "method": "CUDA-graph replays over weight copies totalling >= 4x L2, default and "
                       "tuned alternating, median of --reps replays per config",
             "rows": rows}
    (out / "fp8_bench.json").write_text(json.dumps(bench, indent=1, default=str))
    md = [f"# Block-FP8 Triton GEMM on {facts['name']}: vLLM default config vs tuned\n",
          f"torch {torch.__version__}, triton {triton.__version__}, vLLM {vllm.__version__}; "
          f"tuning took {tune_s} s, the whole run {total_s} s. Times are per GEMM (bf16 out), "
          "medians of CUDA-graph replays with weights rotated past L2.\n",
          fp8_tuner.bench_table(rows)]
    (out / "fp8_bench.md").write_text("\n".join(md))
    print(fp8_tuner.bench_table(rows))
    log(f"done in {total_s} s: {out / 'fp8_bench.md'}")
    return 0 if len(files) == len(SHAPES) else 1


if __name__ == "__main__":
    sys.exit(main())
