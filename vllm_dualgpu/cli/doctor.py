"""`vllm-dualgpu doctor` (placeholder until its issue lands)."""

from __future__ import annotations


def add_parser(sub) -> None:
    p = sub.add_parser("doctor", help="(not implemented yet)")
    p.set_defaults(run=run)


def run(args) -> int:
    print("vllm-dualgpu doctor: not implemented yet")
    return 2
