"""``vllm-dualgpu doctor``: what this machine and the installed vLLM give the plugin to work with.

Prints, briefly: each visible GPU (name, capability, memory, bandwidth class), whether the native
extension loads, which run-time patches would apply to the installed vLLM (a dry run of the
registry: version range, target and parameters; nothing is changed), and which tuned kernel
configs the package ships for each card. Works without GPUs and says so. Exit status 1 when
something that should work here does not (the extension is missing, or a required patch would
be skipped while GPUs are visible), else 0.
"""

from __future__ import annotations

import os
import re
from collections import Counter
from pathlib import Path

GiB = 1024**3

# Peak memory bandwidth, GB/s: decode speed of a pipeline stage scales with it.
BANDWIDTH_CLASSES = ((2000.0, "very high (HBM)"), (1000.0, "high"), (500.0, "medium"), (0.0, "low"))

_DEVICE_IN_FILE = re.compile(r"device_name=([^,]+?)(?:,|\.json$)")


def add_parser(sub) -> None:
    p = sub.add_parser(
        "doctor",
        help="check the GPUs, the native extension, which patches apply to this vLLM, tuned configs",
    )
    p.set_defaults(run=run)


def bandwidth_class(gbps: float | None) -> str:
    if gbps is None:
        return "bandwidth unknown"
    label = next(name for floor, name in BANDWIDTH_CLASSES if gbps >= floor)
    return f"{gbps:,.0f} GB/s, {label}"


def gpu_lines(read=None) -> tuple[list[str], list]:
    """Lines about each visible GPU, and the GPUs (empty when none or NVML is missing)."""
    if read is None:
        from vllm_dualgpu.nvml import read_visible_gpus as read
    try:
        gpus = read()
    except Exception as exc:  # no driver, no NVML, bad CUDA_VISIBLE_DEVICES
        return [f"GPUs: none visible ({type(exc).__name__}: {exc})".rstrip()], []
    if not gpus:
        return ["GPUs: none visible (NVML found no device)"], []
    lines = ["GPUs (NVML; CUDA_VISIBLE_DEVICES order):"]
    for i, g in enumerate(gpus):
        major, minor = g.capability
        lines.append(
            f"  {i}: {g.name} (GPU {g.physical_id}), sm_{major}{minor} ({major}.{minor}), "
            f"{g.total_bytes / GiB:.1f} GiB total, {g.free_bytes / GiB:.1f} GiB free, "
            f"{bandwidth_class(g.bandwidth_gbps)}"
        )
    return lines, gpus


def extension_lines() -> tuple[list[str], bool]:
    try:
        import importlib

        ext = importlib.import_module("vllm_dualgpu._C")
    except ImportError as exc:
        return [
            f"Native extension: NOT importable ({exc}); reinstall vllm-dualgpu with a C++ "
            "compiler present (no CUDA toolkit needed)"
        ], False
    hook = "with the sm hook" if hasattr(ext, "plt_hook") else "WITHOUT the sm hook (old build)"
    version = getattr(ext, "__version__", "?")
    return [f"Native extension: vllm_dualgpu._C {version} importable, {hook}"], True


def installed_vllm() -> str | None:
    import importlib.metadata

    try:
        return importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return None


def patch_lines(version: str, patches=None) -> tuple[list[str], list]:
    """One line per registry patch: would it apply to this vLLM (dry run)."""
    from vllm_dualgpu.patching.core import ALREADY, READY, check_patch

    if patches is None:
        from vllm_dualgpu.patching.registry import PATCHES as patches
    lines = [
        f"Run-time patches for vLLM {version} "
        "(dry run; worker patches act only under the dualgpu executor):"
    ]
    outcomes = []
    width = max((len(p.name) for p in patches), default=0)
    for p in patches:
        try:
            out = check_patch(p, version)
            status, reason = out.status, out.reason
        except Exception as exc:  # a target module that fails to import in an unexpected way
            out, status, reason = None, "failed", f"check failed: {type(exc).__name__}: {exc}"
        outcomes.append((p, status))
        word = {READY: "applies", ALREADY: "applied"}.get(status, status)
        where = ",".join(p.processes)
        text = f"  {word:<8} {p.name:<{width}}  [{where}]"
        if reason:
            text += f"  {_one_line(reason)}"
        lines.append(text)
    return lines, outcomes


def _one_line(text: str, limit: int = 160) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def config_devices(folder: Path) -> Counter:
    """How many config files in ``folder`` name each device (``device_name=...`` in the name)."""
    found: Counter = Counter()
    if folder.is_dir():
        for f in folder.iterdir():
            m = _DEVICE_IN_FILE.search(f.name)
            if m and f.is_file():
                found[m.group(1)] += 1
    return found


def config_lines(gpus, folder: Path | None = None) -> list[str]:
    from vllm_dualgpu.kernels.fp8_configs import device_name_as_file_name, package_config_dir

    folder = package_config_dir() if folder is None else folder
    found = config_devices(folder)
    lines = [f"Tuned kernel configs ({folder}):"]
    cards = {name: device_name_as_file_name(name) for name in dict.fromkeys(g.name for g in gpus)}
    for name, file_name in cards.items():
        n = found.get(file_name, 0)
        missing = "" if n else f" (none named {file_name})"
        lines.append(f"  {name}: {n} file{'s' if n != 1 else ''}{missing}")
    others = {k: v for k, v in found.items() if k not in cards.values()}
    if others:
        listed = ", ".join(f"{k} ({v})" for k, v in sorted(others.items()))
        lines.append(f"  {'also for' if cards else 'for'}: {listed}")
    elif not found:
        lines.append("  none")
    return lines


def report() -> tuple[list[str], int]:
    """The doctor's lines and its exit status."""
    from vllm_dualgpu._version import SUPPORTED_VLLM, __version__
    from vllm_dualgpu.patching.core import SKIPPED, version_in_range

    version = installed_vllm()
    supported = version is not None and version_in_range(version, SUPPORTED_VLLM)
    head = f"vllm-dualgpu {__version__} doctor: vLLM {version or 'not installed'}"
    if not supported:
        head += f" (the plugin supports {SUPPORTED_VLLM} and stays off with this one)"
    lines = [head]
    problems = 0

    more, gpus = gpu_lines()
    lines += more
    more, ok = extension_lines()
    lines += more
    problems += not ok
    if version is not None:
        more, outcomes = patch_lines(version)
        lines += more
        if gpus and supported:
            problems += sum(1 for p, s in outcomes if s in (SKIPPED, "failed") and not p.optional
                            and version_in_range(version, p.vllm_versions))  # not other releases' entries
        if not gpus:
            lines.append(
                "  (without a CUDA driver, patches of vllm.platforms.cuda cannot be checked here)"
            )
    lines += config_lines(gpus)
    return lines, (1 if problems else 0)


def run(args) -> int:
    # Patch checks import vLLM modules; keep their log lines out of the report.
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    lines, status = report()
    print("\n".join(lines))
    return status
