#!/usr/bin/env python3
"""Hold GPU memory so that a GPU has only FREE_GIB free: emulates a smaller card.

    python scripts/gpu/ballast.py GPU FREE_GIB READY_FILE

Allocates in chunks until free memory is within 64 MiB of the target, writes the free bytes it
left to READY_FILE, then sleeps until killed.
"""

import sys
import time

import torch


def main() -> None:
    gpu, free_gib, ready = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
    torch.cuda.set_device(gpu)
    target = int(free_gib * 1024**3)
    held = []
    while True:
        free, _ = torch.cuda.mem_get_info(gpu)
        excess = free - target
        if excess < 64 * 1024**2:
            break
        chunk = min(excess, 8 * 1024**3) if excess > 1024**3 else excess - 16 * 1024**2
        held.append(torch.empty(max(chunk, 1), dtype=torch.uint8, device=f"cuda:{gpu}"))
    free, total = torch.cuda.mem_get_info(gpu)
    with open(ready, "w") as f:
        f.write(f"{free} {total}\n")
    print(f"ballast on GPU {gpu}: {free / 1024**3:.2f} GiB free of {total / 1024**3:.2f}", flush=True)
    while True:
        time.sleep(3600)


if __name__ == "__main__":
    main()
