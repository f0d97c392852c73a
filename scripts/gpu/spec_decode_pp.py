#!/usr/bin/env python3
"""MTP and EAGLE3 speculative decoding with PP=2 through the dualgpu executor, on a small Qwen3.5 hybrid.

    python scripts/gpu/spec_decode_pp.py OUTDIR [--method {mtp,eagle3,both}] [--timeout S] [--dry-run]

Writes OUTDIR/model/config.json (a text-only Qwen3.5: Gated DeltaNet + full attention layers,
one MTP layer; random weights through load_format="dummy") and runs one arm per method
(default ``both``: MTP, then EAGLE3, then stock vLLM with the EAGLE3 config). Each arm is one
``vllm.LLM`` in a child process; ``--timeout`` is the time for all of them together (default
210 s with ``--method mtp``, as before, else 240 s; an arm gets what is left minus a minimum
kept for the arms after it: the MTP arm at most 120 s, the stock arm at least 45 s).

MTP arm: ``vllm.LLM`` with pipeline_parallel_size=2, distributed_executor_backend="dualgpu" and
speculative_config={"method": "mtp", "num_speculative_tokens": 2}, generates for a few
token-id prompts (one of them twice, so the second run is a prefix-cache hit through the GDN
layers) and writes OUTDIR/spec_decode_pp.json:

- per-rank facts read inside each worker (``collective_rpc``): PP rank, torch allocated and
  reserved bytes, ``max_concurrent_batches`` as the worker sees it, whether the drafter's
  embedding is the target's module, how many embedding-sized weights the rank holds;
- per-process GPU memory sampled with NVML from outside (peak and at the end), plus one
  ``nvidia-smi --query-compute-apps`` snapshot;
- the plugin's per-process summary lines (EngineCore and workers must list the issue #6
  patches), boot and generation times, output token ids.

With ``--method mtp`` the JSON is exactly what this script wrote before the EAGLE3 arm existed;
with ``both`` the same keys hold the MTP arm, and "eagle3" and "stock_eagle3" are added.

EAGLE3 arm (issue #6 item 4: "an EAGLE3 drafter config under PP=2 boots and generates; stock
refuses"). OUTDIR/drafter-eagle3/config.json is a one-layer EAGLE3 drafter for the target, also
dummy weights. Choices (vLLM 0.30.0 file:line, under site-packages/vllm/):

- Architecture ``LlamaForCausalLMEagle3``, model_type ``llama``: the registry maps it to
  ``llama_eagle3.Eagle3LlamaForCausalLM`` (model_executor/models/registry.py:663), the class
  vLLM uses for most EAGLE3 drafters, Qwen ones included (Eagle3Qwen2_5vl/Eagle3Qwen3vl, :664-665),
  and the format EAGLE3 training tools (SpecForge, TensorRT Model Optimizer) export whatever the
  target. ``EAGLEConfig`` keeps a name ending in "Eagle3" (transformers_utils/configs/eagle.py:55-63).
  No Qwen3.5-specific EAGLE3 drafter exists in 0.30; ``Eagle3Qwen3ForCausalLM``
  (qwen3_eagle3.py, registry.py:666) would only add q/k norms.
- hidden_size 1024 = the target's: the drafter's first layer concatenates its embedding with
  the fc-combined target states (llama_eagle3.py:82, forward asserts equal widths :270), and
  under PP the plugin's ``drafter-shares-target-embed`` gives it the target's embedding.
- vocab_size = draft_vocab_size = the target's 8192: no d2t table (llama_eagle3.py:339), and the
  target's lm_head is shared with the drafter (``_should_share``,
  v1/worker/gpu/spec_decode/eagle/utils.py:14 and :127; dummy weights never set has_own_lm_head).
- ``eagle_aux_hidden_state_layer_ids`` [2, 4, 5]: the runner reads the target's layers from this
  top-level key (v1/worker/gpu/spec_decode/eagle/eagle3_utils.py:106); the same list is vLLM's
  default for 8 layers ((2, n//2, n-3), model_executor/models/interfaces.py:1733). It is repeated
  in ``eagle_config`` because the drafter sizes its fc input from that dict (3 when absent,
  llama_eagle3.py:213-221). A state with id L is captured after layer L-1, so with the even 4/4
  split ids 2 and 4 are captured on rank 0 and must be relayed to rank 1, id 5 on rank 1.
- num_speculative_tokens 2, no parallel drafting (P-EAGLE is not in the V2 runner,
  config/vllm.py:2855-2859).

The EAGLE3 arm boots with the dualgpu executor, generates the same prompts (and the repeat),
reads the same per-rank facts plus each rank's auxiliary layers, and records the spec-decode
counters (``LLM.get_metrics()``; ``disable_log_stats=False`` in this arm only) and vLLM's
"SpecDecoding metrics" log lines. Its checks: generation finished, the drafter
(``Eagle3LlamaForCausalLM``) on the last rank only, both decoders declare the relay, the workers'
rank summary lines ("vllm-dualgpu rank N/2: ...") list ``qwen3-next-aux-hidden-relay`` and
``qwen3-5-aux-hidden-layers`` under "patched once the device was set", the workers' plugin line
lists ``qwen3-next-aux-hidden-flag`` and the EngineCore's its issue #6 patches. The acceptance
rate is recorded, not checked (random weights).

Stock arm: the same EAGLE3 config with distributed_executor_backend="mp". vLLM 0.30 accepts it
at ``create_engine_config()`` (the dry run shows this), so the refusal can only be seen in the
workers: the V2 runner's ``load_model`` (v1/worker/gpu/model_runner.py:411-416) calls
``verify_supports_aux_hidden_states_over_pp`` (eagle3_utils.py:44), which raises
"Qwen3_5ForCausalLM does not support eagle3 with pipeline parallelism". The arm boots stock,
captures that message from its log and the exception ``LLM`` raised; the check passes only if
the message is there and the engine did not boot.

vLLM runs in a child process in its own process group, logging to OUTDIR/llm.log (EAGLE3:
eagle3-llm.log, stock: stock-eagle3-llm.log); the whole group is killed on exit, on a signal and
at the arm's time limit. Exit code 0 only if every arm finished and the checks in "checks" hold.

``--dry-run`` (no GPU needed; sets VLLM_TARGET_DEVICE=cpu): writes the model config and builds
the engine config with ``EngineArgs(...).create_engine_config()`` in this process, then checks
the architecture, the drafter, the executor class and the spec-decoding settings. For EAGLE3 it
also writes the drafter config, builds the config with the dualgpu executor (the plugin's
preflight runs inside, and is run again with 2 GPUs assumed), checks the drafter class, sizes,
auxiliary layers and which rank captures each, then builds the stock ("mp") config (accepted)
and runs vLLM's own worker check on the stock Qwen3.5 decoder (refused).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from gpurun import RUNNING, applied_names, gdn_prefill_config, kill_running_on_exit  # noqa: E402

GiB = 1024**3

MODEL_CONFIG = {
    "architectures": ["Qwen3_5ForCausalLM"],
    "model_type": "qwen3_5_text",
    "vocab_size": 8192,
    "hidden_size": 1024,
    "intermediate_size": 2048,
    "num_hidden_layers": 8,  # 6 Gated DeltaNet + 2 full attention; 4 layers per PP rank
    "full_attention_interval": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 128,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_num_key_heads": 4,
    "linear_num_value_heads": 8,
    "mtp_num_hidden_layers": 1,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1000000, "partial_rotary_factor": 0.25},
    "hidden_act": "silu",
    "attention_bias": False,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "bos_token_id": 1,
    "eos_token_id": 2,
}

NUM_SPEC = 2
# The issue #6 patches each process kind must report as applied in its plugin line.
ENGINE_PATCHES = ("pp-inflight-batches",)
WORKER_PATCHES = ("pp-inflight-batches", "drafter-shares-target-embed")

# --- EAGLE3 (see the docstring for the vLLM lines behind each choice) --------------------------
EAGLE3_AUX_LAYERS = [2, 4, 5]  # = vLLM's default for 8 layers: (2, n // 2, n - 3)
# The drafter's shapes and settings are the target's (a Llama layer of the same width).
_FROM_TARGET = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                "head_dim", "vocab_size", "max_position_embeddings", "rms_norm_eps", "hidden_act",
                "attention_bias", "tie_word_embeddings", "torch_dtype", "bos_token_id", "eos_token_id")
EAGLE3_CONFIG = {
    "architectures": ["LlamaForCausalLMEagle3"],
    "model_type": "llama",
    **{k: MODEL_CONFIG[k] for k in _FROM_TARGET},
    "num_hidden_layers": 1,
    "draft_vocab_size": MODEL_CONFIG["vocab_size"],
    "rope_parameters": {"rope_type": "default", "rope_theta": 1000000},
    # The runner reads the target's layers here; the drafter sizes its fc from eagle_config.
    "eagle_aux_hidden_state_layer_ids": EAGLE3_AUX_LAYERS,
    "eagle_config": {"eagle_aux_hidden_state_layer_ids": EAGLE3_AUX_LAYERS, "use_aux_hidden_state": True},
}
EAGLE3_DRAFTER_CLASS = "vllm.model_executor.models.llama_eagle3.Eagle3LlamaForCausalLM"
# Applied in each worker once its device is set, listed in the rank's summary line.
DEVICE_PATCHES = ("qwen3-next-aux-hidden-relay", "qwen3-5-aux-hidden-layers")
DEVICE_PHASE_KEY = "patched once the device was set"
EAGLE3_WORKER_PATCHES = ("pp-inflight-batches", "qwen3-next-aux-hidden-flag")
# vLLM's refusal (verify_supports_aux_hidden_states_over_pp, eagle3_utils.py:44).
STOCK_REFUSAL = r"(\w+) does not support eagle3 with pipeline parallelism"

METHODS = ("mtp", "eagle3", "both")
ARMS = ("mtp", "eagle3", "stock-eagle3")
# Per arm: result file of the child, the file the parent writes after its memory snapshot, log.
ARM_FILES = {
    "mtp": ("child.json", "snapshot.done", "llm.log"),
    "eagle3": ("eagle3-child.json", "eagle3-snapshot.done", "eagle3-llm.log"),
    "stock-eagle3": ("stock-eagle3-child.json", None, "stock-eagle3-llm.log"),
}
# Seconds an arm keeps for itself when an earlier arm's limit is computed.
ARM_MIN_S = {"mtp": 90, "eagle3": 75, "stock-eagle3": 45}


def arms_of(method: str) -> tuple[str, ...]:
    return {"mtp": ("mtp",), "eagle3": ("eagle3", "stock-eagle3"), "both": ARMS}[method]


def default_timeout(method: str) -> float:
    return 210.0 if method == "mtp" else 240.0


def engine_kwargs(model_dir: Path, arm: str = "mtp", drafter: Path | None = None) -> dict:
    kw = dict(
        model=str(model_dir),
        load_format="dummy",
        skip_tokenizer_init=True,
        pipeline_parallel_size=2,
        distributed_executor_backend="dualgpu",
        speculative_config={"method": "mtp", "num_speculative_tokens": NUM_SPEC},
        enforce_eager=True,
        max_model_len=4096,
        gpu_memory_utilization=0.3,
        seed=0,
        additional_config=gdn_prefill_config(),
    )
    if arm == "mtp":
        return kw
    if arm not in ARMS:
        raise ValueError(f"unknown arm {arm!r}")
    kw["speculative_config"] = {"method": "eagle3", "model": str(drafter or model_dir.parent / "drafter-eagle3"),
                                "num_speculative_tokens": NUM_SPEC}
    kw["disable_log_stats"] = False  # LLM.get_metrics() needs the stat loggers
    if arm == "stock-eagle3":
        kw["distributed_executor_backend"] = "mp"
    return kw


def prompts() -> list[list[int]]:
    """Token-id prompts: three short ones and one long one (several KV blocks)."""
    def ids(start: int, n: int) -> list[int]:
        return [3 + (start + 7 * i) % 8000 for i in range(n)]

    return [ids(11, 24), ids(500, 90), ids(1234, 300), ids(4321, 1500)]


def write_model(out: Path) -> Path:
    model = out / "model"
    model.mkdir(parents=True, exist_ok=True)
    (model / "config.json").write_text(json.dumps(MODEL_CONFIG, indent=1))
    return model


def write_drafter(out: Path) -> Path:
    """The EAGLE3 drafter's config next to the target's (dummy weights, as the target)."""
    drafter = out / "drafter-eagle3"
    drafter.mkdir(parents=True, exist_ok=True)
    (drafter / "config.json").write_text(json.dumps(EAGLE3_CONFIG, indent=1))
    return drafter


def aux_layer_ranks(layer_ids, bounds: list[tuple[int, int]]) -> dict[int, int]:
    """The PP rank that captures each auxiliary state, given each rank's layers [start, end)
    (vLLM's ``get_pp_indices``). Id L is the state after layer L - 1 (id 0, the input, on the
    first rank: ``_maybe_add_hidden_state(..., idx + 1, ...)``), so a rank captures the ids in
    (start, end]; the slot base of a later rank is ``bisect_right(layers, start_layer)``
    (model_executor/models/interfaces.py:1595)."""
    ranks = {}
    for layer in layer_ids:
        for rank, (lo, hi) in enumerate(bounds):
            if (layer == 0 and rank == 0) or lo < layer <= hi:
                ranks[int(layer)] = rank
                break
    return ranks


# --- dry run (CPU) ---------------------------------------------------------------------------


def _cpu_inspection_shim() -> str | None:
    """Let vLLM inspect Qwen3.5 on a CPU machine without torchvision.

    ``vllm.model_executor.models.qwen3_5`` imports transformers' Qwen2-VL image processor, which
    imports torchvision. CPU development installs often lack it, and vLLM inspects model classes
    in a subprocess. Without torchvision, inspect in this process (no CUDA to protect here) with
    an empty ``torchvision.transforms.v2.functional`` module; transformers has already recorded
    that torchvision is missing, so nothing else uses the stub. Dry runs only.
    """
    try:
        import torchvision  # noqa: F401

        return None
    except ImportError:
        pass
    import importlib.machinery
    import types

    import vllm.engine.arg_utils  # noqa: F401  (transformers decides torchvision is absent)
    import vllm.model_executor.models.registry as registry

    for name in ("torchvision", "torchvision.transforms", "torchvision.transforms.v2",
                 "torchvision.transforms.v2.functional"):
        mod = types.ModuleType(name)
        mod.__spec__ = importlib.machinery.ModuleSpec(name, None)
        mod.__path__ = []
        sys.modules.setdefault(name, mod)
    registry._run_in_subprocess = lambda fn: fn()
    return "torchvision missing: model class inspected in-process with a stub"


def dry_run(out: Path, model: Path, method: str = "mtp") -> int:
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    shim = _cpu_inspection_shim()
    result: dict = {"mode": "dry-run", "shim": shim}
    checks: dict = {}
    if "mtp" in arms_of(method):
        facts, checks = dry_run_mtp(model)
        result.update(facts=facts, checks=checks)
    if "eagle3" in arms_of(method):
        drafter = write_drafter(out)
        result["eagle3"] = dry_run_eagle3(model, drafter)
        result["stock_eagle3"] = dry_run_stock_eagle3(model, drafter)
        checks = {**checks, **prefixed("eagle3", result["eagle3"]["checks"]),
                  **prefixed("stock", result["stock_eagle3"]["checks"])}
        result["checks"] = checks
    result["ok"] = all(checks.values())
    (out / "spec_decode_pp.json").write_text(json.dumps(result, indent=1, default=str))
    print(json.dumps(result, default=str))
    return 0 if result["ok"] else 1


def prefixed(prefix: str, checks: dict) -> dict:
    return {f"{prefix}: {k}": v for k, v in checks.items()}


def dry_run_mtp(model: Path) -> tuple[dict, dict]:
    from vllm.engine.arg_utils import EngineArgs

    cfg = EngineArgs(**engine_kwargs(model)).create_engine_config()
    spec = cfg.speculative_config
    backend = cfg.parallel_config.distributed_executor_backend
    facts = {
        "architectures": cfg.model_config.architectures,
        "model_type": cfg.model_config.hf_config.model_type,
        "is_hybrid": cfg.model_config.is_hybrid,
        "draft_architectures": spec.draft_model_config.architectures if spec else None,
        "spec_method": spec.method if spec else None,
        "num_speculative_tokens": spec.num_speculative_tokens if spec else None,
        "executor": getattr(backend, "__name__", str(backend)),
        "pipeline_parallel_size": cfg.parallel_config.pipeline_parallel_size,
        "block_size": cfg.cache_config.block_size,
        "mamba_cache_mode": cfg.cache_config.mamba_cache_mode,
        "enable_prefix_caching": cfg.cache_config.enable_prefix_caching,
        "max_model_len": cfg.model_config.max_model_len,
        "num_prompts": len(prompts()),
    }
    checks = {
        "qwen3.5 hybrid target": facts["architectures"] == ["Qwen3_5ForCausalLM"] and facts["is_hybrid"],
        "mtp drafter": facts["draft_architectures"] == ["Qwen3_5MTP"] and facts["spec_method"] == "mtp",
        "dualgpu executor": facts["executor"] == "DualGpuExecutor",
        "pp=2": facts["pipeline_parallel_size"] == 2,
        "prompts fit": max(map(len, prompts())) + 128 <= facts["max_model_len"],
    }
    return facts, checks


def dry_run_eagle3(model: Path, drafter: Path) -> dict:
    """The EAGLE3 arm's engine config with the dualgpu executor, as the GPU run builds it."""
    from vllm.distributed.utils import get_pp_indices
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.models.registry import ModelRegistry
    from vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils import get_eagle3_aux_layers_from_config

    from vllm_dualgpu.engine import preflight

    cfg = EngineArgs(**engine_kwargs(model, "eagle3", drafter)).create_engine_config()  # preflight inside
    spec = cfg.speculative_config
    draft = spec.draft_model_config
    entry = ModelRegistry.models.get(draft.architecture)
    pp = cfg.parallel_config.pipeline_parallel_size
    num_layers = cfg.model_config.get_total_num_hidden_layers()
    aux = get_eagle3_aux_layers_from_config(spec)
    ranks = aux_layer_ranks(aux or (), [get_pp_indices(num_layers, r, pp) for r in range(pp)])
    try:
        preflight_result = {"warnings": preflight.check(cfg, 2)}  # as with two GPUs visible
    except Exception as exc:
        preflight_result = {"error": f"{type(exc).__name__}: {exc}"}
    try:
        v2_blockers = cfg._get_v2_model_runner_unsupported_features()
    except Exception as exc:  # private in vLLM; informational
        v2_blockers = [f"unknown: {exc!r}"]
    backend = cfg.parallel_config.distributed_executor_backend
    eagle_config = getattr(draft.hf_config, "eagle_config", None) or {}
    facts = {
        "drafter_config": str(drafter / "config.json"),
        "spec_method": spec.method,
        "num_speculative_tokens": spec.num_speculative_tokens,
        "parallel_drafting": spec.parallel_drafting,
        "draft_architectures": draft.architectures,
        "draft_model_class": f"{entry.module_name}.{entry.class_name}" if entry is not None else None,
        "draft_hf_config": type(draft.hf_config).__name__,
        "draft_hidden_size": draft.hf_config.hidden_size,
        "target_hidden_size": cfg.model_config.get_hidden_size(),
        "draft_vocab_size": getattr(draft.hf_config, "draft_vocab_size", None) or draft.get_vocab_size(),
        "target_vocab_size": cfg.model_config.get_vocab_size(),
        "aux_layers": list(aux) if aux else None,
        "drafter_fc_aux_count": len(eagle_config.get("eagle_aux_hidden_state_layer_ids") or ()) or 3,
        "target_layers": num_layers,
        "aux_layer_ranks": ranks,
        "executor": getattr(backend, "__name__", str(backend)),
        "pipeline_parallel_size": pp,
        "block_size": cfg.cache_config.block_size,
        "mamba_cache_mode": cfg.cache_config.mamba_cache_mode,
        "v2_runner_blockers": v2_blockers,
        "preflight": preflight_result,
        "aux_relay_problem": preflight.aux_relay_problem(cfg.model_config.architectures),
    }
    checks = {
        "eagle3 drafter": spec.method == "eagle3" and facts["draft_model_class"] == EAGLE3_DRAFTER_CLASS,
        "drafter width and vocab are the target's": facts["draft_hidden_size"] == facts["target_hidden_size"]
        and facts["draft_vocab_size"] == facts["target_vocab_size"],
        "aux layers from the drafter config": facts["aux_layers"] == EAGLE3_AUX_LAYERS
        and facts["drafter_fc_aux_count"] == len(EAGLE3_AUX_LAYERS),
        "aux states captured on both ranks": pp == 2 and sorted(set(ranks.values())) == [0, 1]
        and len(ranks) == len(aux or ()),
        "dualgpu executor": facts["executor"] == "DualGpuExecutor",
        "pp=2": pp == 2,
        "num_speculative_tokens": spec.num_speculative_tokens == NUM_SPEC and not spec.parallel_drafting,
        "V2 runner takes it": v2_blockers == [],
        "preflight accepts": "error" not in preflight_result and facts["aux_relay_problem"] == "",
    }
    return {"facts": facts, "checks": checks}


