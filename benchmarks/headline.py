#!/usr/bin/env python3
"""Issue #18, the headline: the 27B reference shapes at 262,144 tokens on an emulated 16 GiB + 32 GiB pair.

    python benchmarks/headline.py OUTDIR [--quants w8a16,fp8] [--arms stock,expert,plugin,split]
    python benchmarks/headline.py OUTDIR --speed [--quants fp8]
    python benchmarks/headline.py OUTDIR --dry-run          # the arms as JSON; nothing starts

Two GPUs; ballast leaves 16 GiB free on GPU 0 and 32 GiB on GPU 1 (the small card FIRST in PCI
order, so the plugin has to reorder). The model is the bundled Qwen3.8-27B-class reference config
(64 layers, 48 Gated DeltaNet + 16 attention, vision tower, one MTP layer) with dummy weights in
W8A16 (compressed-tensors, int8 per channel) and FP8 (block 128); NVFP4 only on request (on SM 9.0
vLLM runs NVFP4 through weight-only W4A16 kernels, not the W4A4 path the reference setup's
Blackwell card uses). Every arm: MTP with 3 tokens, the vision tower on, fp8 KV, max_model_len
262,144, --max-num-seqs 2 --max-num-batched-tokens 1024, prefix caching, CUDA graphs as vLLM
defaults them (the expert's arm: PIECEWISE). Arms, per weight format, each ``vllm.LLM`` in a fresh
process group with a time limit:

1. stock: ``mp`` backend, vLLM's even split; default utilization, then the highest utilization
   that passes vLLM's free-memory check, going down until one boots;
2. expert: stock with the reference setup's hand-tuned flags (EXPERT), adapted to this pair;
3. plugin: ``--distributed-executor-backend dualgpu`` and nothing else;
4. split: the plugin with VLLM_PP_LAYER_PARTITION at its own split -2 and +2 layers.

Each arm that boots measures (``measure``): the KV pool, greedy token ids, TTFT at ~32K and ~250K
tokens, decode ms per step at short, 32K and ~250K context, the second turn of a 33K conversation
(prefix cache); the parent samples every GPU's used memory (the peak includes the 250K prompt).
A refusal records vLLM's or the plugin's line with the largest context that fits. Results per arm
in OUTDIR/arms/*.json, all of them in OUTDIR/headline.json and OUTDIR/headline.md (rebuilt after
every arm, so a killed run keeps what it measured; a later call with other --arms adds to them).

``--speed``: a bandwidth hog on GPU 1 (the big card) and a sweep of the plugin's split measuring
decode ms/step; see ``speed_main``. ``arm_specs`` is what the CPU tests check
(tests/integration/test_headline_configs.py): every arm's engine arguments and environment.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[0] / "tests" / "gpu"))
sys.path.insert(0, str(HERE))
from gpu_harness import GiB, ballast, grep, on_signals_stop_all, run_llm, start_group, stop_group, tail  # noqa: E402
from gpu_models import gdn_prefill_config, write_reference_model  # noqa: E402

FREE = [16.0, 32.0]  # GiB left free per GPU, PCI order: the small card first
QUANTS = ("w8a16", "fp8")  # the default run; "nvfp4" on request
NUM_LAYERS = 64
MAX_MODEL_LEN = 262_144
MTP = {"method": "mtp", "num_speculative_tokens": 3}
# The reference setup's hand-tuned flags (its launchers, as issue 18 lists them). Its small card
# is rank 0 (CUDA_VISIBLE_DEVICES=1,0 on its box, where the 5090 is index 0); here the small card
# is already index 0, so the order is 0,1. Its splits: NVFP4 13/51, W8A16 19/45, FP8 21/43,
# FP8+MTP 20/44; every arm here runs MTP and the reference has an MTP launcher for FP8 only, so
# W8A16 and NVFP4 take their split moved by the one layer the expert moved for MTP (FP8 21 -> 20).
# 180 blocks of 1664 tokens is its MTP pool (375 without MTP); 9e9 bytes of KV per rank caps
# what vLLM reserves. The shim (smfix.so) only fixes a mismatched SM pair: both H200s are SM 9.0.
# The free-memory check still applies with --kv-cache-memory-bytes (vLLM's request_memory), so
# the utilization is the highest that passes it on the 16 GiB card, as a user finds it.
EXPERT = {
    "partition": {"fp8": [20, 44], "w8a16": [18, 46], "nvfp4": [12, 52]},
    "block_size": 1664, "num_gpu_blocks_override": 180, "kv_cache_memory_bytes": 9_000_000_000,
    "cudagraph_mode": "PIECEWISE", "enable_flashinfer_autotune": False, "cuda_visible_devices": "0,1",
}
SPLIT_STEPS = (-2, 2)
ARM_KINDS = ("stock", "expert", "plugin", "split")
ARM_LIMIT_S = {"stock": 300, "expert": 600, "plugin": 600, "split": 420}  # each arm's wall-clock limit
SPLIT_MEASURES = ("short", "mid")  # the split arms: pool and ms/step
# Prompt lengths (tokens): ~32K and ~250K (the 250K prompt plus 3 speculative and the decode
# tokens stay under 262,144); the conversation's first turn is 33K.
LONG, MID, SHORT, TURN = 250_000, 32_768, 64, 33_000
DECODE_TOKENS = 64
H200_TOTAL_GIB = 143771 / 1024  # what NVML reports for an H200 (the planner's KNOWN_GPUS)


@dataclasses.dataclass
class Arm:
    name: str  # "<quant>/<kind>[-detail]"
    kind: str  # one of ARM_KINDS
    quant: str
    kwargs: dict
    env: dict

    @property
    def file(self) -> str:
        return self.name.replace("/", "_")


def common_kwargs(model: Path) -> dict:
    """The flags every arm shares: what a user of the reference setup types."""
    return {"model": str(model), "load_format": "dummy", "max_model_len": MAX_MODEL_LEN,
            "pipeline_parallel_size": 2, "max_num_seqs": 2, "max_num_batched_tokens": 1024,
            "kv_cache_dtype": "fp8", "speculative_config": dict(MTP), "enable_prefix_caching": True,
            "additional_config": gdn_prefill_config(), "disable_log_stats": False}


def utilizations(free_gib: list[float], total_gib: float, tries: int = 3) -> list[float]:
    """Stock's utilizations after the default: the highest that passes vLLM's check (utilization x
    total <= free on every card, two decimals) and ``tries - 1`` below it."""
    top = math.floor(100 * min(free_gib) / total_gib) / 100
    return [round(top - 0.01 * i, 2) for i in range(tries) if top - 0.01 * i > 0]


def arm_specs(quant: str, model: Path, *, total_gib: float, chosen: list[int] | None = None,
              free_gib: list[float] = FREE) -> list[Arm]:
    """Every arm of one weight format, in run order. ``chosen``: the plugin's split (arm 3's plan);
    without it the split arms are left out."""
    base = common_kwargs(model)
    order = {"CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    stock = {**base, "distributed_executor_backend": "mp"}
    arms = [Arm(f"{quant}/stock-default", "stock", quant, dict(stock), dict(order))]
    arms += [Arm(f"{quant}/stock-u{u:.2f}", "stock", quant, {**stock, "gpu_memory_utilization": u}, dict(order))
             for u in utilizations(free_gib, total_gib)]
    e = EXPERT
    arms.append(Arm(f"{quant}/expert", "expert", quant, {
        **stock, "gpu_memory_utilization": utilizations(free_gib, total_gib)[0], "block_size": e["block_size"],
        "num_gpu_blocks_override": e["num_gpu_blocks_override"], "kv_cache_memory_bytes": e["kv_cache_memory_bytes"],
        "compilation_config": {"cudagraph_mode": e["cudagraph_mode"]},
        "enable_flashinfer_autotune": e["enable_flashinfer_autotune"]},
        {**order, "CUDA_VISIBLE_DEVICES": e["cuda_visible_devices"],
         "VLLM_PP_LAYER_PARTITION": ",".join(map(str, e["partition"][quant]))}))
    plugin = {**base, "distributed_executor_backend": "dualgpu"}
    arms.append(Arm(f"{quant}/plugin", "plugin", quant, dict(plugin), dict(order)))
    firsts = [chosen[0] + d for d in SPLIT_STEPS] + [e["partition"][quant][0]] if chosen else []
    for first in dict.fromkeys(firsts):  # the expert's split: the plugin's per-step cost on the same split
        if 0 < first < NUM_LAYERS and first != chosen[0]:
            arms.append(Arm(f"{quant}/split-{first}_{NUM_LAYERS - first}", "split", quant, dict(plugin),
                            {**order, "VLLM_PP_LAYER_PARTITION": f"{first},{NUM_LAYERS - first}"}))
    return arms


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


def decode_at(llm, ids: list[int]) -> dict:
    """TTFT (cold), then ms per decode step at this context: the same prompt again (prefix-cached)
    for 1 token and for 1 + DECODE_TOKENS; the difference over the steps it took."""
    cold = timed(llm, ids, 1)
    warm1 = timed(llm, ids, 1)
    run = timed(llm, ids, 1 + DECODE_TOKENS)
    steps = run["steps"] if run["steps"] else DECODE_TOKENS
    return {"context": len(ids), "ttft_s": round(cold["s"], 3), "cached_ttft_s": round(warm1["s"], 3),
            "decode_ms_per_step": round(1000 * (run["s"] - warm1["s"]) / steps, 3), "decode_steps": steps,
            "decode_tokens": len(run["tokens"]) - 1, "steps_counted": bool(run["steps"])}


MEASURES = ("short", "mid", "second_turn", "long")


def measure(llm, deadline: float, parts: tuple[str, ...] = MEASURES) -> dict:
    """What an arm that booted measures (``parts`` of MEASURES), in order of cost; each only while
    time is left (the rest are listed under "skipped")."""
    cfg = llm.llm_engine.vllm_config
    res = {"num_gpu_blocks": cfg.cache_config.num_gpu_blocks, "block_size": cfg.cache_config.block_size,
           "partition": None, "skipped": []}
    greedy = timed(llm, prompt(SHORT, 1), 32)
    res["greedy_token_ids"] = greedy["tokens"]
    steps = {"short": lambda: decode_at(llm, prompt(SHORT, 2)), "mid": lambda: decode_at(llm, prompt(MID, 3)),
             "second_turn": lambda: second_turn(llm), "long": lambda: decode_at(llm, prompt(LONG, 5))}
    for name in parts:
        fn = steps[name]
        if time.time() > deadline:
            res["skipped"].append(name)
            continue
        try:
            res[name] = fn()
        except Exception as exc:
            res[name] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
    return res


def second_turn(llm) -> dict:
    """A 33K-token first turn and its answer, then the follow-up (the whole conversation plus 200
    new tokens): the second turn's TTFT shows whether the prefix cache served the first."""
    first_ids = prompt(TURN, 4)
    first = timed(llm, first_ids, 64)
    follow = first_ids + first["tokens"] + prompt(200, 6)
    second = timed(llm, follow, 1)
    return {"first_turn_s": round(first["s"], 3), "second_turn_ttft_s": round(second["s"], 3),
            "second_turn_tokens": len(follow)}


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


