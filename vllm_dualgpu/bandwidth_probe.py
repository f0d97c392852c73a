"""The memory bandwidth one CUDA GPU reaches (``vllm-dualgpu calibrate``), timed with CUDA events.

Two passes over one buffer of min(1 GiB, 1/8 of free memory): a read (a bf16 buffer summed, the
shape of decode's weight reads) and a device-to-device copy (bytes read plus bytes written). Each
pass has a few warm-ups, then repeats for its share of the time; the median repeat counts.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable

GIB = 1 << 30
ALIGN = 2 << 20
WARMUPS = 3
MIN_REPEATS = 5
BATCH = 10  # repeats between two host waits


@dataclass(frozen=True)
class Measured:
    read_gbps: float  # GB/s, decimal
    copy_gbps: float  # bytes read + bytes written, GB/s
    buffer_bytes: int


def buffer_bytes(free_bytes: int) -> int:
    """min(1 GiB, free / 8), in whole 2 MiB."""
    return max(min(GIB, free_bytes // 8) // ALIGN * ALIGN, ALIGN)


def measure(device: int, seconds: float, progress: Callable[[float], None] | None = None) -> Measured:
    """Read and copy bandwidth of CUDA device ``device`` over about ``seconds``; ``progress`` is
    called with the seconds each batch of repeats took."""
    import torch

    if not torch.cuda.is_available() or device >= torch.cuda.device_count():
        raise RuntimeError(f"torch sees no CUDA device {device} (torch {torch.__version__}, "
                           f"{torch.cuda.device_count() if torch.cuda.is_available() else 0} CUDA devices)")
    dev = torch.device("cuda", device)
    with torch.cuda.device(dev):
        free, _ = torch.cuda.mem_get_info(dev)
        nbytes = buffer_bytes(free)
        src = torch.ones(nbytes // 2, dtype=torch.bfloat16, device=dev)
        dst = torch.empty_like(src)
        try:
            read_ms = _median_ms(lambda: src.sum(dtype=torch.float32), seconds / 2, progress)
            copy_ms = _median_ms(lambda: dst.copy_(src), seconds / 2, progress)
        finally:
            del src, dst
            torch.cuda.empty_cache()
    return Measured(nbytes / read_ms / 1e6, 2 * nbytes / copy_ms / 1e6, nbytes)


def _median_ms(fn, budget_s: float, progress) -> float:
    import torch

    for _ in range(WARMUPS):
        fn()
    torch.cuda.synchronize()
    times: list[float] = []
    start = last = time.perf_counter()
    while True:
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(BATCH)]
        for a, b in events:
            a.record()
            fn()
            b.record()
        events[-1][1].synchronize()
        times += [a.elapsed_time(b) for a, b in events]
        now = time.perf_counter()
        if progress is not None:
            progress(now - last)
        last = now
        if now - start >= budget_s and len(times) >= MIN_REPEATS:
            return statistics.median(times)