def dry_run_stock_eagle3(model: Path, drafter: Path) -> dict:
    """Stock vLLM ("mp") with the same EAGLE3 config: accepted at config time, refused by vLLM's
    own worker check, which is run here on the stock decoder (an uninitialised instance of
    vLLM's classes; nothing of the plugin applies in this process's model module)."""
    from vllm.engine.arg_utils import EngineArgs

    facts: dict = {}
    try:
        cfg = EngineArgs(**engine_kwargs(model, "stock-eagle3", drafter)).create_engine_config()
        facts["config"] = "accepted"
        facts["executor"] = str(cfg.parallel_config.distributed_executor_backend)
        facts["spec_method"] = cfg.speculative_config.method
    except Exception as exc:
        facts["config"] = f"refused: {type(exc).__name__}: {exc}"
    facts["worker_check"] = stock_worker_check()
    checks = {
        "config accepted with mp (refusal only in the worker)": facts["config"] == "accepted"
        and facts.get("executor") == "mp",
        "vLLM's worker check refuses the stock decoder": bool(re.search(STOCK_REFUSAL, facts["worker_check"])),
    }
    return {"facts": facts, "checks": checks}


def stock_worker_check() -> str:
    """What ``verify_supports_aux_hidden_states_over_pp`` (eagle3_utils.py:44, called by the V2
    runner's load_model under PP) says about vLLM's Qwen3_5ForCausalLM."""
    from torch import nn
    from vllm.model_executor.models.qwen3_5 import Qwen3_5ForCausalLM, Qwen3_5Model
    from vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils import verify_supports_aux_hidden_states_over_pp

    model = Qwen3_5ForCausalLM.__new__(Qwen3_5ForCausalLM)
    nn.Module.__init__(model)
    decoder = Qwen3_5Model.__new__(Qwen3_5Model)
    nn.Module.__init__(decoder)
    model.model = decoder
    try:
        verify_supports_aux_hidden_states_over_pp(model, "eagle3")
    except ValueError as exc:
        return f"refused: {exc}"
    return "accepted"


