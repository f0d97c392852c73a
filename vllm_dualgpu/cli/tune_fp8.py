"""`vllm-dualgpu tune-fp8` (placeholder until its issue lands)."""

from __future__ import annotations


def add_parser(sub) -> None:
    p = sub.add_parser("tune-fp8", help="(not implemented yet)")
    p.set_defaults(run=run)


def run(args) -> int:
    print("vllm-dualgpu tune-fp8: not implemented yet")
    return 2
