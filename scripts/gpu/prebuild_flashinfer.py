"""Build FlashInfer's JIT modules that the GPU runs need, before their workers ask.

On a fresh GPU machine, vLLM 0.33's FlashInfer backend builds its attention kernels for an fp8 KV
cache on first use, minutes each; in the thirteenth session they were still building when an arm's
limit came, after its KV cache was allocated. Started in the background at the beginning of a call,
this builds the same modules (FlashInfer's file lock makes a worker that asks meanwhile wait for the
build instead of starting its own), one after the other, and says how long each took:

    python3 scripts/gpu/prebuild_flashinfer.py > OUT/prebuild.log 2>&1 &
    python3 scripts/gpu/prebuild_flashinfer.py --list      # the module names; builds nothing
    python3 scripts/gpu/prebuild_flashinfer.py --no-topk   # the attention modules only

First FlashInfer's radix top-k (``topk``): vLLM 0.33's ``LogitsProcessor.get_top_k_tokens`` takes
it wherever FlashInfer can build, and the DFlash2 drafter's candidate selector asks for it on its
first step (``--no-topk`` leaves it out: runs that take torch's top-k instead, the GPU harness's
``DUALGPU_GPU_TORCH_TOPK=1``, do not ask for it, and its build, more than 22 minutes beside three
tests, would keep the attention modules behind it). In the twenty-third session the DFlash2
test's stock run and the W8A16 + DFlash2 expert each waited on its build until their limits (more
than six minutes on 16 cores: ``cub_topk.cu``).
Then the attention modules the reference shapes (head dim 256) ask for with an fp8 KV cache on the
virtual pair: rank 0, presenting capability 8.9, runs FlashInfer's FA2 prefill and decode with bf16
queries; rank 1, presenting 9.0, its SM90 (FA3) prefill with fp8 queries. The names are FlashInfer's
(the log's "Building JIT module ..." lines); FlashInfer compiles for the real GPU (torch's
capability, which the plugin does not change), as the workers' builds do.
"""

from __future__ import annotations

import argparse
import os
import sys
import time


def specs() -> list:
    import torch
    from flashinfer import prefill
    from flashinfer.jit.attention import modules
    from flashinfer.jit.topk import gen_topk_module

    bf16, fp8, i32 = torch.bfloat16, torch.float8_e4m3fn, torch.int32
    rest = (256, 256, 0, False, False)  # head dims qk/vo, no RoPE in the kernel, no window, no soft cap
    return [
        gen_topk_module(),
        prefill._gen_batch_prefill_primary_module("fa2", bf16, fp8, bf16, i32, *rest, False),
        modules.gen_batch_prefill_module("fa3", fp8, fp8, bf16, i32, *rest, False),
        modules.gen_batch_decode_module(bf16, fp8, bf16, i32, *rest),
    ]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--list", action="store_true", help="print the module names; build nothing")
    ap.add_argument("--no-topk", action="store_true",
                    help="leave out FlashInfer's top-k (for runs on torch's top-k: DUALGPU_GPU_TORCH_TOPK=1)")
    args = ap.parse_args(argv)
    if args.list:  # the names do not depend on the GPU: list them on a machine without one too
        os.environ.setdefault("FLASHINFER_CUDA_ARCH_LIST", "9.0")
    for spec in specs():
        if args.no_topk and spec.name == "topk":
            continue
        if args.list:
            print(spec.name)
            continue
        start = time.time()
        try:
            spec.build(need_lock=True)  # a worker asking meanwhile waits on the same lock
        except Exception as exc:  # one module's failure leaves the others to build
            print(f"prebuild: {spec.name} failed after {time.time() - start:.0f} s: {exc}", flush=True)
            continue
        print(f"prebuild: {spec.name} built in {time.time() - start:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