def run_arm(arm: Arm, out: Path, job, timeout: float) -> dict:
    from memory_sweep import NvmlSampler

    log = out / "logs" / f"{arm.file}.log"
    plan_file = out / "logs" / f"{arm.file}.plan.json"
    env = {**arm.env, "VLLM_DUALGPU_PLAN_FILE": str(plan_file)}
    with NvmlSampler() as s:
        res = run_llm(arm.kwargs, job, log=log, timeout=timeout, env=env)
    r = {"name": arm.name, "kind": arm.kind, "quant": arm.quant, "env": env, "kwargs": arm.kwargs,
         **{k: v for k, v in res.items() if k != "log"}}
    r["kv_tokens"] = res["num_gpu_blocks"] * res["block_size"] if res.get("num_gpu_blocks") else None
    r["booted"] = r["kv_tokens"] is not None
    r["peak_used_gib"] = [round((pk - b) / GiB, 3) for pk, b in zip(s.peak, s.base)]
    r["rank_lines"] = grep(log, r"vllm-dualgpu rank \d")
    r["refusals"] = [line[-500:] for line in grep(log, r"ValueError|does not fit|less than desired|maximum model length")][:4]
    r["largest_context"] = MAX_MODEL_LEN if r["booted"] and r["kv_tokens"] >= MAX_MODEL_LEN else largest_context(r["refusals"])
    if plan_file.exists():
        r["plan"] = json.loads(plan_file.read_text())
        r["partition"] = r["plan"].get("partition")
        r["predicted_used_gib"] = predicted_used_gib(r["plan"])
    elif "VLLM_PP_LAYER_PARTITION" in arm.env:
        r["partition"] = [int(x) for x in arm.env["VLLM_PP_LAYER_PARTITION"].split(",")]
    if not r["booted"]:
        r["log_tail"] = tail(log, 15)
    (out / "arms").mkdir(parents=True, exist_ok=True)
    (out / "arms" / f"{arm.file}.json").write_text(json.dumps(r, indent=1, default=str))
    print(json.dumps({k: r.get(k) for k in ("name", "booted", "kv_tokens", "partition", "boot_s", "wall_s",
                                            "peak_used_gib")}), flush=True)
    return r


