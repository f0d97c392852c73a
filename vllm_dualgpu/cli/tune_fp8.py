"""`vllm-dualgpu tune-fp8 [MODEL]`: tune vLLM's block-FP8 Triton GEMM for this GPU.

Finds the block-FP8 weight shapes of MODEL (its config.json) or takes ``--shapes``, times
candidate configs on the current GPU and writes vLLM-format JSON files named for the card.
Point ``VLLM_DUALGPU_KERNEL_CONFIGS`` at the output folder and every rank with that card picks
them up (docs/fp8-configs.md). ``--dry-run`` prints the plan without a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

DEFAULT_OUT = "fp8-configs"


def add_parser(sub) -> None:
    p = sub.add_parser(
        "tune-fp8",
        help="tune the block-FP8 Triton GEMM for this GPU and a model's weight shapes",
        description=__doc__.split("\n\n", 1)[1] if __doc__ else None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("model", nargs="?", metavar="MODEL",
                   help="model folder, its config.json, or a Hugging Face id (block-FP8 checkpoint)")
    p.add_argument("--shapes", metavar="N,K;N,K",
                   help="weight shapes to tune instead of (or without) a model, e.g. '14336,5120;5120,6144'")
    p.add_argument("--block", default=None, metavar="BN,BK",
                   help="quantization block with --shapes (default: the model's, else 128,128)")
    p.add_argument("--tp", type=int, default=1,
                   help="tensor-parallel size the model will run with (splits N or K; default 1)")
    p.add_argument("--batch-sizes", default=None, metavar="M,M,...",
                   help="batch sizes (rows) to tune for (default 1,8,16,32,64,128,256,512,1024,2048,4096)")
    p.add_argument("--out", default=None, metavar="DIR",
                   help=f"output folder (default: the first folder in $VLLM_DUALGPU_KERNEL_CONFIGS, "
                        f"else ./{DEFAULT_OUT})")
    p.add_argument("--device", type=int, default=0, help="CUDA device index to tune on (default 0)")
    p.add_argument("--jobs", type=int, default=None,
                   help="processes that compile kernel variants in parallel first (0: compile as "
                        "needed; default: min(8, CPUs/2))")
    p.add_argument("--time-cap", type=float, default=180.0, metavar="S",
                   help="seconds per shape after which the remaining batch sizes only compare "
                        "vLLM's default with the previous winner (default 180)")
    p.add_argument("--dry-run", action="store_true", help="print the plan and the file names only")
    p.add_argument("--device-name", default=None,
                   help="with --dry-run: the card name to put in the file names")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(run=run)


def _parse_block(text: str) -> tuple[int, int]:
    try:
        a, b = (int(x) for x in text.replace("x", ",").split(","))
        if a < 1 or b < 1:
            raise ValueError
        return a, b
    except ValueError:
        raise ValueError(f"--block {text!r}: write two positive integers, e.g. 128,128") from None


def resolve_shapes(args) -> tuple[list[tuple[int, int]], tuple[int, int], list[str]]:
    """(shapes, block, report lines) from MODEL and/or --shapes; ValueError says what to fix."""
    from vllm_dualgpu.kernels import fp8_tuner

    if args.tp < 1:
        raise ValueError("--tp must be at least 1")
    lines: list[str] = []
    block = _parse_block(args.block) if args.block else None
    shapes: list[tuple[int, int]] = []
    if args.model:
        cfg = fp8_tuner.read_model_config(args.model)
        report = fp8_tuner.model_weight_shapes(cfg, args.tp, block)
        block = report.block
        for s in report.shapes:
            lines.append(f"  N={s.N},K={s.K}: {', '.join(s.layers)}")
            shapes.append(s.key)
        lines += [f"  skipped {x}" for x in report.skipped]
        lines += [f"  note: {x}" for x in report.notes]
    if args.shapes:
        for s in fp8_tuner.parse_shapes(args.shapes):
            if s not in shapes:
                shapes.append(s)
                lines.append(f"  N={s[0]},K={s[1]}: from --shapes")
    if not shapes:
        raise ValueError("name a MODEL (folder, config.json or Hugging Face id) or give --shapes N,K;N,K")
    return shapes, block or (128, 128), lines


def output_dir(args) -> Path:
    if args.out:
        return Path(args.out).expanduser()
    from vllm_dualgpu.kernels.fp8_configs import user_config_dirs

    dirs = user_config_dirs()
    return dirs[0] if dirs else Path(DEFAULT_OUT)


def run(args) -> int:
    from vllm_dualgpu.kernels import fp8_configs, fp8_tuner

    try:
        shapes, block, lines = resolve_shapes(args)
        batch_sizes = (fp8_tuner.parse_batch_sizes(args.batch_sizes) if args.batch_sizes
                       else list(fp8_tuner.DEFAULT_BATCH_SIZES))
    except (ValueError, FileNotFoundError) as exc:
        print(f"vllm-dualgpu tune-fp8: {exc}", file=sys.stderr)
        return 2
    out = output_dir(args)
    print(f"block-FP8 weight shapes (block {block[0]}x{block[1]}):")
    print("\n".join(lines))

    if args.dry_run:
        name = fp8_configs.device_name_as_file_name(args.device_name) if args.device_name else None
        plan = fp8_tuner.make_plan(shapes, block, batch_sizes)
        print(fp8_tuner.describe_plan(plan, name, str(out)))
        print("dry run: nothing measured or written")
        return 0

    import torch

    if not torch.cuda.is_available():
        print("vllm-dualgpu tune-fp8: no CUDA GPU visible; tuning runs on the GPU the configs "
              "are for (--dry-run shows the plan)", file=sys.stderr)
        return 1
    torch.cuda.set_device(args.device)
    jobs = args.jobs if args.jobs is not None else min(8, max(0, (os.cpu_count() or 2) // 2))
    result = fp8_tuner.tune(shapes, block, batch_sizes, out_dir=out, jobs=jobs,
                            time_cap_s=args.time_cap, progress=not args.no_progress)
    (out / "tune-fp8-log.json").write_text(json.dumps(result, indent=1, default=str))
    return report_written(result["files"], out)


def report_written(files: list[str], out: Path) -> int:
    print(f"wrote {len(files)} config file(s) to {out.resolve()}:")
    for f in files:
        print(f"  {Path(f).name}")
    print(f"vLLM uses them on every rank with this card when served with\n"
          f"  export VLLM_DUALGPU_KERNEL_CONFIGS={out.resolve()}\n"
          f"(or copy them into the package's kernel_configs/ folder and send them upstream).")
    return 0
