"""The environment variables vllm-dualgpu reads, parsed with errors that say what to write."""

from __future__ import annotations

import os


# Per-GPU memory kept free for other programs (a desktop, a browser), in visible-GPU order.
RESERVE = "VLLM_DUALGPU_RESERVE"
# 1 GiB: at 256 MiB an H200 pair ran out of memory in FlashInfer autotune's warm-up runs
# (docs/benchmarks.md); llama.cpp's --fit keeps the same margin by default.
DEFAULT_RESERVE_BYTES = 1024**3
# Which split the search takes: speed (default), pool or auto (= speed); planner/objective.py.
OBJECTIVE = "VLLM_DUALGPU_OBJECTIVE"
# Where the executor writes the plan it applied, as JSON (optional).
PLAN_FILE = "VLLM_DUALGPU_PLAN_FILE"
# The machine profile `vllm-dualgpu calibrate` writes and `plan` and the executor read
# (default: $XDG_CACHE_HOME/vllm-dualgpu/machine-profile.json; "none": no profile).
MACHINE_PROFILE = "VLLM_DUALGPU_MACHINE_PROFILE"


def objective() -> str:
    """``VLLM_DUALGPU_OBJECTIVE``, else the planner's default objective: the executor and
    ``vllm-dualgpu plan`` both ask the planner with this value (an unknown one is the planner's
    BadRequest)."""
    from vllm_dualgpu.planner.objective import DEFAULT_OBJECTIVE

    return os.environ.get(OBJECTIVE, "").strip().lower() or DEFAULT_OBJECTIVE


def allow_long_max_model_len() -> bool:
    """vLLM's ``VLLM_ALLOW_LONG_MAX_MODEL_LEN`` (vllm/envs.py: '1' or 'true'): a --max-model-len
    above the model's maximum is then accepted with a warning. The planner takes it in its
    request (PlanRequest.allow_long_max_model_len)."""
    return os.environ.get("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "0").strip().lower() in ("1", "true")


def parse_size(text: str, *, what: str = "size") -> int:
    """'1.5GiB' -> bytes: the planner's reader (bare numbers are GiB below 1024, else bytes)."""
    from vllm_dualgpu.planner.gpus import parse_size as _parse

    return _parse(text, what=what)


def parse_reserve_sizes(text: str | None) -> list[int]:
    """``VLLM_DUALGPU_RESERVE`` as sizes: one for every GPU, or one per visible GPU ('0,1.5GiB');
    unset or empty: the default for every GPU (one value)."""
    if text is None or text.strip() == "":
        return [DEFAULT_RESERVE_BYTES]
    return [parse_size(p, what=RESERVE) for p in text.split(",")]


def expand_reserves(sizes: list[int], num_gpus: int, text: str | None = None) -> list[int]:
    """One reserve per visible GPU from :func:`parse_reserve_sizes`' sizes."""
    if len(sizes) == 1:
        return sizes * num_gpus
    if len(sizes) != num_gpus:
        shown = text if text is not None else ",".join(map(str, sizes))
        raise ValueError(
            f"{RESERVE}={shown!r} names {len(sizes)} reserves for {num_gpus} visible GPUs; give "
            f"one value for all or exactly {num_gpus} comma-separated values in visible-GPU order"
        )
    return list(sizes)


def parse_reserve(text: str | None, num_gpus: int) -> list[int]:
    """``VLLM_DUALGPU_RESERVE`` for ``num_gpus`` visible GPUs (the offline ``plan`` command)."""
    return expand_reserves(parse_reserve_sizes(text), num_gpus, text)


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


# --- tool-call parser fixes (issue #16; patches/tool_parsers_qwen3_xml.py) ---
# 0 (or false/no/off) leaves vLLM's tool parsers as shipped: the registry entries that name it in
# Patch.opt_out are not applied (they fix vLLM's front end for every executor, not only dualgpu).
TOOL_PARSER_FIXES = "VLLM_DUALGPU_TOOL_PARSER_FIXES"