# --- child: vLLM itself ------------------------------------------------------------------------


def probe_worker(worker) -> dict:
    """Runs inside each worker (collective_rpc): facts only the worker can see."""
    import torch
    from vllm.distributed.parallel_state import get_pp_group

    runner = worker.model_runner
    target = runner.model
    language = target.get_language_model() if hasattr(target, "get_language_model") else target
    vocab = worker.vllm_config.model_config.get_vocab_size()
    facts = {
        "pp_rank": get_pp_group().rank_in_group,
        "pid": os.getpid(),
        "cuda_device": torch.cuda.current_device(),
        "allocated": torch.cuda.memory_allocated(),
        "reserved": torch.cuda.memory_reserved(),
        "max_concurrent_batches": worker.vllm_config.max_concurrent_batches,
        "runner": type(runner).__module__ + "." + type(runner).__name__,
        "dualgpu_env": os.environ.get("VLLM_DUALGPU_ACTIVE"),
    }
    modules = [target]
    # V2 runner: runner.speculator.model; V1 runner: runner.drafter.model.
    holder = getattr(runner, "speculator", None) or getattr(runner, "drafter", None)
    drafter = getattr(holder, "model", None)
    if drafter is not None:
        modules.append(drafter)
        t_embed = getattr(getattr(language, "model", None), "embed_tokens", None)
        d_embed = getattr(getattr(drafter, "model", None), "embed_tokens", None)
        facts["drafter"] = type(drafter).__name__
        facts["drafter_embed_is_target_embed"] = d_embed is not None and d_embed is t_embed
        facts["drafter_param_bytes"] = sum(p.numel() * p.element_size() for p in drafter.parameters())
    seen, embeds = set(), 0
    for module in modules:
        for p in module.parameters():
            if p.data_ptr() in seen:
                continue
            seen.add(p.data_ptr())
            if p.dim() == 2 and p.shape[0] >= vocab // 2:  # vocab-parallel embeddings and heads
                embeds += 1
    facts["vocab_sized_weights"] = embeds
    decoder = getattr(language, "model", None)
    aux = tuple(getattr(decoder, "aux_hidden_state_layers", ()) or ())
    if aux:  # EAGLE3: what the target captures and relays on this rank
        facts["aux_hidden_state_layers"] = list(aux)
        facts["supports_aux_hidden_states_over_pp"] = bool(getattr(decoder, "supports_aux_hidden_states_over_pp", False))
        facts["aux_slot_base"] = getattr(decoder, "_aux_slot_base_cached", None)
        facts["decoder_layers"] = [getattr(decoder, "start_layer", None), getattr(decoder, "end_layer", None)]
    return facts


