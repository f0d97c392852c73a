"""``vllm-dualgpu`` command line: ``plan``, ``doctor``, ``tune-fp8``, ``calibrate``.

Each subcommand lives in its own module with ``add_parser(subparsers)`` and ``run(args) -> int``
and imports what it needs only when it runs, so ``vllm-dualgpu --help`` and ``plan`` stay fast
and work on machines without a GPU.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from vllm_dualgpu._version import SUPPORTED_VLLM, __version__

SUBCOMMANDS = ("plan", "doctor", "tune_fp8", "calibrate")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vllm-dualgpu",
        description="Plan and check vLLM pipeline-parallel serving on mismatched NVIDIA GPUs.",
    )
    parser.add_argument(
        "--version", action="version", version=f"vllm-dualgpu {__version__} (vLLM {SUPPORTED_VLLM})"
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in SUBCOMMANDS:
        importlib.import_module(f"vllm_dualgpu.cli.{name}").add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if args.command is None:
        parser.print_help()
        return 0
    return int(args.run(args) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
