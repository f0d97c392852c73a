"""The planner: GPU order, layer split and KV pool for vLLM pipeline parallelism on mismatched GPUs.

Pure arithmetic over a model's ``config.json`` and a few facts per GPU; it imports neither
vLLM, torch nor pynvml, so it runs anywhere (``vllm-dualgpu plan``) and is cheap to call from
the executor. Typical use::

    from vllm_dualgpu.planner import GpuFacts, ModelSpec, PlanRequest, plan

    model = ModelSpec.from_hf_config(json.load(open("config.json")))
    p = plan(model, gpus, PlanRequest(max_model_len=262144, kv_cache_dtype="fp8"))
    p.order, p.partition_env(), p.num_blocks, p.ranks[0].kv_bytes_per_block

See docs/planner.md for the memory model and how it mirrors vLLM's own KV arithmetic.
"""

from __future__ import annotations

import json
from importlib import resources

from vllm_dualgpu.planner.errors import (
    BadRequest,
    ContextTooLong,
    ModelDoesNotFit,
    PlanError,
    UnsupportedModel,
)
from vllm_dualgpu.planner.formats import FormatResolver, WeightFormat, weight_format
from vllm_dualgpu.planner.gpus import KNOWN_GPUS, GpuFacts, lookup, parse_gpus, parse_size, reference_pair
from vllm_dualgpu.planner.kv import KVLayout, PricedGroup
from vllm_dualgpu.planner.memory import MemoryModel
from vllm_dualgpu.planner.model import DrafterSpec, ModelSpec
from vllm_dualgpu.planner.search import (
    Fit,
    Plan,
    PlanRequest,
    RankPlan,
    StockEstimate,
    check_stock,
    even_partition,
    fit,
    fit_stock,
    plan,
    stock_estimate,
)

#: Bundled reference configs (``vllm_dualgpu/planner/reference/<name>.json``).
REFERENCE_MODELS = ("qwen3.8-27b", "qwen3-14b")


def reference_config(name: str = "qwen3.8-27b") -> dict:
    """The contents of a bundled reference ``config.json``."""
    if name not in REFERENCE_MODELS:
        raise BadRequest(f"unknown reference model {name!r}; use one of {', '.join(REFERENCE_MODELS)}")
    text = resources.files("vllm_dualgpu.planner").joinpath("reference", f"{name}.json").read_text()
    return json.loads(text)


__all__ = [
    "BadRequest",
    "check_stock",
    "ContextTooLong",
    "DrafterSpec",
    "Fit",
    "FormatResolver",
    "GpuFacts",
    "KNOWN_GPUS",
    "KVLayout",
    "PricedGroup",
    "MemoryModel",
    "ModelDoesNotFit",
    "ModelSpec",
    "Plan",
    "PlanError",
    "PlanRequest",
    "REFERENCE_MODELS",
    "RankPlan",
    "StockEstimate",
    "UnsupportedModel",
    "WeightFormat",
    "even_partition",
    "fit",
    "fit_stock",
    "lookup",
    "parse_gpus",
    "parse_size",
    "plan",
    "reference_config",
    "reference_pair",
    "stock_estimate",
    "weight_format",
]
