#!/usr/bin/env python3
"""Issue #3 measurement: stock vLLM vs vllm-dualgpu on an emulated 32 GiB + 16 GiB pair.

    python benchmarks/memory_sweep.py OUTDIR [--full-sweep] [--skip stock,sweep,full-context] [--models DIR]

GPU 0 keeps 32 GiB free and GPU 1 16 GiB (ballast processes hold the rest), so the big card comes
first in PCI order and the plugin has to reorder. Model: Qwen3-14B-class shapes with block-FP8
weights (dummy), bf16 KV, eager mode, max_model_len 32768. Runs: stock (mp) at utilization
0.90 / 0.11 / 0.10; the plugin with no extra flags (boot and a generation); the plugin over layer
splits around its own (+-1, +-2 and the even split; --full-sweep adds +-4 and +-6); the plugin
with the model's full 262,144 context (expected to refuse with the largest that fits), each one
``vllm.LLM`` in a fresh process. Writes OUTDIR/memory_sweep.json, .md (the table) and .png (KV
pool per run, predicted vs sized). The claim (prediction within 5%) is test_gpu_memory_prediction.
The model folder lives under ``--models`` (model_folders.py: one folder per content, kept between
runs), not under OUTDIR: vLLM's compile cache is keyed by the model's path.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "gpu"))
from gpu_harness import GiB, ballast, grep, on_signals_stop_all, run_llm  # noqa: E402
from gpu_models import write_model  # noqa: E402
from model_folders import add_models_option, kept_folder  # noqa: E402

FREE = [32.0, 16.0]
# Every run takes vLLM's Triton block-FP8 GEMM (the kernel the reference small card uses), so each
# rank's tuned-config lookup shows in the log; the same for stock and plugin runs.
TRITON_ONLY = {"VLLM_DISABLED_KERNELS": ",".join([
    "FlashInferFp8DeepGEMMDynamicBlockScaledKernel", "DeepGemmFp8BlockScaledMMKernel",
    "CutlassFp8BlockScaledMMKernel", "B12xFp8BlockScaledMMKernel", "MarlinFP8ScaledMMLinearKernel",
    "HummingFP8ScaledMMLinearKernel"])}
PROMPTS = [[1 + (i * 7 + j) % 900 for j in range(64 + 40 * i)] for i in range(4)]


class NvmlSampler:
    """Used memory of every GPU every ``period`` s; ``.peak[i]`` is the highest seen."""

    def __init__(self, period: float = 0.25):
        import pynvml

        pynvml.nvmlInit()
        self.nvml, self.period = pynvml, period
        self.handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def used(self) -> list[int]:
        return [self.nvml.nvmlDeviceGetMemoryInfo(h).used for h in self.handles]

    def _run(self):
        while not self._stop.is_set():
            self.peak = [max(p, u) for p, u in zip(self.peak, self.used())]
            time.sleep(self.period)

    def __enter__(self):
        self.base = self.peak = self.used()
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()


def kv_facts(llm, generate: bool = False) -> dict:
    cfg = llm.llm_engine.vllm_config
    res = {"num_gpu_blocks": cfg.cache_config.num_gpu_blocks, "block_size": cfg.cache_config.block_size}
    if generate:
        from vllm import SamplingParams

        t = time.time()
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                            SamplingParams(temperature=0, max_tokens=32, ignore_eos=True), use_tqdm=False)
        res.update(generate_s=round(time.time() - t, 2), outputs=[len(o.outputs[0].token_ids) for o in outs])
    return res


def kv_facts_and_generate(llm) -> dict:
    return kv_facts(llm, generate=True)


def run_one(name: str, kwargs: dict, out: Path, env: dict | None = None, generate: bool = False,
            timeout: float = 300) -> dict:
    plan_file = out / "logs" / f"{name}.plan.json"
    env = {**TRITON_ONLY, **(env or {}), "VLLM_DUALGPU_PLAN_FILE": str(plan_file)}
    with NvmlSampler() as s:
        res = run_llm(kwargs, kv_facts_and_generate if generate else kv_facts, log=out / "logs" / f"{name}.log",
                      timeout=timeout, env=env)
    r = {"name": name, "env": env, "kwargs": kwargs, **{k: v for k, v in res.items() if k != "log"}}
    r["kv_tokens"] = res["num_gpu_blocks"] * res["block_size"] if "num_gpu_blocks" in res else None
    r["booted"] = r["kv_tokens"] is not None
    r["peak_used_gib"] = [round((pk - b) / GiB, 3) for pk, b in zip(s.peak, s.base)]
    r["rank_lines"] = grep(res["log"], r"vllm-dualgpu rank \d")
    r["refusals"] = [line[-400:] for line in grep(res["log"], r"ValueError|does not fit|less than desired")][:3]
    if plan_file.exists():
        r["plan"] = json.loads(plan_file.read_text())
    print(json.dumps({k: r.get(k) for k in ("name", "booted", "kv_tokens", "wall_s", "peak_used_gib")}), flush=True)
    return r


def predicted_tokens(r: dict) -> int | None:
    plan = r.get("plan") or {}
    return plan["num_blocks"] * r.get("block_size", 16) if plan.get("num_blocks") else None


def table(results: list[dict]) -> str:
    """Markdown: per run, the split, predicted vs sized KV pool, boot and peak memory."""
    rows = ["| run | split | boots | KV pool (tokens) | predicted | error | boot (s) | peak used GPU0 / GPU1 (GiB) |",
            "|---|---|---|---|---|---|---|---|"]
    for r in results:
        kv, pred = r["kv_tokens"], predicted_tokens(r)
        split = "/".join(map(str, (r.get("plan") or {}).get("partition", []))) or "even"
        err = f"{100.0 * (pred - kv) / kv:+.1f}%" if pred and kv else "-"
        rows.append(f"| {r['name']} | {split} | {'yes' if r['booted'] else 'no'} | {f'{kv:,}' if kv else '-'} | "
                    f"{f'{pred:,}' if pred else '-'} | {err} | {r.get('boot_s', '-')} | "
                    f"{' / '.join(f'{x:.2f}' for x in r['peak_used_gib'])} |")
    ranks = [line for r in results for line in r.get("rank_lines", [])]
    if ranks:
        rows += ["", "Per-rank summary lines (non-KV memory: vLLM's profile vs the plan):", ""]
        rows += [f"    {line.split('] ', 1)[-1]}" for line in ranks]
    return "\n".join(rows) + "\n"


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["name"] for r in results]
    fig, ax = plt.subplots(figsize=(max(6, len(names) * 0.9), 4))
    xs = range(len(names))
    ax.bar([x - 0.2 for x in xs], [r["kv_tokens"] or 0 for r in results], 0.4, label="sized by vLLM")
    ax.bar([x + 0.2 for x in xs], [predicted_tokens(r) or 0 for r in results], 0.4, label="predicted by the plan")
    ax.set_xticks(list(xs), names, rotation=30, ha="right")
    ax.set_ylabel("KV cache (tokens)")
    ax.set_title("32 GiB + 16 GiB (emulated): KV pool per run")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def save(results: list[dict], out: Path) -> None:
    (out / "memory_sweep.json").write_text(json.dumps(results, indent=1, default=str))
    (out / "memory_sweep.md").write_text(table(results))


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("outdir", type=Path)
    ap.add_argument("--full-sweep", action="store_true")
    ap.add_argument("--skip", default="", help="comma-separated: stock, sweep, full-context")
    add_models_option(ap)
    return ap


def main() -> int:
    args = build_parser().parse_args()
    skip = set(filter(None, args.skip.split(",")))
    out = args.outdir.resolve()
    out.mkdir(parents=True, exist_ok=True)
    on_signals_stop_all()
    preset = "qwen3-14b-fp8"  # config and tokenizer (dummy weights); vLLM hashes the folder's path as given
    model = kept_folder(args.models.expanduser().resolve(), preset, lambda d: write_model(preset, d))
    base = {"model": str(model), "load_format": "dummy", "enforce_eager": True, "max_model_len": 32768,
            "pipeline_parallel_size": 2}
    plugin = {**base, "distributed_executor_backend": "dualgpu"}
    results: list[dict] = []

    def run(*a, **kw) -> dict:  # every result is written as soon as it exists: a time limit keeps the rest
        results.append(run_one(*a, **kw))
        save(results, out)
        return results[-1]

    with ballast(FREE, out / "logs"):
        for u in () if "stock" in skip else (0.90, 0.11, 0.10):
            run(f"stock_u{u:.2f}", {**base, "distributed_executor_backend": "mp", "gpu_memory_utilization": u}, out)
        chosen = (run("dualgpu", plugin, out, generate=True, timeout=420).get("plan") or {}).get("partition") or [12, 28]
        steps = (-6, -4, -2, -1, 1, 2, 4, 6) if args.full_sweep else (-2, -1, 1, 2)
        splits = [[chosen[0] + d, 40 - chosen[0] - d] for d in steps if 0 < chosen[0] + d < 40]
        if [20, 20] not in splits and chosen != [20, 20]:
            splits.append([20, 20])
        for sp in [] if "sweep" in skip else splits:
            run(f"split_{sp[0]}_{sp[1]}", plugin, out, env={"VLLM_PP_LAYER_PARTITION": f"{sp[0]},{sp[1]}"})
        if "full-context" not in skip:
            run("dualgpu_full_context", {k: v for k, v in plugin.items() if k != "max_model_len"}, out)
    plot(results, out / "memory_sweep.png")
    print(table(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