def child(out: Path, model: Path, arm: str = "mtp") -> int:
    if arm == "stock-eagle3":
        return child_stock(out, model)
    result_name, snapshot_name, _ = ARM_FILES[arm]
    drafter = write_drafter(out) if arm == "eagle3" else None
    t0 = time.time()
    from vllm import LLM, SamplingParams

    llm = LLM(**engine_kwargs(model, arm, drafter))
    res: dict = {"boot_s": round(time.time() - t0, 1)}
    cfg = llm.llm_engine.vllm_config
    res["block_size"] = cfg.cache_config.block_size
    res["num_gpu_blocks"] = cfg.cache_config.num_gpu_blocks
    sp = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True, detokenize=False)
    ps = prompts()
    t1 = time.time()
    outs = llm.generate([{"prompt_token_ids": p} for p in ps], sp, use_tqdm=False)
    res["generate_s"] = round(time.time() - t1, 2)
    res["outputs"] = [list(o.outputs[0].token_ids) for o in outs]
    # The long prompt again: a prefix-cache hit that restores GDN state.
    t2 = time.time()
    again = llm.generate([{"prompt_token_ids": ps[-1]}], sp, use_tqdm=False)[0]
    res["repeat_s"] = round(time.time() - t2, 2)
    res["repeat_num_cached_tokens"] = again.num_cached_tokens
    res["repeat_same_output"] = list(again.outputs[0].token_ids) == res["outputs"][-1]
    res["workers"] = llm.collective_rpc(probe_worker, timeout=60)
    try:
        metrics = llm.get_metrics()
        res["spec_metrics"] = {m.name: getattr(m, "value", getattr(m, "values", None))
                               for m in metrics if "spec_decode" in m.name}
    except Exception as exc:  # metrics are informational
        res["spec_metrics_error"] = repr(exc)
    if arm == "eagle3":
        res["acceptance"] = acceptance(res.get("spec_metrics") or {})
    res["total_s"] = round(time.time() - t0, 1)
    (out / result_name).write_text(json.dumps(res, indent=1, default=str))
    # Let the parent take its end-of-run memory snapshot while everything is still loaded.
    end = time.time() + 15
    while time.time() < end and not (out / snapshot_name).exists():
        time.sleep(0.2)
    return 0


