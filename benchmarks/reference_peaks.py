"""The plan against the reference setup's own measured peaks, on its real cards (no GPU needed).

The reference setup (ExTV/dual-gpus-vllm, docs/benchmarks.md at 2b33255, "Context and memory")
published each launcher's per-GPU peak through a 250K-token prompt on its RTX 4070 Ti SUPER
(rank 0, headless) and RTX 5090 (rank 1, "Peaks include the desktop's share of the 5090, about
0.4 GiB during these runs"), vLLM 0.30.0 with its patches, its launchers' flags. This asks the
planner the expert's question on those two cards (the launcher's split and block count, its block
size and drafter flags, no image: the text forward pass instead of the vision encoder's) and prints
each rank's planned peak against the published one less the desktop's share on the RTX 5090.

Only the launchers whose block count means the same KV pool here are compared: W8A16 + DFlash2
(19/45: the package's grouping is the reference's, 375 blocks of 1,664 tokens) and FP8 + MTP
(20/44, 180 blocks of 1,600). At 13/51 and 21/43 the package groups the KV differently from the
reference's patch 11, so the same 375 blocks are another pool.

    python benchmarks/reference_peaks.py            # the table
    python benchmarks/reference_peaks.py --json     # the same as JSON
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import headline as hl  # noqa: E402

from vllm_dualgpu import planner as P  # noqa: E402
from vllm_dualgpu.planner.memory import MemoryModel, activation_bytes  # noqa: E402

MIB = 1 << 20
REAL_PAIR = "RTX 4070 Ti SUPER,RTX 5090"  # rank 0 first, as the reference orders them
DESKTOP_MIB = 410  # "about 0.4 GiB" of the RTX 5090's peaks were the desktop's
#: Published peaks through a 250K prompt, MiB (RTX 4070 Ti SUPER, RTX 5090 with the desktop)
PUBLISHED = {"w8a16-dflash2": (13_973, 31_473), "fp8-mtp": (14_439, 30_897)}
#: The launchers' checkpoints as the plan reads them (docs/recipes.md's "Planned with")
FORMATS = {"w8a16-dflash2": "int8-g128,embedding=int8-g128", "fp8-mtp": "fp8"}
DRAFTER = ROOT / "tests" / "fixtures" / "dflash2_drafter.json"
#: The reference's launchers set VLLM_FLASHINFER_WORKSPACE_BUFFER_SIZE=134217728
EXPERT_FLASHINFER_WORKSPACE = 128 * MIB


def expert_plan(launcher: str, weight_format: str, gpus: str, blocks: int, draft_config: dict,
                memory: MemoryModel | None = None) -> P.Plan:
    """The planner's answer to the expert's flags of ``launcher`` on ``gpus`` (rank 0 first)."""
    model = P.ModelSpec.from_hf_config(P.reference_config(), weight_format=weight_format)
    expert = hl.EXPERT[launcher]
    if launcher.endswith("-mtp"):
        spec, block = {"method": "mtp", "num_speculative_tokens": 3}, hl.MTP_BLOCK
    else:
        spec = {"method": "dflash", "num_speculative_tokens": hl.DFLASH_TOKENS, "attention_backend": "TRITON_ATTN",
                "draft_config": draft_config}
        block = expert["block_size"]
    request = P.PlanRequest(
        max_model_len=262_144, kv_cache_dtype="fp8", max_num_seqs=2, max_num_batched_tokens=1024,
        speculative=spec, layer_partition=expert["partition"], gpu_order=[0, 1], block_size=block,
        num_gpu_blocks_override=blocks, enable_prefix_caching=True,
        kv_cache_memory_bytes=hl.EXPERT_COMMON["kv_cache_memory_bytes"],
        drafter_shares_embedding=True, kv_grouping="dualgpu", memory=memory or MemoryModel())
    return P.fit(model, P.parse_gpus(gpus), request).plan


def text_pass_peaks_mib(plan: P.Plan, memory: MemoryModel | None = None) -> list[int]:
    """Each rank's planned peak without an image: the text forward pass where the plan charges
    the vision encoder's."""
    model = P.ModelSpec.from_hf_config(P.reference_config())
    text = activation_bytes(model, 1024, memory or MemoryModel())
    out = []
    for r in plan.ranks:
        peak = r.weights_bytes + r.fixed_bytes + r.reserve_bytes + r.kv_cache_bytes
        if "vision_encoder" in r.reserve_detail:
            peak += text - r.reserve_detail["vision_encoder"]
        out.append(round(peak / MIB))
    return out


def rows() -> list[dict]:
    draft = json.loads(DRAFTER.read_text())
    out = []
    for launcher, published in PUBLISHED.items():
        real = [published[0], published[1] - DESKTOP_MIB]
        for label, memory in (("vLLM's FlashInfer workspace (the plugin)", MemoryModel()),
                              ("the expert's 128 MiB FlashInfer workspace",
                               dataclasses.replace(MemoryModel(), flashinfer_workspace_bytes=EXPERT_FLASHINFER_WORKSPACE))):
            plan = expert_plan(launcher, FORMATS[launcher], REAL_PAIR, hl.EXPERT_BLOCKS[launcher], draft, memory)
            planned = text_pass_peaks_mib(plan, memory)
            out.append({"launcher": launcher, "memory": label, "blocks": plan.num_blocks,
                        "partition": plan.partition, "planned_mib": planned, "published_mib": real,
                        "planned_minus_published_mib": [p - r for p, r in zip(planned, real)]})
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    table = rows()
    if args.json:
        print(json.dumps(table, indent=1))
        return 0
    print("| launcher | FlashInfer workspace | split, blocks | planned peak (MiB) | published (MiB) | planned - published |")
    print("|---|---|---|---|---|---|")
    for r in table:
        pair = lambda v: " / ".join(f"{x:,}" for x in v)  # noqa: E731
        print(f"| {r['launcher']} | {r['memory']} | {'/'.join(map(str, r['partition']))}, {r['blocks']} | "
              f"{pair(r['planned_mib'])} | {pair(r['published_mib'])} | "
              f"{' / '.join(f'{x:+,}' for x in r['planned_minus_published_mib'])} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
