#!/usr/bin/env python3
"""Issue #26 item 1, the decode model's measurements: the time of one decoder layer of each kind
(Gated DeltaNet, full attention) and the fixed per-step cost, per weight format, on one GPU.

    python benchmarks/decode_model.py OUTDIR [--formats fp8,w8a16,nvfp4,bf16] [--drafters mtp,none]
        [--layouts p4,p16,g16] [--contexts short,32k,250k] [--limit S] [--budget S] [--models DIR]
    python benchmarks/decode_model.py OUTDIR --dry-run      # every arm's LLM arguments; nothing starts

The model is the bundled reference shape (tests/gpu/gpu_models.write_reference_model: hidden 5120,
Qwen3.5 GDN and gated attention layers, one MTP layer) with dummy weights in the format asked
(fp8: block 128; w8a16: compressed-tensors int8 per channel; nvfp4: ModelOpt, weight-only
kernels on SM 9.0; bf16: no quantization_config), its decoder cut to a few layers (``LAYOUTS``):
p4 = 3 GDN + 1 attention (the reference's pattern), p16 = 12 + 4, g16 = 16 GDN (a4 = 4 attention,
the alternative third arm should a GDN-only model not boot; f64 = the whole decoder, 48 + 16).
p4pp2 (not a default) is p4 under PP=2 through the plugin on the headline's virtual pair (split
2/2, the plugin's zero-flag pool), run after its PP=1 twin: its step less p4's is what the
pipeline adds to a step on that pair (the ``pipeline_ms`` entries among decode-model.json's
fits), the term the PP=1 arms cannot give. The text model only
(``language_model_only``), PP=1, vLLM's own executor, the launchers' serving flags: fp8 KV,
prefix caching, max_model_len 262,144, --max-num-seqs 2 --max-num-batched-tokens 1024, and the
drafter: MTP with 3 tokens, or none. (DFlash is not measured here: its drafter reads five target
layers by index, 1 to 61, which a cut model does not have.)

Each arm (format x drafter x layout, in that order, fp8 and w8a16 first) is one ``vllm.LLM`` in a
process group of its own with a wall-clock limit (gpu_harness.run_llm); after a short warm-up it
measures decode ms/step at each context (headline.decode_at: the prefix-cached prompt for 1 token
and for 1 + 128, over the steps vLLM counted; with MTP and random weights nearly every draft is
rejected, so a step is one target pass over 1 + 3 tokens and three drafter passes), twice, and
keeps the faster. g16 runs the short context only: nothing in it reads the context.
OUTDIR/arms/<arm>.json per arm. OUTDIR/decode-model.json, rewritten after every arm: every arm
(format, drafter, layers by kind, ms/step and steps per context, boot seconds); per format and
drafter the fit of vllm_dualgpu/planner/decode_fit.py (ms per GDN layer, ms per attention layer
and fixed ms at each context, achieved GB/s on the planner's byte counts, the bandwidth
fractions) and, with both drafters measured, the drafter's share of the fixed term; the card's
read and copy bandwidth as ``vllm-dualgpu calibrate`` measures them (once per OUTDIR, ~10 s).
An arm whose file exists is not run again (delete a failed arm's file to retry it). The PP=1
arms do not measure the pipeline hop or a second rank's own per-step cost: p4pp2 does.

Budget: measured on the H200 (benchmarks/results/2026-12-02-decode-model): a cold arm boots in
~250 s, ~107 s of it vLLM's first profile pass (compilation, Triton autotuning), and its three
contexts take ~15 s more; warm compile caches (scripts/gpu/caches.sh) should cut the boot (not
yet measured). One cold arm fits one of the device's 10-minute commands (``run.sh OUTDIR
decode``, 505 s of budget: after a 265 s arm too little is left for another, as both commands
of that run found); a set of three (one format, one drafter) takes three commands cold. In the
default order: fp8 with MTP, fp8 without a drafter (the MTP pass by difference), w8a16 with MTP;
the rest (w8a16 without, nvfp4, bf16) later. ``--budget S`` starts no arm that would end past S
seconds (the longest arm of the call so far, 280 s before the first); an arm the budget cuts, or
leaves without a measured context, is not kept, so each command stops cleanly and the next, the
same command, resumes.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[0]
sys.path.insert(0, str(ROOT / "tests" / "gpu"))
sys.path.insert(0, str(HERE))
import headline as hl  # noqa: E402
from gpu_harness import on_signals_stop_all, run_llm, tail  # noqa: E402
from gpu_models import write_reference_model  # noqa: E402
from model_folders import add_models_option, kept_folder  # noqa: E402

from vllm_dualgpu.planner import ModelSpec, lookup  # noqa: E402
from vllm_dualgpu.planner.decode_fit import (  # noqa: E402
    LayerRead,
    Measured,
    UnderDetermined,
    fit_layer_times,
    fractions_from_times,
    layer_reads,
    predict_step_ms,
)
from vllm_dualgpu.planner.hf_config import FULL, LINEAR  # noqa: E402

FORMATS = ("fp8", "w8a16", "nvfp4", "bf16")
DRAFTERS = ("mtp", "none")
LAYOUTS = {"p4": (3, 1), "p16": (12, 4), "g16": (16, 0), "a4": (0, 4),  # (GDN, attention) layers
           # the whole reference decoder on one GPU, stock vLLM at PP=1: the baseline the PP=2 pair's
           # step is read against (its growth from 32K to 250K tokens, 2026-12-04); not a default
           "f64": (48, 16),
           # p4 under PP=2 on the virtual pair (the plugin, split 2/2): its step less p4's at PP=1 is
           # what the pipeline adds to a step on that pair (the hops, two processes on one GPU)
           "p4pp2": (3, 1)}
DEFAULT_LAYOUTS = ("p4", "p16", "g16")
#: the layouts that run under PP=2 on the virtual pair: their layer split and their PP=1 twin
PAIR_LAYOUTS = {"p4pp2": ((2, 2), "p4")}
CONTEXTS = {"short": hl.SHORT, "32k": hl.MID, "250k": hl.LONG}
DECODE_TOKENS = 128
REPEATS = 2
ARM_LIMIT_S = 400  # a cold arm took 265 s on the H200 (its boot 252 s)
FIRST_ARM_S = 280  # --budget's guess at an arm before one has run (a cold boot took 250-270 s)
UTILIZATION = 0.3  # ~42 GiB of an H200: the largest arm (bf16, 16 layers) with room for 262,144 tokens
UTILIZATION_BY_LAYOUT = {"f64": 0.5}  # ~70 GiB: 64 fp8 layers, head and embedding, 262,144 tokens of KV
SKIP_KEYS = ("modules_to_not_convert", "ignore", "exclude_modules")  # fp8, w8a16, nvfp4


def pair_env(layout: str) -> dict:
    """A pair layout's environment: the headline's virtual pair (small card first), spawned
    workers, and the layout's split; empty for a PP=1 layout."""
    if layout not in PAIR_LAYOUTS:
        return {}
    split = PAIR_LAYOUTS[layout][0]
    return {**hl.pair_env(hl.VIRTUAL), "VLLM_PP_LAYER_PARTITION": ",".join(map(str, split))}