def acceptance(spec_metrics: dict) -> dict:
    """Acceptance rate and mean acceptance length from vLLM's spec-decode counters."""
    def total(suffix: str):
        for name, value in spec_metrics.items():
            if name.removesuffix("_total").endswith(suffix):
                return value
        return None

    drafts, draft_tokens = total("spec_decode_num_drafts"), total("spec_decode_num_draft_tokens")
    accepted = total("spec_decode_num_accepted_tokens")
    res = {"drafts": drafts, "draft_tokens": draft_tokens, "accepted_tokens": accepted,
           "accepted_per_position": total("spec_decode_num_accepted_tokens_per_pos")}
    if isinstance(draft_tokens, (int, float)) and draft_tokens and isinstance(accepted, (int, float)):
        res["acceptance_rate"] = round(accepted / draft_tokens, 4)
    if isinstance(drafts, (int, float)) and drafts and isinstance(accepted, (int, float)):
        res["mean_acceptance_length"] = round(1 + accepted / drafts, 3)
    return res


def child_stock(out: Path, model: Path) -> int:
    """Stock vLLM ("mp") with the EAGLE3 config: expected to fail while the workers load."""
    result_name = ARM_FILES["stock-eagle3"][0]
    drafter = write_drafter(out)
    t0 = time.time()
    res: dict = {}
    try:
        from vllm import LLM, SamplingParams

        llm = LLM(**engine_kwargs(model, "stock-eagle3", drafter))
        res["booted"] = True
        res["boot_s"] = round(time.time() - t0, 1)
        sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, detokenize=False)
        out_ = llm.generate([{"prompt_token_ids": prompts()[0]}], sp, use_tqdm=False)
        res["outputs"] = [list(o.outputs[0].token_ids) for o in out_]
    except Exception as exc:
        res.setdefault("booted", False)
        res["error"] = f"{type(exc).__name__}: {exc}"[:2000]
        res["failed_after_s"] = round(time.time() - t0, 1)
    (out / result_name).write_text(json.dumps(res, indent=1, default=str))
    return 0


