"""`vllm-dualgpu calibrate`: measure each visible GPU's memory bandwidth and keep it for `plan`.

On every visible CUDA GPU it times, with CUDA events, a read pass (a large bf16 buffer summed:
the shape of decode's weight reads) and a device-to-device copy, and writes the medians to the
machine profile (default $XDG_CACHE_HOME/vllm-dualgpu/machine-profile.json). `plan` and the
executor then predict decode time from the measured read bandwidth instead of the datasheet's.
"""

from __future__ import annotations

import argparse
import os
import sys

DEFAULT_SECONDS = 5.0


def add_parser(sub) -> None:
    p = sub.add_parser(
        "calibrate",
        help="measure each GPU's memory bandwidth for plan's decode estimate (needs the GPUs)",
        description=__doc__.split("\n\n", 1)[1] if __doc__ else None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--output", metavar="PATH",
                   help="where to write the profile (default: $VLLM_DUALGPU_MACHINE_PROFILE, else "
                        "$XDG_CACHE_HOME/vllm-dualgpu/machine-profile.json, else under ~/.cache)")
    p.add_argument("--seconds", type=float, default=DEFAULT_SECONDS,
                   help=f"seconds of timed repeats per GPU, split between the two passes (default {DEFAULT_SECONDS:g})")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(run=run)


class _Fail(Exception):
    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.code = code


def datasheet_gbps(gpu) -> float | None:
    """The datasheet figure (planner/gpus.py's KNOWN_GPUS), else NVML's peak."""
    from vllm_dualgpu.planner.gpus import lookup

    known = lookup(gpu.name)
    return float(known.bandwidth_gbps) if known is not None else gpu.bandwidth_gbps


def _version(name: str) -> str | None:
    import importlib.metadata as md

    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None


def _output(args):
    from pathlib import Path

    from vllm_dualgpu import machine_profile

    if args.output:
        return Path(args.output).expanduser()
    path = machine_profile.default_path()
    if path is None:
        raise _Fail("VLLM_DUALGPU_MACHINE_PROFILE=none: give --output PATH for the profile", 2)
    return path


def _measure_all(gpus, seconds: float, progress: bool) -> list:
    from vllm_dualgpu import bandwidth_probe

    out = []
    for i, g in enumerate(gpus):
        bar = None
        if progress:
            from tqdm import tqdm

            bar = tqdm(total=round(seconds, 1), unit="s", desc=f"GPU {i} {g.name}", leave=False,
                       bar_format="{desc}: {percentage:3.0f}%|{bar}| {n:.1f}/{total:.1f} s")

        def tick(dt, bar=bar):
            if bar is not None:
                bar.update(min(round(dt, 2), max(bar.total - bar.n, 0)))

        try:
            out.append(bandwidth_probe.measure(i, seconds, tick))
        except Exception as e:  # no CUDA torch, out of memory, a driver error
            raise _Fail(f"GPU {i} ({g.name}): cannot measure ({type(e).__name__}: {e})", 1) from None
        finally:
            if bar is not None:
                bar.close()
    return out


def table(rows) -> str:
    """One line per GPU: index, name, datasheet, measured read and copy GB/s, read/datasheet."""
    head = ("GPU", "name", "datasheet GB/s", "read GB/s", "copy GB/s", "read/datasheet")
    cells = [head] + [(str(i), m.name, "unknown" if m.datasheet_gbps is None else f"{m.datasheet_gbps:,.0f}",
                       f"{m.read_gbps:,.0f}", f"{m.copy_gbps:,.0f}",
                       f"{m.read_gbps / m.datasheet_gbps:.2f}" if m.datasheet_gbps else "-")
                      for i, m in enumerate(rows)]
    widths = [max(len(r[c]) for r in cells) for c in range(len(head))]
    return "\n".join("  ".join(v.ljust(w) if c == 1 else v.rjust(w) for c, (v, w) in enumerate(zip(r, widths)))
                     for r in cells)


def run(args) -> int:
    from datetime import datetime, timezone

    from vllm_dualgpu import machine_profile, nvml

    try:
        if not args.seconds > 0:
            raise _Fail(f"--seconds {args.seconds:g}: give a positive number of seconds", 2)
        path = _output(args)
        # CUDA numbers the GPUs as NVML does (PCI bus order), as the executor has it.
        os.environ["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
        try:
            gpus = nvml.read_visible_gpus()
        except Exception as e:
            raise _Fail(f"cannot read the GPUs through NVML ({e}); calibrate measures this machine's "
                        "NVIDIA GPUs (vllm-dualgpu doctor says what is missing)", 1) from None
        if not gpus:
            raise _Fail("NVML sees no GPU here (CUDA_VISIBLE_DEVICES may hide them): nothing to measure", 1)
        measured = _measure_all(gpus, args.seconds, not args.no_progress)
    except _Fail as e:
        print(f"vllm-dualgpu calibrate: {e}", file=sys.stderr)
        return e.code
    rows = tuple(machine_profile.MeasuredGpu(
        uuid=g.uuid, name=g.name, pci_bus_id=g.pci_bus_id, total_bytes=g.total_bytes,
        datasheet_gbps=datasheet_gbps(g), read_gbps=round(m.read_gbps, 1), copy_gbps=round(m.copy_gbps, 1))
        for g, m in zip(gpus, measured))
    profile = machine_profile.MachineProfile(
        created=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        torch=_version("torch"), vllm=_version("vllm"), gpus=rows)
    try:
        machine_profile.write(profile, path)
    except OSError as e:
        print(f"vllm-dualgpu calibrate: cannot write {path} ({e}); give another --output", file=sys.stderr)
        return 1
    size = measured[0].buffer_bytes
    print(f"vllm-dualgpu calibrate: memory bandwidth, median of timed repeats (GB/s, decimal; "
          f"buffer {size / 2**20:,.0f} MiB on GPU 0)")
    print(table(rows))
    print(f"Wrote {path}: vllm-dualgpu plan and the dualgpu executor predict decode time from the "
          "read column (plan --profile none: without it).")
    return 0