def fmt(x, spec: str = "") -> str:
    return "-" if x is None else format(x, spec)


def table(results: list[dict]) -> str:
    rows = ["| arm | split | boots | boot (s) | KV pool (tokens) | largest context | TTFT 32K / 250K (s) | "
            "decode ms/step short / 32K / 250K | 2nd turn of 33K, TTFT (s) | peak GPU0 / GPU1 (GiB) | "
            "predicted GPU0 / GPU1 (GiB) |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        d = {k: r.get(k) if isinstance(r.get(k), dict) else {} for k in ("short", "mid", "long", "second_turn")}
        rows.append(
            f"| {r['name']} | {'/'.join(map(str, r.get('partition') or [])) or 'even'} | {'yes' if r['booted'] else 'no'} | "
            f"{fmt(r.get('boot_s'))} | {fmt(r.get('kv_tokens'), ',')} | {fmt(r.get('largest_context'), ',')} | "
            f"{fmt(d['mid'].get('ttft_s'))} / {fmt(d['long'].get('ttft_s'))} | "
            f"{' / '.join(fmt(d[k].get('decode_ms_per_step')) for k in ('short', 'mid', 'long'))} | "
            f"{fmt(d['second_turn'].get('second_turn_ttft_s'))} | {' / '.join(f'{x:.2f}' for x in r['peak_used_gib'])} | "
            f"{' / '.join(fmt(x, '.2f') for x in r.get('predicted_used_gib') or [None, None])} |")
    ranks = [f"    {r['name']}: {line.split('] ', 1)[-1]}" for r in results for line in r.get("rank_lines", [])]
    if ranks:
        rows += ["", "Per-rank lines (predicted vs vLLM's profile):", "", *ranks]
    return "\n".join(rows) + "\n"


def save_all(out: Path) -> list[dict]:
    results = [json.loads(p.read_text()) for p in sorted((out / "arms").glob("*.json"))]
    results.sort(key=lambda r: (r["quant"], ARM_KINDS.index(r["kind"]), r["name"]))
    (out / "headline.json").write_text(json.dumps(results, indent=1, default=str))
    (out / "headline.md").write_text(table(results))
    return results


def gpu_total_gib() -> float:
    import pynvml

    pynvml.nvmlInit()
    return min(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(i)).total
               for i in range(2)) / GiB


