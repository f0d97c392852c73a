#!/usr/bin/env python3
"""Issue #26's starting point: how far the planner's decode prediction (bytes read / memory
bandwidth, a lower bound) is from the decode the virtual pair measured, per launcher, split and
context.

    python benchmarks/speed_bound.py [OUT.json]      # default: the committed file below

Measured: the headline arms that ran ALONE on the virtual 16 + 32 GiB pair (vLLM 0.33.0, one
H200, both ranks on it), decode ms per step at 64 / 32K / 250K tokens of context (``MEASURED``:
each arm's result file). Predicted: the planner asked as ``vllm-dualgpu plan`` asks it for the
same launcher flags at the arm's split (``--layer-partition``), its decode predicted at the
measured context (``PlanRequest.decode_context_tokens``, which a one-pipeline ``plan`` does not
take on its command line), both virtual cards at
the H200's read bandwidth as ``vllm-dualgpu calibrate`` measured it (4,151 GB/s,
benchmarks/results/2026-12-02-decode-model/probe.json), so the bound is what this GPU could do.
Both ranks share the one GPU, so a step is rank 0's pass, then rank 1's, plus the socket hops
(~2.25 ms a message here): the measured figure is the pair's serial time, as the bound's sum is.
What the bound leaves out, and the ratio therefore holds: kernel efficiency below the read
bandwidth, the drafter's own passes (random weights: every draft rejected, so a step is one
target pass over 1 + k tokens plus the drafter's), sampling and scheduling, the pipeline hops,
and torch's vocabulary top-k on the DFlash2 arms (``vocab_topk``).

Not the calibrated model issue #26 asks for (``speed-model.json``): its baseline.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))
import headline as hl  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
OUT = RESULTS / "2026-12-04-speed-model" / "bound-vs-measured.json"
READ_GBPS = round(json.loads((RESULTS / "2026-12-02-decode-model" / "probe.json").read_text())["read_gbps"])
PAIR = f"RTX 4070 Ti SUPER:16GiB:bw={READ_GBPS}:display=no,RTX 5090:32GiB:bw={READ_GBPS}:display=yes"
#: (launcher, arm, result file): arms that ran alone on the GPU
MEASURED = [
    ("nvfp4-dflash2", "plugin", "2026-12-04-headline-virtual-run10/hl/arms/nvfp4-dflash2_plugin.json"),
    ("fp8-mtp", "split-at-expert", "2026-12-04-headline-virtual-run10/hl/arms/fp8-mtp_split-at-expert.json"),
    ("fp8-dflash2", "plugin", "2026-12-04-headline-virtual-run11/hl/arms/fp8-dflash2_plugin.json"),
    ("fp8-mtp", "expert", "2026-12-04-headline-virtual-run11/hl/arms/fp8-mtp_expert.json"),
    ("fp8-mtp", "expert-run12", "2026-12-04-headline-virtual-run12/hl/headline/arms/fp8-mtp_expert.json"),
    ("fp8-mtp", "at-expert-graphs", "2026-12-04-headline-virtual-run12/hl/headline/arms/fp8-mtp_at-expert-graphs.json"),
    ("fp8-mtp", "at-expert-graphs-xqa",
     "2026-12-04-headline-virtual-run12/hl-cubin/headline/arms/fp8-mtp_at-expert-graphs.json"),
    ("fp8-dflash2", "plugin-xqa", "2026-12-04-headline-virtual-run13/hl/headline/arms/fp8-dflash2_plugin.json"),
]
#: arms whose SM 9.0 rank verified the draft tokens through FlashInfer's XQA decode (the twelfth run's
#: queue line set VLLM_HAS_FLASHINFER_CUBIN=1; from the thirteenth run the executor's patch
#: flashinfer-xqa-offline); every other arm ran vLLM's offline path, which verifies them as
#: prefills without a KV split on that rank (docs/benchmarks.md, "Twelfth run")
XQA_ARMS = {("fp8-mtp", "at-expert-graphs-xqa"), ("fp8-dflash2", "plugin-xqa")}
KEYS = {"short": "short", "mid": "32k", "long": "250k"}


def predicted_ms(launcher: str, split: list[int], context: int, tmp: Path) -> float:
    """The plan's bound for the arm's own checkpoint (the headline's dummy model of the launcher's
    format, as the executor read it) at ``split``, predicted at ``context`` tokens (the planner's
    ``decode_context_tokens``), on the pair at the H200's bandwidth."""
    import dataclasses

    from vllm_dualgpu import planner as P
    from vllm_dualgpu.cli import plan as cli_plan

    target = hl.reference_model(tmp, hl.QUANT[launcher], tokenizer=False)
    drafter = hl.drafter_model(tmp)
    argv = [str(target), "--gpus", PAIR, "--max-model-len", str(hl.MAX_MODEL_LEN),
            "--kv-cache-dtype", "fp8", "--enable-prefix-caching", "--max-num-seqs", "2",
            "--max-num-batched-tokens", "1024", "--speculative-config", json.dumps(hl.speculative(launcher, drafter)),
            "--layer-partition", ",".join(map(str, split)), "--gpu-order", "0,1"]
    q = cli_plan.ask(argv)  # plan's own question
    request = dataclasses.replace(q.request, decode_context_tokens=context)
    plan = P.fit(q.model, q.gpus, request).plan  # the arm's split and flags; whether it fits is not asked here
    if plan.predicted_decode_ms is None:
        raise RuntimeError(f"{launcher} {split} at {context}: no prediction")
    return plan.predicted_decode_ms


def rows() -> list[dict]:
    out = []
    with tempfile.TemporaryDirectory() as d:
        for launcher, arm, path in MEASURED:
            r = json.loads((RESULTS / path).read_text())
            for key, label in KEYS.items():
                m = r.get(key) or {}
                if m.get("decode_ms_per_step") is None:
                    continue
                pred = predicted_ms(launcher, r["partition"], m["context"], Path(d))
                out.append({"launcher": launcher, "arm": arm, "split": r["partition"], "context": m["context"],
                            "predicted_ms": round(pred, 2), "measured_ms": m["decode_ms_per_step"],
                            "measured_over_predicted": round(m["decode_ms_per_step"] / pred, 2),
                            "cudagraph_mode": (r["kwargs"].get("compilation_config") or {}).get("cudagraph_mode",
                                                                                                "vLLM's default"),
                            "vocab_topk": r.get("vocab_topk"),
                            "verify": "xqa" if (launcher, arm) in XQA_ARMS else "prefill path (offline)",
                            "source": f"benchmarks/results/{path}"})
    return out


def table(data: list[dict]) -> str:
    lines = ["| launcher | arm | split | verify on rank 1 | context | bound (ms) | measured (ms) | measured / bound |",
             "|---|---|---|---|---|---|---|---|"]
    for x in data:
        lines.append(f"| {x['launcher']} | {x['arm']} | {x['split'][0]}/{x['split'][1]} | {x['verify']} | "
                     f"{x['context']:,} | {x['predicted_ms']:.1f} | {x['measured_ms']:.1f} | "
                     f"{x['measured_over_predicted']:.2f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else OUT
    data = rows()
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(data, indent=1) + "\n")
    print(table(data))
