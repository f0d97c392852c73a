"""The environment variables vllm-dualgpu reads, parsed with errors that say what to write."""

from __future__ import annotations

import os

# Per-GPU memory kept free for other programs (a desktop, a browser), in visible-GPU order.
RESERVE = "VLLM_DUALGPU_RESERVE"
# 1 GiB: at 256 MiB an H200 pair ran out of memory in FlashInfer autotune's warm-up runs
# (docs/benchmarks.md); llama.cpp's --fit keeps the same margin by default.
DEFAULT_RESERVE_BYTES = 1024**3
# What the split search maximises: pool (default), speed or auto (see docs/planner.md).
OBJECTIVE = "VLLM_DUALGPU_OBJECTIVE"
# Set by the executor for its workers: each rank's predicted KV budget in bytes, in rank order.
RANK_PREDICTED = "VLLM_DUALGPU_RANK_PREDICTED"
# Where the executor writes the plan it applied, as JSON (optional).
PLAN_FILE = "VLLM_DUALGPU_PLAN_FILE"
# Set by the executor for its workers: each rank's reserve in bytes, in rank order.
RANK_RESERVES = "VLLM_DUALGPU_RANK_RESERVES"
# Set by the executor for its workers: a per-rank cap on the budget (explicit utilization).
RANK_CAPS = "VLLM_DUALGPU_RANK_CAPS"

def parse_size(text: str, *, what: str = "size") -> int:
    """'1.5GiB' -> bytes: the planner's reader (bare numbers are GiB below 1024, else bytes)."""
    from vllm_dualgpu.planner.gpus import parse_size as _parse

    return _parse(text, what=what)


def parse_reserve(text: str | None, num_gpus: int) -> list[int]:
    """``VLLM_DUALGPU_RESERVE``: one size for every GPU, or one per visible GPU ('0,1.5GiB')."""
    if text is None or text.strip() == "":
        return [DEFAULT_RESERVE_BYTES] * num_gpus
    parts = [p for p in text.split(",")]
    sizes = [parse_size(p, what=RESERVE) for p in parts]
    if len(sizes) == 1:
        return sizes * num_gpus
    if len(sizes) != num_gpus:
        raise ValueError(
            f"{RESERVE}={text!r} names {len(sizes)} reserves for {num_gpus} visible GPUs; give "
            f"one value for all or exactly {num_gpus} comma-separated values in visible-GPU order"
        )
    return sizes


def parse_partition(text: str | None, num_layers: int, pp_size: int) -> list[int] | None:
    """A user's ``VLLM_PP_LAYER_PARTITION``, checked the way vLLM will check it."""
    if text is None or text.strip() == "":
        return None
    try:
        parts = [int(p) for p in text.split(",")]
    except ValueError:
        raise ValueError(
            f"VLLM_PP_LAYER_PARTITION={text!r} is not a comma-separated list of layer counts"
        ) from None
    if len(parts) != pp_size or sum(parts) != num_layers or min(parts) < 1:
        raise ValueError(
            f"VLLM_PP_LAYER_PARTITION={text!r} must give {pp_size} positive layer counts "
            f"summing to the model's {num_layers} layers"
        )
    return parts


def rank_values(env: str, rank: int) -> int | None:
    text = os.environ.get(env)
    if not text:
        return None
    values = [int(v) for v in text.split(",")]
    return values[rank] if rank < len(values) else None

# --- tool-call parser fixes (issue #16; patches/tool_parsers_qwen3_xml.py) ---
# 0 (or false/no/off) leaves vLLM's tool parsers as shipped: the registry entries that name it in
# Patch.opt_out are not applied (they fix vLLM's front end for every executor, not only dualgpu).
TOOL_PARSER_FIXES = "VLLM_DUALGPU_TOOL_PARSER_FIXES"