def layer_kinds(layout: str) -> list[str]:
    """The layout's decoder: the reference's pattern (three GDN, then attention) while both
    kinds last, then the rest."""
    gdn, attn = LAYOUTS[layout]
    kinds = []
    while gdn or attn:
        take = min(gdn, 3)
        kinds += [LINEAR] * take + [FULL] * min(attn, 1)
        gdn, attn = gdn - take, attn - min(attn, 1)
    return kinds


def cut_config(cfg: dict, kinds: list[str]) -> dict:
    """``cfg`` (a reference config.json) with the decoder ``kinds``; every GDN layer's in_proj_a/b
    left unquantized, as the reference checkpoint leaves them."""
    cfg = json.loads(json.dumps(cfg))
    cfg["text_config"].update(num_hidden_layers=len(kinds), layer_types=list(kinds))
    q = cfg.get("quantization_config")
    for key in SKIP_KEYS if q else ():
        if key in q:
            keep = [n for n in q[key] if ".linear_attn." not in n]
            q[key] = keep + [f"model.language_model.layers.{i}.linear_attn.in_proj_{x}"
                             for i, k in enumerate(kinds) if k == LINEAR for x in "ab"]
    return cfg


def write_arm_model(out: Path, fmt: str, kinds: list[str], tokenizer: bool = True) -> Path:
    write_reference_model(out, "fp8" if fmt == "bf16" else fmt, tokenizer=tokenizer)
    cfg = cut_config(json.loads((out / "config.json").read_text()), kinds)
    if fmt == "bf16":
        cfg.pop("quantization_config")
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    return out