# --- parent: process group, NVML, checks -------------------------------------------------------


class ProcessMemory:
    """Per-process GPU memory from NVML, sampled from outside vLLM."""

    def __init__(self):
        try:
            import pynvml
        except ImportError:
            from vllm.third_party import pynvml
        pynvml.nvmlInit()
        self.nvml = pynvml
        self.handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
        self.peak_device = [0] * len(self.handles)
        self.peak_process: dict[str, int] = {}

    def sample(self) -> dict:
        snap: dict = {"device_used": [], "processes": {}}
        for gpu, h in enumerate(self.handles):
            used = self.nvml.nvmlDeviceGetMemoryInfo(h).used
            snap["device_used"].append(used)
            self.peak_device[gpu] = max(self.peak_device[gpu], used)
            try:
                procs = self.nvml.nvmlDeviceGetComputeRunningProcesses(h)
            except self.nvml.NVMLError:
                procs = []
            for p in procs:
                key = f"gpu{gpu}:pid{p.pid}"
                mem = p.usedGpuMemory or 0
                snap["processes"][key] = mem
                self.peak_process[key] = max(self.peak_process.get(key, 0), mem)
        return snap


def _name_of(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:120].strip()
    except OSError:
        return "?"


def parent(out: Path, model: Path, timeout: float, method: str = "mtp") -> int:
    kill_running_on_exit()

    arms = arms_of(method)
    deadline = time.time() + timeout
    results: dict = {}
    for i, arm in enumerate(arms):
        # What is left, less the minimum the later arms keep for themselves.
        limit = deadline - time.time() - sum(ARM_MIN_S[a] for a in arms[i + 1:])
        results[arm] = run_arm(out, model, arm, max(limit, 10.0))
    if method == "mtp":
        result = results["mtp"]  # exactly the output of the MTP-only script
    else:
        result = {**results.get("mtp", {"mode": "gpu"}), "method": method,
                  "eagle3": results["eagle3"], "stock_eagle3": results["stock-eagle3"]}
        all_checks = dict(results["mtp"]["checks"]) if "mtp" in results else {}
        all_checks.update(prefixed("eagle3", results["eagle3"]["checks"]))
        all_checks.update(prefixed("stock", results["stock-eagle3"]["checks"]))
        result["checks"] = all_checks
        result["ok"] = all(r["ok"] for r in results.values())
        result["total_wall_s"] = round(sum(r["wall_s"] for r in results.values()), 1)
    (out / "spec_decode_pp.json").write_text(json.dumps(result, indent=1, default=str))
    summary = {k: result[k] for k in ("ok", "wall_s", "timed_out", "checks") if k in result}
    if "mtp" in results:
        summary["memory"] = result["memory"]["end_process_gib"] or result["memory"]["peak_device_used_gib"]
    if method != "mtp":
        summary["arms"] = {a: {k: r.get(k) for k in ("ok", "wall_s", "timed_out")} for a, r in results.items()}
    print(json.dumps(summary))
    return 0 if result["ok"] else 1