def plugin_split(out: Path, quant: str) -> list[int] | None:
    """Arm 3's split, from its result file (this run's or an earlier call's)."""
    f = out / "arms" / f"{quant}_plugin.json"
    return json.loads(f.read_text()).get("partition") if f.exists() else None


def run_quant(quant: str, out: Path, kinds: set[str], total: float) -> None:
    """The arms of ``kinds`` for one weight format, in order; stock stops at the first boot."""
    model = write_reference_model(out / "models" / quant, quant)
    stock_booted = False
    for arm in arm_specs(quant, model, total_gib=total):
        if arm.kind not in kinds or (arm.kind == "stock" and stock_booted):
            continue
        limit = ARM_LIMIT_S[arm.kind]
        job = boot_only if arm.kind == "stock" else functools.partial(measure, deadline=time.time() + limit - 60)
        stock_booted |= arm.kind == "stock" and run_arm(arm, out, job, limit)["booted"]
        save_all(out)
    chosen = plugin_split(out, quant)
    if "split" in kinds and chosen:
        for arm in arm_specs(quant, model, total_gib=total, chosen=chosen):
            if arm.kind == "split":
                job = functools.partial(measure, deadline=time.time() + ARM_LIMIT_S["split"] - 60, parts=SPLIT_MEASURES)
                run_arm(arm, out, job, ARM_LIMIT_S["split"])
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
    bandwidths (GB/s; None: the card's known figure)."""
    from vllm_dualgpu.planner import GpuFacts, ModelSpec, PlanRequest, plan

    gpus = [GpuFacts(index=i, name="NVIDIA H200", total_bytes=int(total_gib * GiB), free_bytes=int(f * GiB),
                     bandwidth_gbps=b, capability=(9, 0)) for i, (f, b) in enumerate(zip(free_gib, bw))]
    req = PlanRequest(max_model_len=MAX_MODEL_LEN, kv_cache_dtype="fp8", max_num_seqs=2, max_num_batched_tokens=1024,
                      speculative=dict(MTP), objective=objective)
    p = plan(ModelSpec.from_hf_config(json.loads((model / "config.json").read_text())), gpus, req)
    return {"order": list(p.order), "partition": list(p.partition)}


def speed_main(out: Path, quant: str, total: float, sweep: range) -> dict:
    """A copy loop on GPU 1 (the 32 GiB card) takes part of its bandwidth; copy bandwidth of both
    GPUs before and after; the planner's speed split for the measured figures next to its split for
    NVML's (which the hog does not change: the plugin can only be told a bandwidth through NVML);
    the plugin at VLLM_DUALGPU_OBJECTIVE=speed; then every split in ``sweep`` (layers on the first
    rank), decode ms/step at short context twice. Stable only if both bandwidth readings agree
    within 5% and each split's two ms/step readings within 1.5% (half the 3% being judged)."""
    model = write_reference_model(out / "models" / quant, quant)
    logs = out / "logs"
    ready = logs / "hog1.ready"
    ready.unlink(missing_ok=True)
    hog = start_group([sys.executable, str(Path(__file__).resolve()), "hog", "1", str(ready)], logs / "hog1.log")
    res: dict = {"quant": quant}
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
            base = common_kwargs(model)
            plugin = Arm(f"{quant}/speed-plugin", "plugin", quant, {**base, "distributed_executor_backend": "dualgpu"},
                         {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "VLLM_DUALGPU_OBJECTIVE": "speed"})
            job = functools.partial(measure, deadline=time.time() + 540, parts=("short",))
            res["plugin"] = run_arm(plugin, out, job, 600)
            res["sweep"] = []
            for first in sweep:
                env = {**plugin.env, "VLLM_PP_LAYER_PARTITION": f"{first},{NUM_LAYERS - first}"}
                a = dataclasses.replace(plugin, name=f"{quant}/speed-split-{first}_{NUM_LAYERS - first}", env=env)
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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("outdir", type=Path)
    ap.add_argument("--quants", default=",".join(QUANTS), help="comma-separated: w8a16, fp8, nvfp4")
    ap.add_argument("--arms", default=",".join(ARM_KINDS), help="comma-separated: " + ", ".join(ARM_KINDS))
    ap.add_argument("--speed", action="store_true", help="the speed-aware split instead of the arms")
    ap.add_argument("--sweep", default="14,30", help="--speed: first-rank layer counts FROM,TO (every 2)")
    ap.add_argument("--dry-run", action="store_true", help="print every arm's arguments and environment")
    args = ap.parse_args()
    quants = [q for q in args.quants.split(",") if q]
    kinds = set(filter(None, args.arms.split(",")))
    out = args.outdir.resolve()
    out.mkdir(parents=True, exist_ok=True)
    if args.dry_run:
        total = H200_TOTAL_GIB
        arms = [a for q in quants for a in arm_specs(q, out / "models" / q, total_gib=total,
                                                      chosen=plugin_split(out, q) or planned_split(
                                                          write_reference_model(out / "models" / q, q, tokenizer=False),
                                                          FREE, total, [None, None], "pool")["partition"])]
        print(json.dumps([dataclasses.asdict(a) for a in arms], indent=1))
        return 0
    on_signals_stop_all()
    total = gpu_total_gib()
    if args.speed:
        lo, hi = map(int, args.sweep.split(","))
        speed_main(out / "speed", quants[0], total, range(lo, hi + 1, 2))
        return 0
    with ballast(FREE, out / "logs"):
        for q in quants:
            run_quant(q, out, kinds, total)
    print(table(save_all(out)))
    return 0


if __name__ == "__main__" and sys.argv[1:2] == ["hog"]:
    _hog_main(int(sys.argv[2]), sys.argv[3])
elif __name__ == "__main__":
    raise SystemExit(main())