@dataclasses.dataclass
class Arm:
    name: str  # "<format>-<drafter>-<layout>"
    fmt: str
    drafter: str
    layout: str
    layers: dict  # {"linear_attention": n, "full_attention": m}
    contexts: list[int]
    kwargs: dict
    reads: dict  # kind -> the planner's LayerRead of one layer of it, as a dict
    env: dict = dataclasses.field(default_factory=dict)  # a pair layout's (pair_env)


def arm_kwargs(model: Path, drafter: str, utilization: float = UTILIZATION, pair: bool = False) -> dict:
    """PP=1 on vLLM's own executor; ``pair``: the plugin at PP=2 on the virtual pair with zero
    flags of its own (it sizes each virtual card's pool and turns FlashInfer's autotune off)."""
    # FlashInfer autotune off: the dualgpu executor turns it off for pipeline stages
    # (kernels/flashinfer.decide_flashinfer_autotune), and the model predicts those runs
    kw = {**hl.common_kwargs(model), "language_model_only": True}  # PP=2, as the headline's arms
    if pair:
        kw["distributed_executor_backend"] = "dualgpu"
    else:
        kw.update(pipeline_parallel_size=1, gpu_memory_utilization=utilization, enable_flashinfer_autotune=False)
    if drafter == "none":
        kw.pop("speculative_config")
    else:
        kw["speculative_config"] = dict(hl.MTP)
    return kw


def arm_specs(models: Path, formats=FORMATS, drafters=DRAFTERS, layouts=DEFAULT_LAYOUTS,
              contexts: tuple[int, ...] = (hl.SHORT, hl.MID, hl.LONG), tokenizer: bool = True) -> list[Arm]:
    """Every arm in run order: by format, then drafter, then layout."""
    arms = []
    for fmt in formats:
        for layout in layouts:
            kinds = layer_kinds(layout)
            model = kept_folder(models, f"decode-{fmt}-{layout}",
                                functools.partial(write_arm_model, fmt=fmt, kinds=kinds, tokenizer=tokenizer))
            # the planner's reads of one layer of each kind, on the pattern (it sizes no GDN-only model)
            spec = ModelSpec.from_hf_config(cut_config(json.loads((model / "config.json").read_text()),
                                                       layer_kinds("p4")))
            for drafter in drafters:
                reads = {}
                for r in layer_reads(spec, "fp8", 0 if drafter == "none" else hl.MTP["num_speculative_tokens"]):
                    reads.setdefault(r.kind, dataclasses.asdict(r))
                ctx = [min(contexts)] if FULL not in kinds else sorted(contexts)
                arms.append(Arm(f"{fmt}-{drafter}-{layout}", fmt, drafter, layout,
                                {k: kinds.count(k) for k in (LINEAR, FULL)}, ctx,
                                arm_kwargs(model, drafter, UTILIZATION_BY_LAYOUT.get(layout, UTILIZATION),
                                           pair=layout in PAIR_LAYOUTS), reads, pair_env(layout)))
    order = {(f, d): i for i, (f, d) in enumerate((f, d) for f in formats for d in drafters)}
    return sorted(arms, key=lambda a: order[(a.fmt, a.drafter)])  # stable: layouts keep their order