def run_arm(out: Path, model: Path, arm: str, timeout: float) -> dict:
    """Run one arm's vLLM child in its own process group; its facts, memory, log lines, checks."""
    from gpurun import grep, kill, start

    result_name, snapshot_name, log_name = ARM_FILES[arm]
    for stale in (result_name, snapshot_name):
        if stale:
            (out / stale).unlink(missing_ok=True)
    log = out / log_name
    drafter = write_drafter(out) if arm != "mtp" else None
    kwargs = {**engine_kwargs(model, arm, drafter), "model": "OUTDIR/model"}
    if drafter is not None:
        kwargs["speculative_config"] = {**kwargs["speculative_config"], "model": "OUTDIR/" + drafter.name}
    result: dict = {"mode": "gpu", "engine_kwargs": kwargs}
    if arm != "mtp":
        result["time_limit_s"] = round(timeout, 1)
    memory = ProcessMemory()
    t0 = time.time()
    cmd = [sys.executable, str(Path(__file__).resolve()), str(out), "--child"] + ([arm] if arm != "mtp" else [])
    proc = start(cmd, log, env={"VLLM_ALLOW_INSECURE_SERIALIZATION": "1"})
    RUNNING.append(proc)
    end_snapshot = None
    try:
        while time.time() - t0 < timeout and proc.poll() is None:
            memory.sample()
            if snapshot_name and end_snapshot is None and (out / result_name).exists():
                end_snapshot = memory.sample()
                smi = subprocess.run(
                    ["nvidia-smi", "--query-compute-apps=pid,gpu_uuid,used_memory", "--format=csv"],
                    capture_output=True, text=True, timeout=20)
                result["nvidia_smi_compute_apps"] = smi.stdout.strip().splitlines()
                (out / snapshot_name).write_text("1")
            time.sleep(0.25)
        result["timed_out"] = proc.poll() is None
        result["child_rc"] = proc.poll()
    finally:
        kill(proc, grace=3)
        RUNNING.remove(proc)
    result["wall_s"] = round(time.time() - t0, 1)
    child_json = out / result_name
    result["child"] = json.loads(child_json.read_text()) if child_json.exists() else None
    result["memory"] = {
        "peak_device_used_gib": [round(b / GiB, 3) for b in memory.peak_device],
        "peak_process_gib": {k: round(v / GiB, 3) for k, v in memory.peak_process.items()},
        "end_process_gib": {k: round(v / GiB, 3) for k, v in (end_snapshot or {}).get("processes", {}).items()},
        "end_device_used_gib": [round(b / GiB, 3) for b in (end_snapshot or {}).get("device_used", [])],
        "process_names": {k: _name_of(int(k.split("pid")[1])) for k in memory.peak_process},
    }
    result["plugin_lines"] = grep(log, r"vllm-dualgpu \d+\.\d+\.\d+ \(")
    result["errors"] = grep(log, r"Traceback|Error|error:")[:20]
    if arm == "mtp":
        result["checks"] = checks(result)
    elif arm == "eagle3":
        result["rank_lines"] = grep(log, r"vllm-dualgpu rank \d+/\d+: ")
        result["spec_decoding_log"] = grep(log, r"SpecDecoding metrics")[-5:]
        result["checks"] = eagle3_checks(result)
    else:
        result["refusal_lines"] = [l[-400:] for l in grep(log, STOCK_REFUSAL)][:8]
        result["checks"] = stock_checks(result)
    if arm == "stock-eagle3":  # a refusal is the expected end; a hang past the limit is not
        result["ok"] = bool(result["child"]) and all(result["checks"].values())
    else:
        result["ok"] = bool(result["child"]) and not result["timed_out"] and all(result["checks"].values())
    return result


