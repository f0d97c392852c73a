#!/usr/bin/env python3
"""Issue #28, the headline at its real shape: the reference setup's four 262,144-token launchers
on a 16 GiB + 32 GiB pair, the expert's flags against zero flags.

    python benchmarks/headline.py OUTDIR [--launchers fp8-mtp,...] [--arms expert,plugin,split]
    python benchmarks/headline.py OUTDIR --virtual "RTX 4070 Ti SUPER:16GiB,RTX 5090:32GiB:display=yes"   # the default
    python benchmarks/headline.py OUTDIR --virtual none      # two GPUs, ballast leaving 16 and 32 GiB
    python benchmarks/headline.py OUTDIR --speed --virtual none [--launchers fp8-mtp]
    python benchmarks/headline.py OUTDIR --dry-run           # the arms as JSON; nothing starts
    python benchmarks/headline.py OUTDIR --models DIR        # the model folders' root (default below)

The pair. By default a virtual pair on ONE GPU: ``VLLM_DUALGPU_VIRTUAL_GPUS=SPEC`` (the ``--gpus``
syntax of ``vllm-dualgpu plan``, small card first) makes the plugin see those cards, all on
physical GPU 0, each rank presenting as its card and held to its size. ``--virtual none`` uses
two GPUs instead, ballast leaving 16 GiB free on GPU 0 and 32 GiB on GPU 1 (the small card first
in PCI order, so the plugin has to reorder).

The model: the bundled Qwen3.8-27B-class reference config (64 layers, 48 Gated DeltaNet + 16
attention, vision tower, one MTP layer) with dummy weights in the launcher's format: NVFP4 (on SM
9.0 vLLM runs NVFP4 through its weight-only W4A16 kernels, Marlin or FlashInfer CuTe DSL, not the
W4A4 path of the reference setup's Blackwell card: weights and KV are the same size, the GEMMs
are not), W8A16 (compressed-tensors, int8 per channel), FP8 (block 128). The model folders live
under ``--models`` (default ``$XDG_CACHE_HOME`` or ``~/.cache``, then ``vllm-dualgpu/headline-models``),
not under OUTDIR, one folder per content (``kept_folder``): vLLM hashes the model's and the
drafter's paths into its torch.compile cache key, so runs into other OUTDIRs reuse the graphs. The DFlash2 drafter is
the public Qwen3.8-27B DFlash2 drafter's config the recipes are planned with (tests/fixtures/dflash2_drafter.json:
``DFlash2DraftModel``, 5 layers of the target's width with a 2,048-token sliding window, two grouped
convolutions a layer and a candidate selector, W4A16; vLLM runs it as DFlash2Qwen3ForCausalLM with
its V2 runner's DFlash2Speculator), dummy weights too. The runs before 2026-12-03 ran a stand-in
without the convolutions and the selector (tests/fixtures/dflash2_drafter_standin.json, a
``DFlashDraftModel`` with a 4,096-token window). Every arm:
the launcher's drafter (DFlash2 with 7 tokens, or MTP with 3), the vision tower on, fp8 KV,
max_model_len 262,144, --max-num-seqs 2 --max-num-batched-tokens 1024, prefix caching.

Arms per launcher, each ``vllm.LLM`` in a fresh process group with a time limit:

1. expert: the launcher's own flags as the reference setup writes them (EXPERT: split, block size,
   KV bytes, PIECEWISE CUDA graphs, FlashInfer autotune off, the drafter's flags) through the
   dualgpu executor. The reference ran vLLM with its own patches; this package's patches are
   their port and apply only in a dualgpu run (stock vLLM refuses DFlash under PP: "does not
   support dflash with pipeline parallelism", twelfth session), so the expert runs there with
   every flag of its own honoured, and on the virtual pair each rank is held to its card as the
   real card holds it. Adapted (see expert_kwargs): the block count is one 262,144-token request
   under the grouping vLLM 0.33 runs with the package (EXPERT_BLOCKS; the reference's 375 / 180
   were one request under its own grouping, without vLLM's null block); the plan's reserves do
   not apply to a hand-set pool (a pool past them is a warning, past a card a refusal); on two
   GPUs the small card is index 0 here (CUDA_VISIBLE_DEVICES=0,1 instead of 1,0). The launchers'
   own environment goes with it (EXPERT_ENV: a 128 MiB FlashInfer workspace, expandable segments;
   since 2026-12-03).
2. plugin: ``--distributed-executor-backend dualgpu`` and the serving flags, nothing else.
3. split-2 / split+2: the plugin with VLLM_PP_LAYER_PARTITION at its own split -2 and +2 layers;
   the expert's split too (split-at-expert: the plugin's per-step cost against the expert's on
   the same split).
A ``stock`` arm (vLLM's even split and default utilization) is available with --arms stock, and a
``graphs`` arm with --arms graphs: the plugin at the expert's split with the expert's CUDA-graph
mode (at-expert-graphs: the 1% per-step comparison; the expert's other flags size its pool).

Each arm that boots measures (``measure``): the KV pool, greedy token ids, TTFT at ~32K and ~250K
tokens, decode ms per step at short, 32K and ~250K context, the second turn of a 33K conversation
(prefix cache), then one ~4-megapixel image (rank 0's vision encoder pass with the KV cache
allocated). The parent samples every GPU process's used memory (NVML, every 0.25 s) and maps
each worker process to its pipeline rank from vLLM's log prefix (``Worker_PP<r> pid=<pid>``): the
per-rank peak, the 250K prompt included. A refusal records vLLM's or the plugin's line with the
largest context that fits. Results per arm in OUTDIR/arms/*.json; OUTDIR/headline.json is the
issue's schema (``headline_row``: launcher, arm, booted, split, max_model_len, pool_tokens,
peak_mib and card_mib per rank, ms_per_step short/32k/250k, ttft_s 32k/250k, predicted_peak_mib
per rank from the plan) and OUTDIR/headline.md the table, both rebuilt after every arm.

``--speed`` (two GPUs only): a bandwidth hog on GPU 1 (the big card) and a sweep of the plugin's
split measuring decode ms/step; see ``speed_main``. ``arm_specs`` is what the CPU tests check
(tests/integration/test_headline_configs.py): every arm's engine arguments and environment.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import re
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[0]
sys.path.insert(0, str(ROOT / "tests" / "gpu"))
sys.path.insert(0, str(HERE))
from gpu_harness import (TORCH_TOPK_LINE, GiB, ballast, grep, on_signals_stop_all, run_llm, start_group,  # noqa: E402
                         stop_group, tail)
from gpu_models import gdn_prefill_config, write_reference_model  # noqa: E402
from model_folders import add_models_option, kept_folder  # noqa: E402

FREE = [16.0, 32.0]  # GiB per card, the small card first
VIRTUAL = "RTX 4070 Ti SUPER:16GiB,RTX 5090:32GiB:display=yes"  # --virtual's default: the reference pair (its desktop on the RTX 5090)
DRAFTER_CONFIG = ROOT / "tests" / "fixtures" / "dflash2_drafter.json"
NUM_LAYERS = 64
MAX_MODEL_LEN = 262_144
MTP = {"method": "mtp", "num_speculative_tokens": 3}
DFLASH_TOKENS = 7
LAUNCHERS = ("nvfp4-dflash2", "w8a16-dflash2", "fp8-dflash2", "fp8-mtp")
QUANT = {"nvfp4-dflash2": "nvfp4", "w8a16-dflash2": "w8a16", "fp8-dflash2": "fp8", "fp8-mtp": "fp8"}
# The reference setup's launchers (launchers/*-262k.sh there). DFlash2: --block-size 1664 (its
# drafter-page promotion on stock 0.30 needed it), 375 blocks (2 x 158 attention + 6 x 9 GDN + 5
# window blocks: one 262,144-token request), the drafter on Triton attention, the eagle block drop
# off, one prefix-cache checkpoint per block, FlashInfer autotune off. MTP: vLLM's own block size
# (1,600 at 3 tokens), 164 + 3 x (2 + 3) + 1 = 180 blocks. All: --kv-cache-memory-bytes 9e9 (it
# only skips vLLM's profile: the block count sizes the pool), PIECEWISE CUDA graphs.
EXPERT = {
    "nvfp4-dflash2": {"partition": [13, 51], "block_size": 1664, "num_gpu_blocks_override": 375},
    "w8a16-dflash2": {"partition": [19, 45], "block_size": 1664, "num_gpu_blocks_override": 375},
    "fp8-dflash2": {"partition": [21, 43], "block_size": 1664, "num_gpu_blocks_override": 375},
    "fp8-mtp": {"partition": [20, 44], "block_size": None, "num_gpu_blocks_override": 180},
}
# What the expert arm runs: the reference's rule (one 262,144-token request) under the KV grouping
# vLLM 0.33 forms with this package's patches for 9e9 bytes on each rank. At 19/45 that grouping
# is the reference's (2 attention + 6 GDN groups of 8, the window group of the DFlash2 drafter's
# 2,048-token window: cdiv(2,047 + 2 x 1,024, 1,664) + 1 = 4): 2 x 158 + 6 x 9 + 4 + 1 null block
# = 375, the reference's own count. At 13/51 and 21/43 it is 4 groups of 16 and the window group:
# 158 + 3 x 9 + 4 + 1 = 190 (the reference's 375 there would be 375 blocks of that larger grouping:
# past the RTX 5090). The runs before 2026-12-03, with the stand-in's 4,096-token window (5 window
# blocks), ran 376 and 191. MTP's 180 already counts the null block. tests/integration/test_expert_flags_plan.py
# prices two of them by hand; tests/unit/test_headline_expert_blocks.py holds every one to the
# planner's grouping, tests/integration/engine/test_headline_expert_plan.py to the executor's.
EXPERT_BLOCKS = {"nvfp4-dflash2": 190, "w8a16-dflash2": 375, "fp8-dflash2": 190, "fp8-mtp": 180}
EXPERT_COMMON = {"kv_cache_memory_bytes": 9_000_000_000, "cudagraph_mode": "PIECEWISE"}
MTP_BLOCK = 1600  # vLLM's hybrid block size at 3 MTP tokens (the MTP launcher's BLOCK)
SPLIT_STEPS = (-2, 2)
ARM_KINDS = ("stock", "expert", "plugin", "split", "graphs")
DEFAULT_ARMS = ("expert", "plugin", "split")
ARM_LIMIT_S = {"stock": 300, "expert": 600, "plugin": 600, "split": 420, "graphs": 600}  # each arm's wall-clock limit
SPLIT_MEASURES = ("short", "mid")  # the split arms: pool and ms/step
# Prompt lengths (tokens): ~32K and ~250K (the 250K prompt plus the draft and decode tokens stay
# under 262,144); the conversation's first turn is 33K.
LONG, MID, SHORT, TURN = 250_000, 32_768, 64, 33_000
DECODE_TOKENS = 64
H200_TOTAL_GIB = 143771 / 1024  # what NVML reports for an H200 (the planner's KNOWN_GPUS)


@dataclasses.dataclass
class Arm:
    name: str  # "<launcher>/<kind>[-detail]"
    kind: str  # one of ARM_KINDS
    launcher: str
    kwargs: dict
    env: dict

    @property
    def quant(self) -> str:
        return QUANT[self.launcher]

    @property
    def file(self) -> str:
        return arm_file(self.name)


def arm_file(name: str) -> str:
    """An arm's file name: its name in letters, digits, '.', '_', '-' ("w8a16-dflash2_plugin-at-241664";
    "split+2" is "split-plus2", apart from "split-2")."""
    return re.sub(r"[^A-Za-z0-9._-]", "-", name.replace("/", "_").replace("@", "-at-").replace("+", "-plus"))


def virtual_cards(spec: str | None) -> list[float] | None:
    """The cards' sizes (GiB) of a --virtual spec, in the plugin's order; None: two real GPUs."""
    if not spec:
        return None
    from vllm_dualgpu.planner import parse_gpus

    return [g.total_bytes / GiB for g in parse_gpus(spec)]


def speculative(launcher: str, drafter: Path | None) -> dict:
    if launcher.endswith("-mtp"):
        return dict(MTP)
    return {"method": "dflash", "model": str(drafter), "num_speculative_tokens": DFLASH_TOKENS}


def common_kwargs(model: Path, launcher: str = "fp8-mtp", drafter: Path | None = None) -> dict:
    """The flags every arm shares: what a user of the reference setup types."""
    return {"model": str(model), "load_format": "dummy", "max_model_len": MAX_MODEL_LEN,
            "pipeline_parallel_size": 2, "max_num_seqs": 2, "max_num_batched_tokens": 1024,
            "kv_cache_dtype": "fp8", "speculative_config": speculative(launcher, drafter),
            "enable_prefix_caching": True, "additional_config": gdn_prefill_config(),
            "disable_log_stats": False}


def utilizations(free_gib: list[float], total_gib: float, tries: int = 3) -> list[float]:
    """Stock's utilizations after the default: the highest that passes vLLM's check (utilization x
    total <= free on every card, two decimals) and ``tries - 1`` below it."""
    top = math.floor(100 * min(free_gib) / total_gib) / 100
    return [round(top - 0.01 * i, 2) for i in range(tries) if top - 0.01 * i > 0]


def pair_env(virtual: str | None) -> dict:
    """What the plugin's arms add to their environment: the virtual pair and spawned workers."""
    order = {"CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    if not virtual:
        return order
    return {**order, "VLLM_DUALGPU_VIRTUAL_GPUS": virtual, "VLLM_WORKER_MULTIPROC_METHOD": "spawn"}


#: What every reference launcher exports besides its split (launchers/*-262k.sh there): a 128 MiB
#: FlashInfer workspace ("the default ... ran the card out of memory at full context") and
#: expandable segments. The arms before 2026-12-03 ran without them.
EXPERT_ENV = {"VLLM_FLASHINFER_WORKSPACE_BUFFER_SIZE": "134217728", "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}


def expert_env(launcher: str, virtual: str | None) -> dict:
    """The expert's environment: its split, the launchers' own variables, and the pair (the virtual
    cards, or on two GPUs the small card first by index)."""
    env = {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", **EXPERT_ENV,
           "VLLM_PP_LAYER_PARTITION": ",".join(map(str, EXPERT[launcher]["partition"]))}
    return {**pair_env(virtual), **env} if virtual else {**env, "CUDA_VISIBLE_DEVICES": "0,1"}


def expert_kwargs(launcher: str, base: dict) -> dict:
    e = EXPERT[launcher]
    block = e["block_size"] or MTP_BLOCK
    spec = {**base["speculative_config"], "disable_eagle_block_drop": True}
    kw = {**base, "distributed_executor_backend": "dualgpu", "num_gpu_blocks_override": EXPERT_BLOCKS[launcher],
          "kv_cache_memory_bytes": EXPERT_COMMON["kv_cache_memory_bytes"],
          "compilation_config": {"cudagraph_mode": EXPERT_COMMON["cudagraph_mode"]},
          "prefix_cache_retention_interval": block}
    if e["block_size"]:
        kw["block_size"] = e["block_size"]
    if spec["method"] == "dflash":
        spec["attention_backend"] = "TRITON_ATTN"  # the drafter only (the launchers' DRAFT_ATTN)
        kw["enable_flashinfer_autotune"] = False
    kw["speculative_config"] = spec
    return kw


def arm_specs(launcher: str, model: Path, *, total_gib: float, drafter: Path | None = None,
              chosen: list[int] | None = None, free_gib: list[float] = FREE,
              virtual: str | None = None, context: int = MAX_MODEL_LEN, reserve: str | None = None) -> list[Arm]:
    """Every arm of one launcher, in run order. ``chosen``: the plugin's split (arm 2's plan);
    without it the split arms are left out. ``virtual``: the --virtual spec (None: two GPUs).
    ``context``: the plugin's and split arms' --max-model-len (``--context``); other than 262,144
    their names say it ("plugin@229376"). The expert keeps its own 262,144. ``reserve``
    (``--reserve``): VLLM_DUALGPU_RESERVE for the plugin and split arms, named in theirs too."""
    base = common_kwargs(model, launcher, drafter)
    at = plugin_suffix(context, reserve)
    kept = {"VLLM_DUALGPU_RESERVE": reserve} if reserve else {}
    order = {"CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    stock = {**base, "distributed_executor_backend": "mp"}
    arms = []
    if not virtual:  # stock vLLM cannot put two ranks on one GPU (only the expert's worker class does)
        arms.append(Arm(f"{launcher}/stock-default", "stock", launcher, dict(stock), dict(order)))
        arms += [Arm(f"{launcher}/stock-u{u:.2f}", "stock", launcher, {**stock, "gpu_memory_utilization": u},
                     dict(order)) for u in utilizations(free_gib, total_gib)]
    arms.append(Arm(f"{launcher}/expert", "expert", launcher, expert_kwargs(launcher, base),
                    expert_env(launcher, virtual)))
    plugin = {**base, "distributed_executor_backend": "dualgpu", "max_model_len": context}
    arms.append(Arm(f"{launcher}/plugin{at}", "plugin", launcher, dict(plugin), {**pair_env(virtual), **kept}))
    expert_split = EXPERT[launcher]["partition"]
    # the plugin at the expert's split AND with the expert's CUDA-graph mode: issue #28's 1% per-step
    # comparison (the other expert flags size the pool, not the step); not a default arm
    arms.append(Arm(f"{launcher}/at-expert-graphs{at}", "graphs", launcher,
                    {**plugin, "compilation_config": {"cudagraph_mode": EXPERT_COMMON["cudagraph_mode"]}},
                    {**pair_env(virtual), **kept,
                     "VLLM_PP_LAYER_PARTITION": f"{expert_split[0]},{NUM_LAYERS - expert_split[0]}"}))
    if chosen:
        named = {chosen[0] + d: f"split{d:+d}" for d in SPLIT_STEPS}
        named.setdefault(expert_split[0], "split-at-expert")
        for first, label in named.items():  # the expert's split: the plugin's per-step cost on it
            if 0 < first < NUM_LAYERS and first != chosen[0]:
                arms.append(Arm(f"{launcher}/{label}{at}", "split", launcher, dict(plugin),
                                {**pair_env(virtual), **kept,
                                 "VLLM_PP_LAYER_PARTITION": f"{first},{NUM_LAYERS - first}"}))
    return arms


def reference_model(root: Path, quant: str, tokenizer: bool = True) -> Path:
    return kept_folder(root, quant, lambda d: write_reference_model(d, quant, tokenizer=tokenizer))


def drafter_model(root: Path) -> Path:
    return kept_folder(root, "dflash2-drafter", write_drafter)


def write_models(root: Path) -> dict[str, Path]:
    """Every launcher's model folder (by weight format) and the drafter's, under ``root``."""
    out = {q: reference_model(root, q) for q in ("w8a16", "fp8", "nvfp4")}
    out["drafter"] = drafter_model(root)
    return out


def write_drafter(out: Path) -> Path:
    """The DFlash2 stand-in drafter as a model folder for load_format="dummy"."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(DRAFTER_CONFIG.read_text())
    return out


# --- in the engine's process (spawned; module-level functions) ---------------------------------------


def prompt(n: int, seed: int) -> list[int]:
    """``n`` token ids, different per seed (no prefix shared across seeds: no cache hit)."""
    return [3 + (seed * 7919 + j * 31 + (j * j) % 997) % 900 for j in range(n)]


def spec_counters(llm) -> dict:
    """vLLM's speculative-decoding counters (drafts = decode steps that drafted)."""
    try:
        metrics = llm.get_metrics()
    except Exception:
        return {}
    names = {"vllm:spec_decode_num_drafts": "drafts", "vllm:spec_decode_num_accepted_tokens": "accepted"}
    return {names[m.name]: m.value for m in metrics if m.name in names and hasattr(m, "value")}


def timed(llm, ids: list[int], max_tokens: int) -> dict:
    from vllm import SamplingParams

    before = spec_counters(llm)
    t = time.perf_counter()
    out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(
        temperature=0, max_tokens=max_tokens, ignore_eos=True, detokenize=False), use_tqdm=False)[0]
    s = time.perf_counter() - t
    after = spec_counters(llm)
    steps = after.get("drafts", 0) - before.get("drafts", 0) if after and before else None
    return {"s": s, "tokens": list(out.outputs[0].token_ids), "steps": steps}


def decode_at(llm, ids: list[int], tokens: int = DECODE_TOKENS) -> dict:
    """TTFT (cold), then ms per decode step at this context: the same prompt again (prefix-cached)
    for 1 token and for 1 + ``tokens``; the difference over the steps it took."""
    cold = timed(llm, ids, 1)
    warm1 = timed(llm, ids, 1)
    run = timed(llm, ids, 1 + tokens)
    steps = run["steps"] if run["steps"] else tokens
    return {"context": len(ids), "ttft_s": round(cold["s"], 3), "cached_ttft_s": round(warm1["s"], 3),
            "decode_ms_per_step": round(1000 * (run["s"] - warm1["s"]) / steps, 3), "decode_steps": steps,
            "decode_tokens": len(run["tokens"]) - 1, "steps_counted": bool(run["steps"])}


# The ~250K prompt second: the per-rank peak it drives is what the memory claims are about. The
# image last: its vision encoder pass on rank 0, with the KV cache allocated, is the other peak the
# plan charges (and a failure there ends no other measurement).
MEASURES = ("short", "long", "mid", "second_turn", "image")
IMAGE_SIDE = 2048  # 2048 x 2048 = 4,194,304 pixels: the reference launchers' max_pixels
IMAGE_PROMPT = "<|vision_start|><|image_pad|><|vision_end|>Describe the image."


def save_progress(res: dict, progress: str | None) -> None:
    """What is measured so far, so an arm cut by its limit keeps its boot and what ran."""
    if progress:
        Path(progress + ".tmp").write_text(json.dumps(res, default=str))
        Path(progress + ".tmp").replace(progress)


def measure(llm, deadline: float, parts: tuple[str, ...] = MEASURES, progress: str | None = None) -> dict:
    """What an arm that booted measures (``parts`` of MEASURES), in that order; each only while
    time is left (the rest are listed under "skipped"). ``progress``: a file rewritten after each
    step (run_arm reads it when the arm is cut)."""
    cfg = llm.llm_engine.vllm_config
    res = {"num_gpu_blocks": cfg.cache_config.num_gpu_blocks, "block_size": cfg.cache_config.block_size,
           "partition": None, "skipped": [], "phase_s": {}}
    res["torch_mib"] = {"boot": torch_memory_mib(llm)}
    save_progress(res, progress)
    t0 = time.time()
    greedy = timed(llm, prompt(SHORT, 1), 32)
    res["greedy_token_ids"] = greedy["tokens"]
    res["phase_s"]["greedy"] = [t0, time.time()]  # wall-clock windows: phase_peaks_mib
    save_progress(res, progress)
    steps = {"short": lambda: decode_at(llm, prompt(SHORT, 2)), "mid": lambda: decode_at(llm, prompt(MID, 3)),
             "second_turn": lambda: second_turn(llm),
             "long": lambda: decode_at(llm, prompt(long_prompt(cfg.model_config.max_model_len), 5)),
             "image": lambda: image_turn(llm)}
    for name in parts:
        fn = steps[name]
        if time.time() > deadline:
            res["skipped"].append(name)
            continue
        t0 = time.time()
        try:
            res[name] = fn()
        except Exception as exc:
            res[name] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
        res["phase_s"][name] = [t0, time.time()]
        res["torch_mib"][name] = torch_memory_mib(llm)
        save_progress(res, progress)
    return res


def worker_torch_memory(worker=None) -> dict:
    """Run in each worker (``LLM.collective_rpc``): torch's caching allocator on the rank's device,
    MiB: what it holds now and the peaks since vLLM last reset them."""
    import torch

    mib = 2**20
    return {"reserved": round(torch.cuda.memory_reserved() / mib),
            "max_reserved": round(torch.cuda.max_memory_reserved() / mib),
            "max_allocated": round(torch.cuda.max_memory_allocated() / mib)}


def torch_memory_mib(llm) -> list | dict:
    """Each rank's :func:`worker_torch_memory` after a pass (rank order), or {"error": ...}: set
    beside the pass's NVML peak (``phase_peak_mib``), it says whether what a pass adds is torch's
    (activations, the allocator's segments) or outside torch (CUDA modules, NCCL, FlashInfer's JIT
    kernels). The function travels by value: the workers cannot import this script."""
    try:
        import cloudpickle

        cloudpickle.register_pickle_by_value(sys.modules[worker_torch_memory.__module__])
        return llm.collective_rpc(worker_torch_memory)
    except Exception as exc:  # a measurement aid: never fail the arm over it
        return {"error": f"{type(exc).__name__}: {exc}"[:300]}


def long_prompt(max_model_len: int) -> int:
    """The long prompt's length: ~250K, or as much less as the arm's --max-model-len is below
    262,144 (the same room is left for the draft and decode tokens)."""
    return min(LONG, max_model_len - (MAX_MODEL_LEN - LONG))


def second_turn(llm) -> dict:
    """A 33K-token first turn and its answer, then the follow-up (the whole conversation plus 200
    new tokens): the second turn's TTFT shows whether the prefix cache served the first."""
    first_ids = prompt(TURN, 4)
    first = timed(llm, first_ids, 64)
    follow = first_ids + first["tokens"] + prompt(200, 6)
    second = timed(llm, follow, 1)
    return {"first_turn_s": round(first["s"], 3), "second_turn_ttft_s": round(second["s"], 3),
            "second_turn_tokens": len(follow)}


def image_turn(llm) -> dict:
    """One image of about 4 megapixels (noise, so no two patches are alike) and one new token: its
    TTFT and how many prompt tokens the image became."""
    import numpy as np
    from PIL import Image
    from vllm import SamplingParams

    pixels = np.random.default_rng(0).integers(0, 256, (IMAGE_SIDE, IMAGE_SIDE, 3), dtype=np.uint8)
    t = time.perf_counter()
    out = llm.generate([{"prompt": IMAGE_PROMPT, "multi_modal_data": {"image": Image.fromarray(pixels)}}],
                       SamplingParams(temperature=0, max_tokens=1, detokenize=False), use_tqdm=False)[0]
    return {"pixels": IMAGE_SIDE * IMAGE_SIDE, "prompt_tokens": len(out.prompt_token_ids or []),
            "ttft_s": round(time.perf_counter() - t, 3)}


def boot_only(llm) -> dict:
    cfg = llm.llm_engine.vllm_config
    return {"num_gpu_blocks": cfg.cache_config.num_gpu_blocks, "block_size": cfg.cache_config.block_size}


# --- in this process ----------------------------------------------------------------------------------


def largest_context(lines: list[str]) -> int | None:
    """The largest context a refusal names (vLLM's "estimated maximum model length is N", the
    plugin's "--max-model-len N")."""
    import re

    for line in lines:
        m = re.search(r"maximum model length is (\d+)", line) or re.search(r"--max-model-len (\d[\d,]*)", line)
        if m:
            return int(m.group(1).replace(",", ""))
    return None


def predicted_used_gib(plan: dict) -> list[float | None]:
    """The plan's memory per GPU (weights + fixed costs + KV cache), by GPU index (PCI order),
    next to the measured peaks."""
    used: list[float | None] = [None, None]
    for r in plan.get("ranks", []):
        used[r["gpu"]["index"]] = round((r["weights_bytes"] + r["fixed_bytes"] + r["kv_cache_bytes"]) / GiB, 3)
    return used


def predicted_peak_mib(plan: dict) -> list[int] | None:
    """Each rank's predicted peak (MiB), rank 0 first: weights, fixed costs (CUDA context, embedding,
    vision tower, head, drafter), the runtime reserve (the profile run's transient peak, workspaces,
    CUDA graphs, NCCL buffers) and the KV cache: what the rank holds at most while it serves."""
    ranks = plan.get("ranks") or []
    if not ranks:
        return None
    return [round((r["weights_bytes"] + r["fixed_bytes"] + r["reserve_bytes"] + r["kv_cache_bytes"]) / 2**20)
            for r in ranks]


class ProcessPeaks:
    """Used GPU memory of every process on every GPU, every ``period`` s (NVML's per-process
    figure, which is what a rank holds whichever card it runs on): ``.peak[pid]`` in bytes; and
    every GPU's used memory (``.gpu_peak``, ``.gpu_base``)."""

    def __init__(self, period: float = 0.25):
        import pynvml

        pynvml.nvmlInit()
        self.nvml, self.period = pynvml, period
        self.handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
        self.peak: dict[int, int] = {}
        self.samples: list[tuple[float, int, int]] = []  # (time, pid, used bytes): phase_peaks_mib
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def gpu_used(self) -> list[int]:
        return [self.nvml.nvmlDeviceGetMemoryInfo(h).used for h in self.handles]

    def _sample(self) -> None:
        for h in self.handles:
            try:
                procs = self.nvml.nvmlDeviceGetComputeRunningProcesses(h)
            except self.nvml.NVMLError:
                continue
            now = time.time()
            for p in procs:
                used = p.usedGpuMemory or 0
                self.peak[p.pid] = max(self.peak.get(p.pid, 0), used)
                self.samples.append((now, p.pid, used))
        self.gpu_peak = [max(a, b) for a, b in zip(self.gpu_peak, self.gpu_used())]

    def _run(self):
        while not self._stop.is_set():
            self._sample()
            time.sleep(self.period)

    def __enter__(self):
        self.gpu_base = self.gpu_peak = self.gpu_used()
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()


def rank_pids(lines: list[str]) -> dict[int, int]:
    """Pipeline rank of each worker process, from vLLM's log prefix (``(Worker_PP1 pid=1234)``,
    ``(Worker_PP0_TP0 pid=...)``)."""
    out: dict[int, int] = {}
    for line in lines:
        for m in re.finditer(r"\(Worker\w*?_PP(\d+)\w* pid=(\d+)\)", line):
            out[int(m.group(2))] = int(m.group(1))
        # before the ranks are named (vLLM 0.33's boot lines): VllmWorker-<rank> (PP only, TP 1)
        for m in re.finditer(r"\(VllmWorker-(\d+) pid=(\d+)\)", line):
            out.setdefault(int(m.group(2)), int(m.group(1)))
    return out


def phase_peaks_mib(pids: dict[int, int], samples: list[tuple[float, int, int]], phases: dict[str, list[float]],
                    pp: int = 2) -> dict[str, list[int | None]]:
    """Each rank's peak (MiB) within each measured phase's wall-clock window (``measure``'s
    ``phase_s``), and "boot" for every sample before the first phase: which pass takes a rank to
    its peak (the 250K prompt, the image, the boot's profile). ``pids``: worker pid -> rank
    (:func:`rank_pids`); ``samples``: (time, pid, bytes) from :class:`ProcessPeaks`."""
    windows = dict(phases)
    if phases:
        windows = {"boot": [float("-inf"), min(w[0] for w in phases.values())], **windows}
    out: dict[str, list[int | None]] = {}
    for name, (t0, t1) in windows.items():
        by_rank: list[int | None] = [None] * pp
        for t, pid, used in samples:
            rank = pids.get(pid)
            if rank is not None and rank < pp and t0 <= t <= t1:
                by_rank[rank] = max(by_rank[rank] or 0, round(used / 2**20))
        out[name] = by_rank
    return out


def rank_peaks_mib(pids: dict[int, int], peaks: dict[int, int], pp: int = 2) -> list[int | None]:
    """Each rank's peak (MiB) from the per-process samples; None where no process was mapped.
    ``pids``: worker pid -> rank (:func:`rank_pids` of the arm's log)."""
    by_rank: list[int | None] = [None] * pp
    for pid, rank in pids.items():
        if rank < pp and pid in peaks:
            by_rank[rank] = max(by_rank[rank] or 0, round(peaks[pid] / 2**20))
    return by_rank


def shorten(line: str, keep: int = 300) -> str:
    """A log line's start (the rank and the error) and end (vLLM's largest length) when long."""
    return line if len(line) <= 2 * keep else f"{line[:keep]} ... {line[-keep:]}"


def run_arm(arm: Arm, out: Path, job, timeout: float, cards_mib: list[int] | None = None) -> dict:
    log = out / "logs" / f"{arm.file}.log"
    plan_file = out / "logs" / f"{arm.file}.plan.json"
    env = {**arm.env, "VLLM_DUALGPU_PLAN_FILE": str(plan_file)}
    progress = log.with_suffix(".progress.json")
    log.parent.mkdir(parents=True, exist_ok=True)
    progress.unlink(missing_ok=True)
    if isinstance(job, functools.partial) and job.func is measure:
        job = functools.partial(job, progress=str(progress))
    with ProcessPeaks() as s:
        res = run_llm(arm.kwargs, job, log=log, timeout=timeout, env=env)
    if "error" in res and progress.exists():  # cut by its limit (or failed) after booting
        res = {**json.loads(progress.read_text()), **res, "cut_after_boot": True}
    r = {"name": arm.name, "kind": arm.kind, "launcher": arm.launcher, "quant": arm.quant, "env": env,
         "kwargs": arm.kwargs, **{k: v for k, v in res.items() if k != "log"}}
    r["kv_tokens"] = res["num_gpu_blocks"] * res["block_size"] if res.get("num_gpu_blocks") else None
    r["booted"] = r["kv_tokens"] is not None
    r["peak_used_gib"] = [round((pk - b) / GiB, 3) for pk, b in zip(s.gpu_peak, s.gpu_base)]
    pids = rank_pids(grep(log, r"Worker\w*_PP\d|VllmWorker-\d"))
    r["peak_mib"] = rank_peaks_mib(pids, s.peak)
    r["phase_peak_mib"] = phase_peaks_mib(pids, getattr(s, "samples", []), res.get("phase_s") or {})
    r["card_mib"] = cards_mib
    r["rank_lines"] = grep(log, r"vllm-dualgpu rank \d")
    # DUALGPU_GPU_TORCH_TOPK=1: vLLM's vocab top-k ran on torch.topk, not FlashInfer's (gpu_harness)
    r["vocab_topk"] = "torch" if grep(log, TORCH_TOPK_LINE) else "vLLM's choice"
    r["refusals"] = [shorten(line) for line in grep(
        log, r"OutOfMemoryError|ValueError|does not fit|less than desired|maximum model length")][:4]
    asked = arm.kwargs.get("max_model_len", MAX_MODEL_LEN)
    r["largest_context"] = asked if r["booted"] and r["kv_tokens"] >= asked else largest_context(r["refusals"])
    if plan_file.exists():
        r["plan"] = json.loads(plan_file.read_text())
        r["partition"] = r["plan"].get("partition")
        r["predicted_used_gib"] = predicted_used_gib(r["plan"])
        r["predicted_peak_mib"] = predicted_peak_mib(r["plan"])
    elif "VLLM_PP_LAYER_PARTITION" in arm.env:
        r["partition"] = [int(x) for x in arm.env["VLLM_PP_LAYER_PARTITION"].split(",")]
    if not r["booted"]:
        r["log_tail"] = tail(log, 15)
    (out / "arms").mkdir(parents=True, exist_ok=True)
    (out / "arms" / f"{arm.file}.json").write_text(json.dumps(r, indent=1, default=str))
    print(json.dumps({k: r.get(k) for k in ("name", "booted", "kv_tokens", "partition", "boot_s", "wall_s",
                                            "peak_mib")}), flush=True)
    return r


def arm_label(r: dict) -> str:
    """The issue's ``arm``: expert, plugin, split-2, split+2 (split-at-expert, stock-...)."""
    return r["name"].split("/", 1)[1]


def headline_row(r: dict) -> dict:
    """One arm in issue #28's headline.json schema."""
    d = {k: r.get(k) if isinstance(r.get(k), dict) else {} for k in ("short", "mid", "long")}
    pool = None
    if r.get("kv_tokens") is not None:
        pool = r["kv_tokens"]
    cut = not r.get("booted") and bool(r.get("timed_out"))  # the arm's limit ended the boot: no refusal
    return {
        "launcher": r.get("launcher"), "arm": arm_label(r), "booted": bool(r.get("booted")),
        "refusal": None if r.get("booted") or cut else (r.get("refusals") or [r.get("error")])[0],
        "cut_during_boot_s": r.get("wall_s") if cut else None,
        "split": r.get("partition"), "max_model_len": r.get("largest_context"),
        "pool_tokens": pool, "peak_mib": r.get("peak_mib"), "card_mib": r.get("card_mib"),
        "ms_per_step": {"short": d["short"].get("decode_ms_per_step"), "32k": d["mid"].get("decode_ms_per_step"),
                        "250k": d["long"].get("decode_ms_per_step")},
        "ttft_s": {"32k": d["mid"].get("ttft_s"), "250k": d["long"].get("ttft_s")},
        "second_turn_ttft_s": (r.get("second_turn") or {}).get("second_turn_ttft_s"),
        "greedy_token_ids": r.get("greedy_token_ids"),
        "predicted_peak_mib": r.get("predicted_peak_mib"),
        "phase_peak_mib": r.get("phase_peak_mib"),  # per rank within each measured pass (since 2026-12-04)
        "torch_mib": r.get("torch_mib"),  # per rank after the boot and each pass: torch's allocator (since run 13)
    }


def booted_cell(h: dict) -> str:
    if h["booted"]:
        return "yes"
    return "no" if h["cut_during_boot_s"] is None else f"cut at {h['cut_during_boot_s']:.0f} s, booting"


def fmt(x, spec: str = "") -> str:
    return "-" if x is None else format(x, spec)


def table(results: list[dict]) -> str:
    rows = ["| launcher | arm | split | boots | KV pool (tokens) | largest context | TTFT 32K / 250K (s) | "
            "decode ms/step short / 32K / 250K | 2nd turn of 33K, TTFT (s) | peak rank 0 / 1 (MiB) | "
            "card rank 0 / 1 (MiB) | predicted rank 0 / 1 (MiB) |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        h = headline_row(r)
        pair = lambda xs: " / ".join(fmt(x, ",") for x in (xs or [None, None]))  # noqa: E731
        rows.append(
            f"| {h['launcher']} | {h['arm']} | {'/'.join(map(str, h['split'] or [])) or 'even'} | "
            f"{booted_cell(h)} | {fmt(h['pool_tokens'], ',')} | {fmt(h['max_model_len'], ',')} | "
            f"{fmt(h['ttft_s']['32k'])} / {fmt(h['ttft_s']['250k'])} | "
            f"{' / '.join(fmt(h['ms_per_step'][k]) for k in ('short', '32k', '250k'))} | "
            f"{fmt(h['second_turn_ttft_s'])} | {pair(h['peak_mib'])} | {pair(h['card_mib'])} | "
            f"{pair(h['predicted_peak_mib'])} |")
    ranks = [f"    {r['name']}: {line.split('] ', 1)[-1]}" for r in results for line in r.get("rank_lines", [])]
    if ranks:
        rows += ["", "Per-rank lines (predicted vs vLLM's profile):", "", *ranks]
    return "\n".join(rows) + "\n"


def save_all(out: Path) -> list[dict]:
    results = [json.loads(p.read_text()) for p in sorted((out / "arms").glob("*.json"))]
    order = {name: i for i, name in enumerate(LAUNCHERS)}
    results.sort(key=lambda r: (order.get(r.get("launcher"), 99), ARM_KINDS.index(r["kind"]), r["name"]))
    (out / "headline.json").write_text(json.dumps([headline_row(r) for r in results], indent=1, default=str))
    (out / "headline.md").write_text(table(results))
    return results


def gpu_total_gib(count: int = 2) -> float:
    import pynvml

    pynvml.nvmlInit()
    return min(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(i)).total
               for i in range(count)) / GiB


def plugin_suffix(context: int = MAX_MODEL_LEN, reserve: str | None = None) -> str:
    """What the plugin and split arms' names add: "@N" for another --max-model-len than 262,144,
    "-reserve-S" for a --reserve."""
    return ("" if context == MAX_MODEL_LEN else f"@{context}") + (f"-reserve-{reserve}" if reserve else "")


def plugin_split(out: Path, launcher: str, context: int = MAX_MODEL_LEN, reserve: str | None = None) -> list[int] | None:
    """Arm 2's split, from its result file (this run's or an earlier call's)."""
    at = plugin_suffix(context, reserve)
    f = out / "arms" / f"{arm_file(f'{launcher}/plugin{at}')}.json"
    return json.loads(f.read_text()).get("partition") if f.exists() else None


def split_without_plugin_arm(out: Path, launcher: str, model: Path, drafter: Path, virtual: str | None,
                             context: int, reserve: str | None) -> list[int] | None:
    """The split arms' starting point where ``out`` holds no plugin arm: on the virtual pair the pure
    planner's split (the executor's, the plugin arms have shown: fp8-mtp 19/45); on two GPUs none
    (the plan there reads the real cards' free memory at boot), said in one line."""
    where = out / "arms"
    if virtual is None or reserve:
        print(f"{launcher}: no plugin arm in {where}: the split arms need its split on two GPUs or with "
              f"--reserve; run --arms plugin (or plugin,split) first", flush=True)
        return None
    split = virtual_split(launcher, model, drafter, virtual, context)
    print(f"{launcher}: no plugin arm in {where}: the split arms start from the plan's split "
          f"{split[0]}/{split[1]} on {virtual}", flush=True)
    return split


def run_launcher(launcher: str, out: Path, kinds: set[str], total: float, virtual: str | None,
                 limits: dict[str, int] = ARM_LIMIT_S, *, models: Path, context: int = MAX_MODEL_LEN,
                 parts: tuple[str, ...] = MEASURES, reserve: str | None = None) -> None:
    """The arms of ``kinds`` for one launcher, in order; stock stops at the first boot. The model
    folders under ``models`` (``--models``); ``parts``: what the expert and plugin arms measure
    (``--measures``; the split arms measure SPLIT_MEASURES of them)."""
    model = reference_model(models, QUANT[launcher])
    drafter = drafter_model(models)
    cards = virtual_cards(virtual) or FREE
    cards_mib = [round(c * 1024) for c in cards]
    stock_booted = False
    specs = functools.partial(arm_specs, launcher, model, total_gib=total, drafter=drafter, free_gib=cards,
                              virtual=virtual, context=context, reserve=reserve)
    for arm in specs():
        if arm.kind not in kinds or (arm.kind == "stock" and stock_booted):
            continue
        limit = limits[arm.kind]
        job = boot_only if arm.kind == "stock" else functools.partial(measure, deadline=time.time() + limit - 60,
                                                                             parts=parts)
        booted = run_arm(arm, out, job, limit, cards_mib)["booted"]
        stock_booted |= arm.kind == "stock" and booted
        save_all(out)
    chosen = plugin_split(out, launcher, context, reserve)
    if "split" in kinds and not chosen:
        chosen = split_without_plugin_arm(out, launcher, model, drafter, virtual, context, reserve)
    if "split" in kinds and chosen:
        for arm in specs(chosen=chosen):
            if arm.kind == "split":
                job = functools.partial(measure, deadline=time.time() + limits["split"] - 60, parts=tuple(p for p in SPLIT_MEASURES if p in parts))
                run_arm(arm, out, job, limits["split"], cards_mib)
                save_all(out)


# --- the speed-aware split: one card made slower ------------------------------------------------------

HOG_BYTES = 4 * GiB


def copy_bandwidth_gbps(gpu: int, seconds: float = 3.0) -> float:
    """Device-to-device copy bandwidth of ``gpu`` (GB/s, read + write, as vendors count it), timed
    with CUDA events over ``seconds``."""
    import torch

    src = torch.empty(1 * GiB, dtype=torch.uint8, device=f"cuda:{gpu}")
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize(gpu)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    n, t0 = 0, time.time()
    start.record()
    while time.time() - t0 < seconds:
        dst.copy_(src)
        n += 1
        if n % 16 == 0:
            torch.cuda.synchronize(gpu)
    end.record()
    torch.cuda.synchronize(gpu)
    return 2 * n * src.numel() / (start.elapsed_time(end) / 1000) / 1e9


def bandwidths(_llm) -> dict:
    """Job (no engine): each GPU's copy bandwidth and the planner's figure (NVML's peak from bus
    width x memory clock, as vllm_dualgpu.nvml reads it for the executor)."""
    from vllm_dualgpu.nvml import read_visible_gpus

    return {"copy_gbps": [round(copy_bandwidth_gbps(g), 1) for g in range(2)],
            "nvml_peak_gbps": [g.bandwidth_gbps for g in read_visible_gpus()[:2]]}


def _hog_main(gpu: int, ready: str) -> None:
    import torch

    src = torch.empty(HOG_BYTES // 2, dtype=torch.uint8, device=f"cuda:{gpu}")
    dst = torch.empty_like(src)
    Path(ready).write_text("ready\n")
    while True:
        dst.copy_(src)


def planned_split(model: Path, free_gib: list[float], total_gib: float, bw: list, objective: str) -> dict:
    """The pure planner's GPU order (rank 0 first) and split for this pair with the given
    bandwidths (GB/s; None: the card's known figure), at 262,144 tokens or, where that does not
    fit, at the largest length that does (``max_model_len`` says which)."""
    from vllm_dualgpu.planner import GpuFacts, ModelSpec, PlanRequest, fit

    gpus = [GpuFacts(index=i, name="NVIDIA H200", total_bytes=int(total_gib * GiB), free_bytes=int(f * GiB),
                     bandwidth_gbps=b, capability=(9, 0)) for i, (f, b) in enumerate(zip(free_gib, bw))]
    req = PlanRequest(max_model_len=MAX_MODEL_LEN, kv_cache_dtype="fp8", max_num_seqs=2, max_num_batched_tokens=1024,
                      speculative=dict(MTP), objective=objective)
    p = fit(ModelSpec.from_hf_config(json.loads((model / "config.json").read_text())), gpus, req).plan
    return {"order": list(p.order), "partition": list(p.partition), "max_model_len": p.max_model_len}


def speed_main(out: Path, launcher: str, total: float, sweep: range, models: Path) -> dict:
    """A copy loop on GPU 1 (the 32 GiB card) takes part of its bandwidth; copy bandwidth of both
    GPUs before and after; the planner's speed split for the measured figures next to its split for
    NVML's (which the hog does not change: the plugin can only be told a bandwidth through NVML);
    the plugin at VLLM_DUALGPU_OBJECTIVE=speed; then every split in ``sweep`` (layers on the first
    rank), decode ms/step at short context twice. Stable only if both bandwidth readings agree
    within 5% and each split's two ms/step readings within 1.5% (half the 3% being judged)."""
    quant = QUANT[launcher]
    model = reference_model(models, quant)
    drafter = drafter_model(models)
    logs = out / "logs"
    ready = logs / "hog1.ready"
    ready.unlink(missing_ok=True)
    hog = start_group([sys.executable, str(Path(__file__).resolve()), "hog", "1", str(ready)], logs / "hog1.log")
    res: dict = {"launcher": launcher, "quant": quant}
    try:
        end = time.time() + 120
        while not ready.exists() and time.time() < end and hog.poll() is None:
            time.sleep(0.2)
        assert ready.exists(), f"the bandwidth hog did not start:\n{tail(logs / 'hog1.log')}"
        with ballast(FREE, logs):
            res["bw_before"] = run_llm(None, bandwidths, log=logs / "bw_before.log", timeout=120)
            copy = res["bw_before"].get("copy_gbps")
            nvml = res["bw_before"].get("nvml_peak_gbps")
            if copy and nvml:
                res["planned_measured"] = planned_split(model, FREE, total, copy, "speed")
                res["planned_nvml"] = planned_split(model, FREE, total, nvml, "speed")
            base = common_kwargs(model, launcher, drafter)
            plugin = Arm(f"{launcher}/speed-plugin", "plugin", launcher, {**base, "distributed_executor_backend": "dualgpu"},
                         {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "VLLM_DUALGPU_OBJECTIVE": "speed"})
            job = functools.partial(measure, deadline=time.time() + 540, parts=("short",))
            res["plugin"] = run_arm(plugin, out, job, 600)
            res["sweep"] = []
            for first in sweep:
                env = {**plugin.env, "VLLM_PP_LAYER_PARTITION": f"{first},{NUM_LAYERS - first}"}
                a = dataclasses.replace(plugin, name=f"{launcher}/speed-split-{first}_{NUM_LAYERS - first}", env=env)
                r = run_arm(a, out, functools.partial(speed_job, deadline=time.time() + 400), 420)
                res["sweep"].append(r)
            res["bw_after"] = run_llm(None, bandwidths, log=logs / "bw_after.log", timeout=120)
    finally:
        stop_group(hog.pid, grace=1.0)
    res["verdict"] = speed_verdict(res)
    (out / "speed.json").write_text(json.dumps(res, indent=1, default=str))
    print(json.dumps(res["verdict"]), flush=True)
    return res


def speed_job(llm, deadline: float) -> dict:
    r = boot_only(llm)
    r["runs"] = [decode_at(llm, prompt(SHORT, 10 + i)) for i in range(2) if time.time() < deadline]
    return r


def speed_verdict(res: dict) -> dict:
    """Whether the emulation was stable, the fastest split that held the context, and how far the
    plugin's choice was from it."""
    before, after = (res.get(k, {}).get("copy_gbps") for k in ("bw_before", "bw_after"))
    v: dict = {"stable": False, "why": []}
    if not before or not after:
        v["why"].append("bandwidth not measured before and after")
    elif any(abs(a - b) > 0.05 * b for a, b in zip(after, before)):
        v["why"].append(f"copy bandwidth moved more than 5%: {before} -> {after}")
    ms = {}
    for r in res.get("sweep", []):
        runs = [x["decode_ms_per_step"] for x in r.get("runs", [])]
        if len(runs) == 2 and r.get("kv_tokens", 0) and r["kv_tokens"] >= MAX_MODEL_LEN:
            if abs(runs[0] - runs[1]) > 0.015 * min(runs):
                v["why"].append(f"{r['name']}: two ms/step readings {runs} differ by more than 1.5%")
            ms[tuple(r["partition"])] = min(runs)
    if not ms:
        v["why"].append("no split that holds the context measured twice")
    else:
        fastest = min(ms, key=ms.get)
        chosen = tuple((res.get("plugin") or {}).get("partition") or ())
        planned = tuple((res.get("planned_measured") or {}).get("partition") or ())
        v.update(fastest=list(fastest), fastest_ms=ms[fastest])
        for key, split in (("chosen", chosen), ("planned_measured", planned)):
            v[key] = list(split)
            if ms.get(split):
                v[f"{key}_vs_fastest_pct"] = round(100 * (ms[split] / ms[fastest] - 1), 2)
    v["stable"] = not v["why"]
    return v


def virtual_split(launcher: str, model: Path, drafter: Path, virtual: str, context: int = MAX_MODEL_LEN) -> list[int]:
    """The pure planner's split for the plugin's arm on the virtual cards (what `vllm-dualgpu
    plan` says for the same command): the split arms' starting point in --dry-run."""
    from vllm_dualgpu.cli.inputs import with_default_reserves
    from vllm_dualgpu.patching.runtime import runtime_assumptions
    from vllm_dualgpu.planner import ModelSpec, PlanRequest, fit, parse_gpus

    spec = speculative(launcher, drafter)
    if spec["method"] == "dflash":
        spec["draft_config"] = json.loads((drafter / "config.json").read_text())
    req = PlanRequest(max_model_len=context, kv_cache_dtype="fp8", max_num_seqs=2, max_num_batched_tokens=1024,
                      speculative=spec, **runtime_assumptions().request_fields())
    # as the executor sees the virtual cards: headless unless display=yes (vllm_dualgpu/virtual_gpus.py),
    # each keeping what the executor keeps free there (as `plan --gpus` does)
    cards = with_default_reserves([dataclasses.replace(g, display=bool(g.display)) for g in parse_gpus(virtual)],
                                  virtual)
    return list(fit(ModelSpec.from_hf_config(json.loads((model / "config.json").read_text())),
                    cards, req).plan.partition)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("outdir", type=Path)
    ap.add_argument("--launchers", default=",".join(LAUNCHERS), help="comma-separated: " + ", ".join(LAUNCHERS))
    ap.add_argument("--arms", default=",".join(DEFAULT_ARMS), help="comma-separated: " + ", ".join(ARM_KINDS))
    ap.add_argument("--virtual", default=VIRTUAL, metavar="SPEC",
                    help="the virtual pair on GPU 0 (VLLM_DUALGPU_VIRTUAL_GPUS, `plan --gpus` syntax, small "
                         f"card first; default {VIRTUAL!r}); 'none': two GPUs with ballast")
    ap.add_argument("--speed", action="store_true", help="the speed-aware split instead of the arms (two GPUs)")
    ap.add_argument("--sweep", default="14,30", help="--speed: first-rank layer counts FROM,TO (every 2)")
    ap.add_argument("--limit", type=int, metavar="S",
                    help="every arm's wall-clock limit in seconds (default: " +
                         ", ".join(f"{k} {v}" for k, v in ARM_LIMIT_S.items()) + ")")
    ap.add_argument("--context", type=int, default=MAX_MODEL_LEN, metavar="TOKENS",
                    help="the plugin's and split arms' --max-model-len (default %(default)s; the expert keeps "
                         "its own); for a launcher the plan says does not hold 262,144: its largest length")
    ap.add_argument("--reserve", metavar="SIZES",
                    help="VLLM_DUALGPU_RESERVE for the plugin and split arms, e.g. 256MiB,688MiB (what a refusal "
                         "names); their names carry it (plugin-reserve-256MiB-688MiB)")
    ap.add_argument("--measures", default=",".join(MEASURES), metavar="LIST",
                    help="what a booted arm measures, in this order: " + ", ".join(MEASURES) + " (default all)")
    ap.add_argument("--dry-run", action="store_true", help="print every arm's arguments and environment")
    add_models_option(ap)
    return ap


def main() -> int:
    ap = build_parser()
    args = ap.parse_args()
    launchers = [x for x in args.launchers.split(",") if x]
    unknown = [x for x in launchers if x not in LAUNCHERS]
    if unknown:
        ap.error(f"unknown launcher(s) {unknown}; use {', '.join(LAUNCHERS)}")
    kinds = set(filter(None, args.arms.split(",")))
    virtual = None if args.virtual.lower() in ("", "none") else args.virtual
    if args.reserve:
        from vllm_dualgpu.envs import parse_reserve_sizes

        try:
            parse_reserve_sizes(args.reserve)
        except ValueError as e:
            ap.error(str(e))
    if virtual:
        virtual_cards(virtual)  # a bad spec fails here, with parse_gpus's line
    out = args.outdir.resolve()
    out.mkdir(parents=True, exist_ok=True)
    models = args.models.expanduser().resolve()  # vLLM hashes the path as given
    if args.dry_run:
        total = H200_TOTAL_GIB
        cards = virtual_cards(virtual) or FREE
        drafter = drafter_model(models)
        arms = []
        for name in launchers:
            model = reference_model(models, QUANT[name], tokenizer=False)
            chosen = plugin_split(out, name, args.context, args.reserve) or (
                virtual_split(name, model, drafter, virtual, args.context) if virtual
                else planned_split(model, FREE, total, [None, None], "pool")["partition"])
            arms += arm_specs(name, model, total_gib=total, drafter=drafter, chosen=chosen, free_gib=cards,
                              virtual=virtual, context=args.context, reserve=args.reserve)
        print(json.dumps([dataclasses.asdict(a) for a in arms], indent=1))
        return 0
    on_signals_stop_all()
    if args.speed:
        if virtual:
            ap.error("--speed needs two GPUs (a bandwidth hog on the big one): add --virtual none")
        lo, hi = map(int, args.sweep.split(","))
        speed_main(out / "speed", launchers[0], gpu_total_gib(), range(lo, hi + 1, 2), models)
        return 0
    limits = {k: args.limit for k in ARM_LIMIT_S} if args.limit else ARM_LIMIT_S
    parts = tuple(x for x in args.measures.split(",") if x)
    if set(parts) - set(MEASURES):
        ap.error(f"unknown measure(s) {sorted(set(parts) - set(MEASURES))}; use {', '.join(MEASURES)}")
    if virtual:  # one GPU; its total decides the expert's utilization (vLLM's free-memory check)
        total = gpu_total_gib(1)
        for name in launchers:
            run_launcher(name, out, kinds, total, virtual, limits, models=models, context=args.context, parts=parts,
                         reserve=args.reserve)
    else:
        total = gpu_total_gib()
        with ballast(FREE, out / "logs"):
            for name in launchers:
                run_launcher(name, out, kinds, total, None, limits, models=models, context=args.context, parts=parts,
                             reserve=args.reserve)
    print(table(save_all(out)))
    return 0


if __name__ == "__main__" and sys.argv[1:2] == ["hog"]:
    _hog_main(int(sys.argv[2]), sys.argv[3])
elif __name__ == "__main__":
    raise SystemExit(main())