# --- in the engine's process ---------------------------------------------------------------------


def measure_decode(llm, contexts: list[int], deadline: float, tokens: int = DECODE_TOKENS, repeats: int = REPEATS,
                   progress: str | None = None) -> dict:
    res = {**hl.boot_only(llm), "runs": {}, "skipped": []}
    hl.timed(llm, hl.prompt(hl.SHORT, 0), 32)  # warm-up: first-use costs out of the first reading
    for i, n in enumerate(contexts):
        if time.time() > deadline:
            res["skipped"].append(n)
            continue
        res["runs"][str(n)] = [hl.decode_at(llm, hl.prompt(n, 10 + i), tokens) for _ in range(repeats)]
        hl.save_progress(res, progress)
    return res


# --- in this process -----------------------------------------------------------------------------


def probe_job(_llm) -> dict:
    """The card's read and copy bandwidth as ``vllm-dualgpu calibrate`` measures them."""
    from vllm_dualgpu.bandwidth_probe import measure

    m = measure(0, 4.0)
    return {"read_gbps": m.read_gbps, "copy_gbps": m.copy_gbps}


def run_arm(arm: Arm, out: Path, limit: float) -> dict:
    log = out / "logs" / f"{arm.name}.log"
    progress = log.with_suffix(".progress.json")
    log.parent.mkdir(parents=True, exist_ok=True)
    progress.unlink(missing_ok=True)
    job = functools.partial(measure_decode, contexts=arm.contexts, deadline=time.time() + limit - 30,
                            progress=str(progress))
    res = run_llm(arm.kwargs, job, log=log, timeout=limit, env=arm.env or None)
    if "error" in res and progress.exists():  # cut by its limit (or failed) after booting
        res = {**json.loads(progress.read_text()), **res, "cut_after_boot": True}
    r = {**dataclasses.asdict(arm), **{k: v for k, v in res.items() if k != "log"}}
    runs = r.get("runs") or {}
    best = {c: min(rs, key=lambda x: x["decode_ms_per_step"]) for c, rs in runs.items() if rs}
    r["ms_per_step"] = {c: b["decode_ms_per_step"] for c, b in best.items()}
    r["steps"] = {c: b["decode_steps"] for c, b in best.items()}
    r["booted"] = "num_gpu_blocks" in r
    if not r["ms_per_step"]:
        r["log_tail"] = tail(log, 15)
    (out / "arms").mkdir(parents=True, exist_ok=True)
    (out / "arms" / f"{arm.name}.json").write_text(json.dumps(r, indent=1, default=str))
    print(json.dumps({k: r.get(k) for k in ("name", "booted", "boot_s", "wall_s", "ms_per_step", "error")}), flush=True)
    return r


def cut_by_budget(r: dict, left: float, limit: float) -> bool:
    """Whether the call's budget, not the arm's own limit, stopped the arm short: killed, or booted
    too late to measure every context (seen: a 271 s boot left no context measured). Such an arm
    is not kept, so the same command runs it again."""
    return left < limit and bool(r.get("timed_out") or r.get("skipped"))