def checks(result: dict) -> dict:
    c = result.get("child") or {}
    workers = sorted(c.get("workers") or [], key=lambda w: w["pp_rank"])
    lines = result.get("plugin_lines", [])
    last = workers[-1] if workers else {}
    return {
        "generated": len(c.get("outputs") or []) == len(prompts()),
        "two ranks probed": [w["pp_rank"] for w in workers] == [0, 1],
        "workers see max_concurrent_batches == pp_size": bool(workers)
        and all(w["max_concurrent_batches"] == 2 for w in workers),
        "drafter on the last rank only": bool(workers) and "drafter" in last
        and all("drafter" not in w for w in workers[:-1]),
        "drafter embedding is the target's": last.get("drafter_embed_is_target_embed") is True,
        "engine applied its issue #6 patches": _applied_in(lines, "engine", ENGINE_PATCHES),
        "workers applied their issue #6 patches": _applied_in(lines, "worker", WORKER_PATCHES),
    }


def _applied_in(lines: list[str], kind: str, names: tuple[str, ...]) -> bool:
    """Whether every plugin line of process kind ``kind`` lists all ``names`` as applied."""
    sel = [l for l in lines if re.search(rf"[(+]{kind}[,+ )]", l)]
    return bool(sel) and all(all(n in applied_names(l) for n in names) for l in sel)


def device_phase_patches(rank_lines: list[str]) -> dict[int, list[str]]:
    """Per PP rank, the patches its summary line lists as "patched once the device was set"
    (the applied ones: the text is "a, b" or "a, b; skipped c (why)")."""
    found: dict[int, list[str]] = {}
    for line in rank_lines:
        rank = re.search(r"vllm-dualgpu rank (\d+)/\d+: ", line)
        if not rank:
            continue
        m = re.search(rf"{DEVICE_PHASE_KEY}: (.*?)(?:; skipped |; [\w ./#-]+: |$)", line)
        names = [n.split(" (")[0].strip() for n in m.group(1).split(", ")] if m else []
        found[int(rank.group(1))] = [n for n in names if n and n != "none"]
    return found


def eagle3_checks(result: dict) -> dict:
    c = result.get("child") or {}
    workers = sorted(c.get("workers") or [], key=lambda w: w["pp_rank"])
    last = workers[-1] if workers else {}
    device = device_phase_patches(result.get("rank_lines", []))
    lines = result.get("plugin_lines", [])

    def relay_layout(w: dict) -> bool:
        layers = w.get("aux_hidden_state_layers")
        start = (w.get("decoder_layers") or [None])[0]
        if layers != EAGLE3_AUX_LAYERS or start is None:
            return False
        expected = 0 if w["pp_rank"] == 0 else sum(1 for l in layers if l <= start)
        return w.get("supports_aux_hidden_states_over_pp") is True and w.get("aux_slot_base") == expected

    return {
        "generated": len(c.get("outputs") or []) == len(prompts()),
        "two ranks probed": [w["pp_rank"] for w in workers] == [0, 1],
        "eagle3 drafter on the last rank only": last.get("drafter") == EAGLE3_DRAFTER_CLASS.rsplit(".", 1)[1]
        and all("drafter" not in w for w in workers[:-1]),
        "both decoders relay the aux states": len(workers) == 2 and all(relay_layout(w) for w in workers),
        "rank lines list the device-phase patches": sorted(device) == [0, 1]
        and all(set(DEVICE_PATCHES) <= set(v) for v in device.values()),
        "workers applied the relay flag": _applied_in(lines, "worker", EAGLE3_WORKER_PATCHES),
        "engine applied its issue #6 patches": _applied_in(lines, "engine", ENGINE_PATCHES),
    }


def stock_checks(result: dict) -> dict:
    c = result.get("child") or {}
    return {
        "refused with vLLM's PP message": bool(result.get("refusal_lines"))
        or bool(re.search(STOCK_REFUSAL, c.get("error") or "")),
        "did not boot": bool(c) and c.get("booted") is False,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("outdir", type=Path)
    ap.add_argument("--method", choices=METHODS, default="both",
                    help="mtp, eagle3 (plugin + stock refusal) or both (default)")
    ap.add_argument("--dry-run", action="store_true", help="CPU only: build and check the engine configs")
    ap.add_argument("--timeout", type=float, default=None,
                    help="seconds for all vLLM children together (default 210 with --method mtp, else 240)")
    ap.add_argument("--child", nargs="?", const="mtp", choices=ARMS, help=argparse.SUPPRESS)
    args = ap.parse_args()
    out = args.outdir.resolve()
    out.mkdir(parents=True, exist_ok=True)
    model = write_model(out)
    if args.dry_run:
        return dry_run(out, model, args.method)
    if args.child:
        return child(out, model, args.child)
    timeout = args.timeout if args.timeout is not None else default_timeout(args.method)
    return parent(out, model, timeout, args.method)


if __name__ == "__main__":
    raise SystemExit(main())
