"""`vllm-dualgpu plan` (placeholder until its issue lands)."""

from __future__ import annotations


def add_parser(sub) -> None:
    p = sub.add_parser("plan", help="(not implemented yet)")
    p.set_defaults(run=run)


def run(args) -> int:
    print("vllm-dualgpu plan: not implemented yet")
    return 2