def summarize(results: list[dict], bandwidth_gbps: float, run: str) -> list[dict]:
    """Per format and drafter: the fit over its arms' readings, achieved GB/s and fractions; with
    both drafters of a format measured, the drafter's share of the fixed term per context."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in results:
        if r["layout"] not in PAIR_LAYOUTS:  # the layer fit is PP=1's
            groups.setdefault((r["fmt"], r["drafter"]), []).append(r)
    fits = []
    for (fmt, drafter), rs in groups.items():
        f = {"format": fmt, "drafter": drafter, "arms": [r["name"] for r in rs]}
        points = [Measured(r["layers"][LINEAR], r["layers"][FULL], int(c), ms)
                  for r in rs for c, ms in (r.get("ms_per_step") or {}).items()]
        try:
            t = fit_layer_times(points)
        except UnderDetermined as e:
            fits.append({**f, "error": f"under-determined: {e}"})
            continue
        reads = {k: LayerRead(**v) for r in rs for k, v in r["reads"].items()}
        fr = fractions_from_times(t, reads[LINEAR], reads[FULL], bandwidth_gbps=bandwidth_gbps, weight_format=fmt,
                                  drafter=drafter, run=run)
        gbps = lambda nbytes, ms: round(nbytes / ms / 1e6, 1) if ms > 0 else None  # noqa: E731
        f.update(gdn_layer_ms=t.gdn_ms, attention_layer_ms=t.attention_ms, fixed_ms=t.fixed_ms,
                 max_residual_ms=t.max_residual_ms, points=t.points,
                 achieved_gbps={"gdn": gbps(reads[LINEAR].bytes_at(0), t.gdn_ms),
                                "attention": {c: gbps(reads[FULL].bytes_at(c), ms)
                                              for c, ms in t.attention_ms.items()}},
                 fractions=fr.to_dict())
        try:  # the fractions' own prediction of every reading (the middle contexts are not fitted by them)
            f["predicted_vs_measured"] = [
                {"arm": r["name"], "context": int(c), "measured_ms": ms, "predicted_ms": round(predict_step_ms(
                    [reads[LINEAR]] * r["layers"][LINEAR] + [reads[FULL]] * r["layers"][FULL], fr,
                    context=int(c), bandwidth_gbps=bandwidth_gbps), 3)}
                for r in rs for c, ms in (r.get("ms_per_step") or {}).items()]
        except ValueError as e:
            f["predicted_vs_measured"] = str(e)
        fits.append(f)
    fits += pipeline_terms(results)
    by = {(f["format"], f["drafter"]): f for f in fits if "fixed_ms" in f}
    for (fmt, drafter), f in by.items():
        base = by.get((fmt, "none"))
        if drafter != "none" and base:
            f["drafter_ms"] = {c: ms - base["fixed_ms"][c] for c, ms in f["fixed_ms"].items() if c in base["fixed_ms"]}
    return fits


def pipeline_terms(results: list[dict]) -> list[dict]:
    """Per pair arm: what PP=2 on the virtual pair adds to a step at each context, its step less
    its PP=1 twin's (the same model, format and drafter), where both were measured."""
    by_name = {r["name"]: r for r in results}
    out = []
    for r in results:
        if r["layout"] not in PAIR_LAYOUTS:
            continue
        twin = by_name.get(f"{r['fmt']}-{r['drafter']}-{PAIR_LAYOUTS[r['layout']][1]}")
        pair, one = r.get("ms_per_step") or {}, (twin or {}).get("ms_per_step") or {}
        out.append({"format": r["fmt"], "drafter": r["drafter"], "arm": r["name"],
                    "pp1_arm": twin["name"] if twin else None, "split": list(PAIR_LAYOUTS[r["layout"]][0]),
                    "pipeline_ms": {c: round(ms - one[c], 3) for c, ms in pair.items() if c in one}})
    return out


def save_all(out: Path, meta: dict) -> dict:
    results = [json.loads(p.read_text()) for p in sorted((out / "arms").glob("*.json"))]
    doc = {**meta, "arms": results, "fits": summarize(results, meta["bandwidth_gbps"], meta["run"])}
    (out / "decode-model.json").write_text(json.dumps(doc, indent=1, default=str))
    return doc


def gpu_name() -> str:
    import pynvml

    pynvml.nvmlInit()
    name = pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(0))
    return name.decode() if isinstance(name, bytes) else name


def pick(ap, text: str, known, what: str) -> list:
    items = [x for x in text.split(",") if x]
    bad = [x for x in items if x not in known]
    if bad or not items:
        ap.error(f"unknown {what} {bad or text!r}; use {', '.join(known)}")
    return items


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("outdir", type=Path)
    ap.add_argument("--formats", default=",".join(FORMATS), help="comma-separated, in run order: " + ", ".join(FORMATS))
    ap.add_argument("--drafters", default=",".join(DRAFTERS), help="comma-separated: " + ", ".join(DRAFTERS))
    ap.add_argument("--layouts", default=",".join(DEFAULT_LAYOUTS), help="comma-separated: " + ", ".join(LAYOUTS))
    ap.add_argument("--contexts", default=",".join(CONTEXTS), help="comma-separated: " + ", ".join(CONTEXTS))
    ap.add_argument("--limit", type=int, default=ARM_LIMIT_S, metavar="S",
                    help="each arm's wall-clock limit (%(default)s)")
    ap.add_argument("--budget", type=int, metavar="S", help="start no arm that would end past S seconds")
    ap.add_argument("--bandwidth", type=float, metavar="GBPS", help="the card's bandwidth the fractions are of "
                    "(default: the planner's figure for the GPU NVML names)")
    ap.add_argument("--dry-run", action="store_true", help="print every arm's LLM arguments; nothing starts")
    add_models_option(ap)
    args = ap.parse_args(argv)
    t0 = time.time()
    formats = pick(ap, args.formats, FORMATS, "format(s)")
    drafters = pick(ap, args.drafters, DRAFTERS, "drafter(s)")
    layouts = pick(ap, args.layouts, LAYOUTS, "layout(s)")
    contexts = [CONTEXTS[c] for c in pick(ap, args.contexts, CONTEXTS, "context(s)")]
    models = args.models.expanduser().resolve()  # vLLM hashes the path as given
    arms = arm_specs(models, formats, drafters, layouts, contexts, tokenizer=not args.dry_run)
    if args.dry_run:
        print(json.dumps([dataclasses.asdict(a) for a in arms], indent=1))
        return 0
    on_signals_stop_all()
    out = args.outdir.resolve()
    out.mkdir(parents=True, exist_ok=True)
    name = gpu_name()
    known = lookup(name)
    bw = args.bandwidth or (known.bandwidth_gbps if known else None)
    if not bw:
        ap.error(f"no bandwidth known for {name!r}: pass --bandwidth GBPS")
    from importlib.metadata import version

    probe = out / "probe.json"  # once per OUTDIR: what calibrate would give this card
    if not probe.exists():
        res = run_llm(None, probe_job, log=out / "logs" / "probe.log", timeout=120)
        probe.write_text(json.dumps({k: res.get(k) for k in ("read_gbps", "copy_gbps", "error")}))
    meta = {"run": out.name, "gpu": name, "bandwidth_gbps": bw, "vllm": version("vllm"),
            "probe": json.loads(probe.read_text())}
    walls: list[float] = []
    todo = [a for a in arms if not (out / "arms" / f"{a.name}.json").exists()]
    for i, arm in enumerate(todo):
        left = args.budget - (time.time() - t0) if args.budget else args.limit
        if args.budget and left < min(max(walls, default=FIRST_ARM_S), args.limit):
            print(f"budget: {len(todo) - i} arm(s) left; rerun the same command to continue", flush=True)
            break
        r = run_arm(arm, out, min(args.limit, left))
        if cut_by_budget(r, left, args.limit):  # run it again
            (out / "arms" / f"{arm.name}.json").unlink()
            print(f"budget: {arm.name} cut; rerun the same command to continue", flush=True)
            break
        walls.append(r.get("wall_s") or 0)
        save_all(out, meta)
    doc = save_all(out, meta)
    for f in doc["fits"]:
        print(json.dumps({k: f.get(k) for k in ("format", "drafter", "gdn_layer_ms", "attention_layer_ms", "fixed_ms",
                                                "drafter_ms", "arm", "pipeline_ms", "error")}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
